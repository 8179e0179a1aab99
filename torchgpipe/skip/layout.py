"""The skip layout: which partition stashes and which pops each skip tensor."""
from typing import Dict, Iterable, List, Sequence, Tuple

from torch import nn

from torchgpipe.skip.namespace import Namespace

__all__ = ['SkipLayout', 'inspect_skip_layout']


class SkipLayout:
    """Where each skip tensor goes from and to, by partition.

    Args:
        num_partitions (int): the number of partitions
        skip_routes: for each ``(namespace, name)``, the partitions that
            stash and pop it
    """

    def __init__(self, num_partitions: int,
                 skip_routes: Dict[Tuple[Namespace, str], Tuple[int, int]]) -> None:
        self.by_ns_name = skip_routes
        self.by_partition: List[List[Tuple[int, Namespace, str]]] = \
            [[] for _ in range(num_partitions)]
        for (ns, name), (prev_j, next_j) in skip_routes.items():
            self.by_partition[next_j].append((prev_j, ns, name))
        for routes in self.by_partition:
            routes.sort()

    def copy_policy(self, next_j: int) -> Iterable[Tuple[int, Namespace, str]]:
        """Generates the skips that partition ``next_j`` pops from another partition.

        Yields:
            (prev_j, ns, name): the stashing partition, namespace and name
        """
        for prev_j, ns, name in self.by_partition[next_j]:
            if prev_j != next_j:
                yield prev_j, ns, name

    def requires_copy(self, ns: Namespace, name: str) -> bool:
        """Whether the skip is popped in another partition than it is stashed in."""
        prev_j, next_j = self.by_ns_name.get((ns, name), (-1, -1))
        return prev_j != next_j


def inspect_skip_layout(partitions: Sequence[nn.Sequential]) -> SkipLayout:
    """Finds, for each skip, the partitions that stash and pop it.

    Skippable layers nested in plain modules or sequentials are found too.
    The partitions must hold a model that passed
    :func:`~torchgpipe.skip.verify_skippables`.

    Args:
        partitions: the partitions, in order

    Returns:
        SkipLayout: the layout
    """
    # Imported here: skippable imports this module's users.
    from torchgpipe.skip.skippable import Skippable

    stashed_at: Dict[Tuple[Namespace, str], int] = {}
    popped_at: Dict[Tuple[Namespace, str], int] = {}

    for j, partition in enumerate(partitions):
        for layer in partition.modules():
            if isinstance(layer, Skippable):
                stashed_at.update((key, j) for key in layer.stashable())
                popped_at.update((key, j) for key in layer.poppable())

    # Matched only once every layer is seen: a nested pop may be registered
    # before its stash in the module that calls both.
    skip_routes = {key: (stashed_at[key], j) for key, j in popped_at.items()}
    return SkipLayout(len(partitions), skip_routes)

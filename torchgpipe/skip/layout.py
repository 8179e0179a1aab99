"""The skip layout: for every skip, the partition that stashes it and the one that pops it."""
from typing import Dict, Iterable, List, Sequence, Tuple

from torch import nn

from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.skippable import Skippable

__all__: List[str] = []


class SkipLayout:
    """The routes of a model's skips between its partitions, fixed when GPipe wraps it.

    The pipeline asks it which skips to copy into each partition's input,
    and the trackers ask it which skips need a portal at all: a skip popped
    in the partition that stashed it stays on its device.

    Args:
        num_partitions (int): the number of partitions
        skip_routes: ``(stashing partition, popping partition)`` for each
            ``(namespace, name)``
    """

    def __init__(self, num_partitions: int,
                 skip_routes: Dict[Tuple[Namespace, str], Tuple[int, int]]) -> None:
        self.by_ns_name = skip_routes
        # Indexed by the popping partition, which is where the pipeline needs
        # them: each partition's copies are issued before it runs.
        self.by_partition: List[List[Tuple[int, Namespace, str]]] = \
            [[] for _ in range(num_partitions)]
        for (ns, name), (prev_j, next_j) in skip_routes.items():
            self.by_partition[next_j].append((prev_j, ns, name))
        # One canonical order (by stashing partition, then key), whatever
        # order the layers were found in.
        for routes in self.by_partition:
            routes.sort()

    def copy_policy(self, next_j: int) -> Iterable[Tuple[int, Namespace, str]]:
        """Yields the skips that partition ``next_j`` pops from an earlier partition.

        Yields:
            ``(prev_j, ns, name)``: the partition that stashes the skip, and
            its namespace and name
        """
        for prev_j, ns, name in self.by_partition[next_j]:
            if prev_j != next_j:
                yield prev_j, ns, name

    def requires_copy(self, ns: Namespace, name: str) -> bool:
        """Tells whether a skip crosses partitions, and so needs a portal.

        A skip the layout does not know needs none either: the tracker keeps
        it in its dictionary, like a skip that stays in its partition.
        """
        prev_j, next_j = self.by_ns_name.get((ns, name), (-1, -1))
        return prev_j != next_j


def inspect_skip_layout(partitions: Sequence[nn.Sequential]) -> SkipLayout:
    """Finds the route of every skip through the partitions.

    Skippable layers nested inside the partitions' layers count too. The
    partitions must hold a model that :func:`~torchgpipe.skip.verify_skippables`
    accepts.

    Args:
        partitions (sequence of nn.Sequential): the partitions, in order

    Returns:
        SkipLayout: the routes
    """
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

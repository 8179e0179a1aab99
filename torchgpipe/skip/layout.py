"""The skip layout: for every skip, the partition that stashes it and the one that pops it."""
from typing import Dict, Iterable, List, Sequence, Tuple

from torch import nn

from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.verify import Declares

__all__: List[str] = []


class SkipLayout:
    """The routes of a model's skips between its partitions, fixed when GPipe wraps it: which
    skips to copy into each partition's input, and which need a portal at all.

    Args:
        num_partitions (int): the number of partitions
        skip_routes: ``(stashing partition, popping partition)`` for each
            ``(namespace, name)``
    """

    def __init__(self, num_partitions: int,
                 skip_routes: Dict[Tuple[Namespace, str], Tuple[int, int]]) -> None:
        self.by_ns_name = skip_routes
        # By popping partition: its copies are issued before it runs.
        self.by_partition: List[List[Tuple[int, Namespace, str]]] = \
            [[] for _ in range(num_partitions)]
        for (ns, name), (prev_j, next_j) in skip_routes.items():
            self.by_partition[next_j].append((prev_j, ns, name))
        # One order, by stashing partition then key.
        for routes in self.by_partition:
            routes.sort()

    def copy_policy(self, next_j: int) -> Iterable[Tuple[int, Namespace, str]]:
        """Yields ``(prev_j, ns, name)`` for each skip partition ``next_j`` pops from an earlier
        partition ``prev_j``."""
        for prev_j, ns, name in self.by_partition[next_j]:
            if prev_j != next_j:
                yield prev_j, ns, name

    def requires_copy(self, ns: Namespace, name: str) -> bool:
        """Whether a skip crosses partitions, and so needs a portal (an unknown one does not)."""
        prev_j, next_j = self.by_ns_name.get((ns, name), (-1, -1))
        return prev_j != next_j


def inspect_skip_layout(partitions: Sequence[nn.Sequential]) -> SkipLayout:
    """The route of every skip through ``partitions``, nested skippable layers included (the
    model must pass :func:`~torchgpipe.skip.verify_skippables`)."""
    stashed_at: Dict[Tuple[Namespace, str], int] = {}
    popped_at: Dict[Tuple[Namespace, str], int] = {}

    for j, partition in enumerate(partitions):
        for layer in partition.modules():
            if isinstance(layer, Declares):
                stashed_at.update((key, j) for key in layer.stashable())
                popped_at.update((key, j) for key in layer.poppable())

    # Matched only once every layer is seen: a nested pop may be registered
    # before its stash in the module that calls both.
    skip_routes = {key: (stashed_at[key], j) for key, j in popped_at.items()}
    return SkipLayout(len(partitions), skip_routes)

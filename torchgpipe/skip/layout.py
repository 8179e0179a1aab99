"""The skips of a sequential model: each stash popped once, later, in its namespace
(:func:`~torchgpipe.skip.verify_skippables`), and the partitions that stash and pop each
(:class:`SkipLayout`).

Both read what layers declare (:class:`Declares`) without importing the skippable module.
"""
from typing import (Dict, FrozenSet, Iterable, List, Protocol, Sequence, Set, Tuple,
                    runtime_checkable)

from torch import nn

from torchgpipe.skip.namespace import Namespace

__all__: List[str] = []


@runtime_checkable
class Declares(Protocol):
    """What a skippable layer declares: the names it stashes and pops, with their namespaces."""

    stashable_names: FrozenSet[str]
    poppable_names: FrozenSet[str]

    def stashable(self) -> Iterable[Tuple[Namespace, str]]:
        """The names it stashes, each with its namespace."""

    def poppable(self) -> Iterable[Tuple[Namespace, str]]:
        """The names it pops, each with its namespace."""


def verify_skippables(module: nn.Sequential) -> None:
    """Checks that every skip name in a sequential model has one stash and one later pop.

    Names are matched within their namespace. Skippable layers nested in the
    children count, in the order of their children; within one child a pop may
    precede its stash. :class:`~torchgpipe.GPipe` calls it on the module it wraps.

    Args:
        module (torch.nn.Sequential): the model to check

    Raises:
        TypeError: a name is stashed or popped twice in one namespace,
            stashed and never popped, popped before (or without) its stash,
            or both stashed and popped by one layer; every problem is listed,
            one per line, naming the layer by its path

    Example::

        >>> from torchgpipe.skip import pop, skippable
        >>> @skippable(pop=['gate'])
        ... class Gated(nn.Module):
        ...     def forward(self, input):
        ...         return input * (yield pop('gate'))
        >>> verify_skippables(nn.Sequential(Gated(), nn.ReLU()))
        Traceback (most recent call last):
          ...
        TypeError: one or more pairs of stash and pop do not match:
        <BLANKLINE>
        * '0' declared 'gate' as poppable but it was not stashed
    """
    stashed: Set[Tuple[Namespace, str]] = set()
    popped: Set[Tuple[Namespace, str]] = set()
    msgs: List[str] = []

    def declare(declared: Set[Tuple[Namespace, str]], key: Tuple[Namespace, str],
                layer_name: str, kind: str) -> None:
        # The first declaration of a key wins; each later one is a problem.
        if key in declared:
            msg = f"'{layer_name}' redeclared '{key[1]}' as {kind} but not isolated by namespace"
            msgs.append(msg)
        else:
            declared.add(key)

    for child_name, child in module.named_children():
        layers = [(layer_name, layer) for layer_name, layer
                  in child.named_modules(prefix=child_name) if isinstance(layer, Declares)]

        # The child's stashes, then its pops: its forward may call them in any order.
        for layer_name, layer in layers:
            for name in sorted(layer.stashable_names & layer.poppable_names):
                msg = f"'{layer_name}' declared '{name}' both as stashable and as poppable"
                msgs.append(msg)
            for key in layer.stashable():
                if key[1] not in layer.poppable_names:
                    declare(stashed, key, layer_name, 'stashable')

        for layer_name, layer in layers:
            for key in layer.poppable():
                if key[1] in layer.stashable_names:
                    continue
                if key not in stashed:
                    msg = f"'{layer_name}' declared '{key[1]}' as poppable but it was not stashed"
                    msgs.append(msg)
                    continue
                declare(popped, key, layer_name, 'poppable')

    for _, name in sorted(stashed - popped):
        msg = f"no module declared '{name}' as poppable but stashed"
        msgs.append(msg)

    if msgs:
        raise TypeError('one or more pairs of stash and pop do not match:\n\n'
                        + '\n'.join(f'* {msg}' for msg in msgs))


class SkipLayout:
    """The routes of a model's skips between its partitions, fixed when GPipe wraps it
    (``skip_routes``: the stashing and popping partition of each ``(namespace, name)``):
    which skips to copy into each partition's input, and which need a portal at all."""

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
        """The ``(prev_j, ns, name)`` of each skip partition ``next_j`` pops from an earlier one."""
        return [route for route in self.by_partition[next_j] if route[0] != next_j]

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

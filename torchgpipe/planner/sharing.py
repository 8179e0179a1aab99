"""The bytes partitions of one process share, as a worker's actions run
(:func:`~torchgpipe.planner.predict.peak_memory`).

Between ranks a message is a copy, but a partition receives from another of
its own rank (ZBV's turn, a skip between the arms of its V) the very tensor
that one made, alive until both let go of it::

    partition j (earlier)                      partition k (later, same worker)
    F   makes its output, a skip  ──── lent ──►  F  takes them as its input, a pop
    I   lets go of them           ·········      W  lets go of them (what it saved)
    I   needs their gradients  ◄── handed ────── I  makes them, as they are

(:meth:`~torchgpipe.planner.partitions.Partitions.lent`, and
:meth:`~torchgpipe.planner.partitions.Partitions.returned`.)
"""
from typing import Dict, List, Sequence, Set, Tuple

from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.planner.partitions import Partitions

__all__: List[str] = []


class SharedBytes:
    """The bytes partitions of one worker share (``parts``' ``lent`` and ``returned``),
    alive as its actions run one by one, for micro-batches of ``sizes``, each
    ``checkpointed`` or not."""

    def __init__(self, parts: Partitions, sizes: Sequence[int],
                 checkpointed: Sequence[bool]) -> None:
        self.parts = parts
        self.sizes = sizes
        self.checkpointed = checkpointed
        #: Lent bytes alive, by micro-batch, borrower, and the borrower's action
        #: that lets go of them (F for what a checkpointed F made, else W or B).
        self.lent: Dict[Tuple[int, int, Kind], float] = {}
        #: The micro-batches and partitions whose W (or B) has run.
        self.released: Set[Tuple[int, int]] = set()
        #: Gradients handed back, by micro-batch, receiver, maker and whether the
        #: maker's leaf keeps them: their bytes, and how many actions still hold them.
        self.handed: Dict[Tuple[int, int, int, bool], List[float]] = {}

    def counted(self, action: Action) -> float:
        """The bytes of gradients handed back to ``action`` (a ``B`` or ``I``) already
        alive, which its working memory counts too."""
        if action.kind not in (Kind.B, Kind.I):
            return 0.0
        return sum(nbytes for (i, j, _, _), (nbytes, _) in self.handed.items()
                   if (i, j) == (action.i, action.j))

    def taken(self, action: Action) -> float:
        """The bytes an ``F`` takes over that a checkpointed ``F`` before made for it."""
        if action.kind is not Kind.F:
            return 0.0
        return self.lent.pop((action.i, action.j, Kind.F), 0.0)

    def after(self, action: Action) -> float:
        """The change in the bytes alive as ``action`` ends."""
        i, j, kind = action.i, action.j, action.kind
        change = -self._let_go(action)
        lends, makes = self.parts.lent(j, self.sizes[i])
        if kind is Kind.F and self.checkpointed[i] or kind is Kind.I and not self.checkpointed[i]:
            # (A checkpointed I lets go of what it recomputed: the borrower's own
            # tensors are those F made.)
            for borrower, nbytes in (makes if kind is Kind.F else lends).items():
                if (i, borrower) in self.released:
                    continue  # (it let go first)
                key = (i, borrower, Kind.F if kind is Kind.F else Kind.W)
                change += nbytes
                self.lent[key] = self.lent.get(key, 0.0) + nbytes
        elif kind in (Kind.B, Kind.W):
            change -= self.lent.pop((i, j, Kind.W), 0.0)
            self.released.add((i, j))
        if kind in (Kind.B, Kind.I):
            for to, nbytes, leaf in self.parts.returned(j, self.sizes[i]):
                change += nbytes
                # (Two skips from one partition share a key, and their bytes.)
                entry = self.handed.setdefault((i, to, j, leaf), [0.0, 0.0])
                entry[:] = [entry[0] + nbytes, 2 if leaf and kind is Kind.I else 1]
        return change

    def _let_go(self, action: Action) -> float:
        """The bytes of handed-back gradients freed as ``action`` ends."""
        freed = 0.0
        for key in list(self.handed):
            i, to, made, leaf = key
            if i == action.i and (action.kind in (Kind.B, Kind.I) and to == action.j
                                  or action.kind is Kind.W and made == action.j and leaf):
                self.handed[key][1] -= 1
                if self.handed[key][1] == 0:
                    freed += self.handed.pop(key)[0]
        return freed

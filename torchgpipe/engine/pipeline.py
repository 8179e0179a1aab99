"""The pipeline: every micro-batch through every partition, by clock cycles.

At clock ``k`` the tasks ``F(i, j)`` with ``i + j == k`` run at once::

    clock    0       1       2       3       4          m = 3 micro-batches
    dev 0  F(0,0)  F(1,0)  F(2,0)                       n = 3 partitions
    dev 1          F(0,1)  F(1,1)  F(2,1)
    dev 2                  F(0,2)  F(1,2)  F(2,2)
"""
from typing import Iterable, List, Tuple


from torchgpipe.engine.linked import Linked
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.step import execute

__all__: List[str] = []


def clock_cycles(m: int, n: int) -> Iterable[List[Tuple[int, int]]]:
    """For each clock ``k``, the ``(i, j)`` (micro-batch, partition) with ``i + j == k``.

    Example::

        >>> list(clock_cycles(2, 2))
        [[(0, 0)], [(1, 0), (0, 1)], [(1, 1)]]
    """
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


class Pipeline(Linked):
    """Runs micro-batches through linked partitions, in place of the input batches."""

    def run(self) -> None:
        """Runs the pipeline, raising a task's failure as itself."""
        m, n = len(self.batches), len(self.devices)
        if self.recorder is not None:
            self.recorder.begin_step(m, self.devices)
        # clock_order's layout (tests/test_order.py), at a third of its cost.
        order = [Action(Kind.F, i, j) for cycle in clock_cycles(m, n) for i, j in cycle]
        execute(order, dict(enumerate(self.stages)), self.mailbox)

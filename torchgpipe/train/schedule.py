"""Schedules as data: what each partition does, in which order, for one training step.

A schedule is a list of actions per partition: ``F(i,j)``, the forward pass of
micro-batch ``i`` on partition ``j``, and ``B(i,j)``, its backward pass (with
the recomputation first, if the micro-batch is checkpointed). Short pure
functions generate the lists; :mod:`torchgpipe.train.step` runs any of them; the
timeline records the actions under the same names. A new schedule is a new
generator, not a new engine.

Fill-drain (GPipe) and 1F1B, for ``m = 4`` micro-batches on ``n = 3``
partitions, as :func:`clock_order` lays them out (one column per clock)::

    fill_drain   0: F0 F1 F2 F3             B3 B2 B1 B0
                 1:    F0 F1 F2 F3       B3 B2 B1 B0
                 2:       F0 F1 F2 F3 B3 B2 B1 B0

    one_f_one_b  0: F0 F1 F2       B0 F3 B1    B2    B3
                 1:    F0 F1    B0 F2 B1 F3 B2    B3
                 2:       F0 B0 F1 B1 F2 B2 F3 B3

Fill-drain keeps every micro-batch's activations until the backward passes
start; 1F1B starts backward passes as soon as it can, so partition ``j``
never holds more than ``n - j`` micro-batches' activations, whatever ``m``.
"""
import enum
from dataclasses import dataclass
from typing import Callable, Dict, List, Sequence

__all__: List[str] = []


class Kind(enum.Enum):
    """What an action does to one micro-batch on one partition."""

    #: The forward pass (without keeping activations, if checkpointed).
    F = 'F'
    #: The backward pass, after the recomputation if checkpointed.
    B = 'B'


@dataclass(frozen=True)
class Action:
    """One action of a schedule: ``kind`` of micro-batch ``i`` on partition ``j``."""

    kind: Kind
    i: int
    j: int

    def __str__(self) -> str:
        return f'{self.kind.value}({self.i},{self.j})'


Schedule = List[List[Action]]


def fill_drain(m: int, n: int) -> Schedule:
    """GPipe's schedule: every forward pass, then every backward pass in reverse order.

    Example::

        >>> [' '.join(map(str, actions)) for actions in fill_drain(2, 2)]
        ['F(0,0) F(1,0) B(1,0) B(0,0)', 'F(0,1) F(1,1) B(1,1) B(0,1)']
    """
    return [[Action(Kind.F, i, j) for i in range(m)]
            + [Action(Kind.B, i, j) for i in reversed(range(m))] for j in range(n)]


def one_f_one_b(m: int, n: int) -> Schedule:
    """1F1B: ``n - j`` forward passes to warm up, then one backward and one forward, then drain.

    Example::

        >>> [' '.join(map(str, actions)) for actions in one_f_one_b(3, 2)]
        ['F(0,0) F(1,0) B(0,0) F(2,0) B(1,0) B(2,0)', 'F(0,1) B(0,1) F(1,1) B(1,1) F(2,1) B(2,1)']
    """
    schedule = []
    for j in range(n):
        warmup = min(n - j, m)
        actions = [Action(Kind.F, i, j) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action(Kind.B, i, j), Action(Kind.F, warmup + i, j)]
        actions += [Action(Kind.B, i, j) for i in range(m - warmup, m)]
        schedule.append(actions)
    return schedule


#: The schedules :meth:`torchgpipe.GPipe.train_step` knows, by name.
SCHEDULES: Dict[str, Callable[[int, int], Schedule]] = {
    '1f1b': one_f_one_b,
    'fill_drain': fill_drain,
}


def depends_on(action: Action, n: int) -> List[Action]:
    """The actions of other partitions that ``action`` waits for.

    ``F(i,j)`` needs the output of ``F(i,j-1)``; ``B(i,j)`` needs the
    gradient ``B(i,j+1)`` sends back. (Skip connections add nothing: a skip
    from partition ``a`` to ``b`` travels with these, since ``a < b``.)
    """
    if action.kind is Kind.F:
        return [Action(Kind.F, action.i, action.j - 1)] if action.j > 0 else []
    return [Action(Kind.B, action.i, action.j + 1)] if action.j < n - 1 else []


def clock_order(schedule: Sequence[Sequence[Action]]) -> List[List[Action]]:
    """Lays a schedule out in clock cycles, every action taking one cycle.

    At each cycle every partition runs its next action if what it waits for
    ran in an earlier cycle. Running the actions cycle by cycle (or each
    partition's in order, on threads of their own) therefore never waits
    for an action that waits in turn.

    Returns:
        the actions of each cycle, in partition order

    Raises:
        ValueError: the schedule can never finish (an action waits for one
            that comes after it)
    """
    n = len(schedule)
    done = set()
    position = [0] * n
    cycles: List[List[Action]] = []
    while any(position[j] < len(schedule[j]) for j in range(n)):
        cycle = [schedule[j][position[j]] for j in range(n) if position[j] < len(schedule[j])]
        cycle = [a for a in cycle if all(d in done for d in depends_on(a, n))]
        if not cycle:
            stuck = [str(schedule[j][position[j]]) for j in range(n)
                     if position[j] < len(schedule[j])]
            raise ValueError(f'the schedule cannot go on: {", ".join(stuck)} wait for actions '
                             'that come after them')
        for action in cycle:
            position[action.j] += 1
        done.update(cycle)
        cycles.append(cycle)
    return cycles


def in_flight(actions: Sequence[Action]) -> int:
    """How many micro-batches a partition holds at most: forward done, backward not."""
    alive = peak = 0
    for action in actions:
        alive += 1 if action.kind is Kind.F else -1
        peak = max(peak, alive)
    return peak

"""The simulator: when each action of a schedule starts and ends, given what each costs.

Each worker runs its actions in order, each once the worker is free and what it waits
for has ended; messages take no time. A checkpointed backward pass recomputes before it
waits for the gradient: that part, ``ahead``, needs the worker only::

    worker j    ... jFi | recompute i | (waits for (j+1)Bi or Ii) | rest of jBi ...
"""
from fractions import Fraction
from typing import Callable, Dict, Optional, Sequence, Tuple

from torchgpipe.engine.schedule import Action, Kind, clock_order, dependencies

__all__ = ['Cost', 'unit_cost', 'simulate', 'idle', 'simulate_sharing']

#: The time an action takes, in any unit.
Cost = Callable[[Action], Fraction]


def unit_cost(action: Action) -> Fraction:
    """The costs of the zero-bubble paper's analysis: F = I = W = 1, B = 2."""
    return Fraction(2 if action.kind is Kind.B else 1)


def _lead(action: Action, cost: Cost, ahead: Optional[Cost]) -> Fraction:
    """``ahead(action)``, within 0 and the action's cost."""
    if ahead is None:
        return Fraction(0)
    return max(Fraction(0), min(Fraction(ahead(action)), Fraction(cost(action))))


def simulate(workers: Sequence[Sequence[Action]], n: int, cost: Cost,
             ahead: Optional[Cost] = None) -> Dict[Action, Tuple[Fraction, Fraction]]:
    """The start and end of each action if each worker has a core; ``ahead(action)`` is
    the part of its cost that needs the worker only (the wait after it is left out).

    Example::

        >>> from torchgpipe.engine.generators import fill_drain
        >>> plan = fill_drain(1, 2).workers  # 0F0 0B0 / 1F0 1B0
        >>> recompute = lambda a: Fraction(1 if a.kind is Kind.B else 0)
        >>> max(end for _, end in simulate(plan, 2, unit_cost).values())
        Fraction(6, 1)
        >>> max(end for _, end in simulate(plan, 2, unit_cost, recompute).values())
        Fraction(5, 1)
    """
    times: Dict[Action, Tuple[Fraction, Fraction]] = {}
    needs = dependencies(workers, n)
    before = {a: actions[k - 1] if k else None
              for actions in workers for k, a in enumerate(actions)}
    for cycle in clock_order(workers, n):
        for action in cycle:
            previous = before[action]
            early = _lead(action, cost, ahead)
            start = max([times[previous][1] if previous is not None else Fraction(0)]
                        + [times[need][1] - early for need in needs[action]])
            times[action] = (start, start + cost(action))
    return times


def idle(workers: Sequence[Sequence[Action]], n: int, cost: Cost) -> Fraction:
    """The idle time per worker of a step: its span less the average work; with
    :func:`unit_cost`, the schedule's bubble.

    Example::

        >>> from torchgpipe.engine.generators import one_f_one_b
        >>> idle(one_f_one_b(8, 4).workers, 4, unit_cost)  # (p - 1)(F + B)
        Fraction(9, 1)
    """
    times = simulate(workers, n, cost)
    span = max((end for _, end in times.values()), default=Fraction(0))
    work = sum((cost(a) for actions in workers for a in actions), Fraction(0))
    return span - work / len(workers) if workers else Fraction(0)


def simulate_sharing(workers: Sequence[Sequence[Action]], n: int, cost: Cost,
                     cores: Optional[float] = None, ahead: Optional[Cost] = None
                     ) -> Dict[Action, Tuple[Fraction, Fraction]]:
    """As :func:`simulate`, the workers sharing ``cores`` (not necessarily whole; ``None``:
    a core each): between two events, each action at work advances by the time passed
    times ``min(1, cores / at work)``."""
    if cores is None or cores >= len(workers):
        return simulate(workers, n, cost, ahead)
    # Exact arithmetic: a share of the cores is a fraction with a small denominator.
    capacity = Fraction(cores).limit_denominator(1000)
    if capacity <= 0:
        raise ValueError(f'cores must be positive (got {cores}): give None for a core '
                         'per worker')
    return _shared(workers, n, cost, capacity, ahead)


def _shared(workers: Sequence[Sequence[Action]], n: int, cost: Cost, capacity: Fraction,
            ahead: Optional[Cost] = None) -> Dict[Action, Tuple[Fraction, Fraction]]:
    """:func:`simulate_sharing` with ``capacity`` cores."""
    needs = dependencies(workers, n)
    times: Dict[Action, Tuple[Fraction, Fraction]] = {}
    position = [0] * len(workers)
    # Each busy worker's action: time at work, work left (alone on a core), and for a
    # part ahead the work after it (else None).
    working: Dict[int, Tuple[Action, Fraction, Fraction, Optional[Fraction]]] = {}
    # Workers whose next action waits: its time at work so far, and its work left.
    waiting: Dict[int, Tuple[Fraction, Fraction]] = {}
    now = Fraction(0)
    total = sum(len(actions) for actions in workers)
    while len(times) < total:
        # An idle worker starts a part ahead at once, the rest once what it waits for ended.
        for w, actions in enumerate(workers):
            if w in working or position[w] == len(actions):
                continue
            action = actions[position[w]]
            if w not in waiting:
                early = _lead(action, cost, ahead)
                if early > 0:
                    working[w] = (action, Fraction(0), early, cost(action) - early)
                    continue
                waiting[w] = (Fraction(0), Fraction(cost(action)))
            if all(need in times for need in needs[action]):
                spent, left = waiting.pop(w)
                working[w] = (action, spent, left, None)
        if not working:
            clock_order(workers, n)  # raises, naming the circle of actions
        share = min(Fraction(1), capacity / len(working))
        later = min(now + left / share for _, _, left, _ in working.values())
        for w, (action, spent, left, rest) in list(working.items()):
            spent, left = spent + later - now, left - (later - now) * share
            if left > 0:
                working[w] = (action, spent, left, rest)
                continue
            del working[w]
            if rest is not None:
                waiting[w] = (spent, rest)
            else:
                times[action] = (later - spent, later)
                position[w] += 1
        now = later
    return times

"""The simulator when the workers outnumber the cores they run on.

:func:`~torchgpipe.engine.schedule.simulate` gives every worker a core of
its own. Processes of one machine, more of them than its cores, are not so:
while more workers are at work than there are cores, the operating system
shares the cores among them, and each goes as fast as its share. A step of
four ranks on two cores, where all four work at once, takes about as long
as half of all their work; one where they take turns (a single
micro-batch) as long as each alone::

    cores 2, workers at work 4:  each runs at 2/4 of its speed
    cores 2, workers at work 1:  it runs at full speed

So the simulation here goes from one action's end to the next: at each,
every idle worker whose next action has what it waits for starts it (and
any idle worker starts the part of its next action that needs nothing but
the worker: ``ahead``), and until the next end every action at work
advances by the time passed times ``min(1, cores / at work)``.
"""
from fractions import Fraction
from typing import Dict, Optional, Sequence, Tuple

from torchgpipe.engine.schedule import Action, Cost, clock_order, dependencies, simulate

__all__ = ['simulate_sharing']


def simulate_sharing(workers: Sequence[Sequence[Action]], n: int, cost: Cost,
                     cores: Optional[float] = None, ahead: Optional[Cost] = None
                     ) -> Dict[Action, Tuple[Fraction, Fraction]]:
    """When each action starts and ends if the workers share ``cores`` cores.

    Each worker runs its actions in order, each as soon as the worker is
    free and what it waits for has ended; an action alone on a core takes
    ``cost(action)``.

    Args:
        workers: each worker's actions, in order
        n: the partitions
        cost: an action's time with a core of its own
        cores: how many actions can be at work at full speed at once, not
            necessarily whole (``None``, or at least the workers: every worker
            has a core, as :func:`~torchgpipe.engine.schedule.simulate` takes it)
        ahead: how much of an action's cost needs the worker only, and so runs
            before what the action waits for has ended (a checkpointed
            backward pass's recomputation); none if ``None``

    Returns:
        the start and the end of each action; one that waited after its part
        ahead starts at its end less the time it was at work

    Raises:
        ValueError: ``cores`` is not positive, or the schedule can never
            finish (as :func:`~torchgpipe.engine.schedule.clock_order` says)

    Example::

        >>> from torchgpipe.engine.generators import fill_drain
        >>> unit = lambda action: Fraction(1)
        >>> plan = fill_drain(4, 2).workers
        >>> max(end for _, end in simulate_sharing(plan, 2, unit, cores=1).values())
        Fraction(16, 1)
    """
    if cores is None or cores >= len(workers):
        return simulate(workers, n, cost, ahead)
    # Exact arithmetic, as the plain simulator's: a share of the cores is a
    # fraction with a small denominator.
    capacity = Fraction(cores).limit_denominator(1000)
    if capacity <= 0:
        raise ValueError(f'cores must be positive (got {cores}): give None for a core '
                         'per worker')
    return _shared(workers, n, cost, capacity, ahead)


def _shared(workers: Sequence[Sequence[Action]], n: int, cost: Cost, capacity: Fraction,
            ahead: Optional[Cost] = None) -> Dict[Action, Tuple[Fraction, Fraction]]:
    """:func:`simulate_sharing`'s events, with ``capacity`` cores (any positive number:
    at least the workers, it is the plain simulation)."""
    def lead(action: Action) -> Fraction:
        return min(ahead(action), cost(action)) if ahead is not None else Fraction(0)

    needs = dependencies(workers, n)
    times: Dict[Action, Tuple[Fraction, Fraction]] = {}
    position = [0] * len(workers)
    # The action each busy worker is at: the time it has been at work, its
    # work left (in time alone on a core), and whether that is its part ahead.
    working: Dict[int, Tuple[Action, Fraction, Fraction, bool]] = {}
    # Workers whose next action ran its part ahead: the time that was at
    # work, and the work left.
    waiting: Dict[int, Tuple[Fraction, Fraction]] = {}
    now = Fraction(0)
    total = sum(len(actions) for actions in workers)
    while len(times) < total:
        # An idle worker starts its next action's part ahead at once, and the
        # rest once what it waits for ended (at an event already past).
        for w, actions in enumerate(workers):
            if w in working or position[w] == len(actions):
                continue
            action = actions[position[w]]
            if w not in waiting and lead(action) > 0:
                working[w] = (action, Fraction(0), lead(action), True)
            elif all(need in times for need in needs[action]):
                spent, left = waiting.pop(w, (Fraction(0), Fraction(cost(action))))
                working[w] = (action, spent, left, False)
        if not working:
            clock_order(workers, n)  # raises, naming the circle of actions
        share = min(Fraction(1), capacity / len(working))
        later = min(now + left / share for _, _, left, _ in working.values())
        for w, (action, spent, left, first) in list(working.items()):
            spent, left = spent + later - now, left - (later - now) * share
            if left > 0:
                working[w] = (action, spent, left, first)
                continue
            del working[w]
            if first:
                waiting[w] = (spent, cost(action) - lead(action))
            else:
                times[action] = (later - spent, later)
                position[w] += 1
        now = later
    return times

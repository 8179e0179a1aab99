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

So the simulation here goes from event to event (an action ends, or a
worker's next action may start), and between two events every action at
work advances by the time passed times ``min(1, cores / at work)``.
"""
from fractions import Fraction
from typing import Dict, Optional, Sequence, Tuple

from torchgpipe.engine.schedule import Action, Cost, clock_order, dependencies, simulate

__all__ = ['simulate_sharing']


def simulate_sharing(workers: Sequence[Sequence[Action]], n: int, cost: Cost,
                     cores: Optional[float] = None) -> Dict[Action, Tuple[Fraction, Fraction]]:
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

    Returns:
        the start and the end of each action

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
        return simulate(workers, n, cost)
    if cores <= 0:
        raise ValueError(f'cores must be positive (got {cores}): give None for a core '
                         'per worker')
    # Exact arithmetic, as the plain simulator's: a share of the cores is a
    # fraction with a small denominator.
    capacity = Fraction(cores).limit_denominator(1000)
    needs = dependencies(workers, n)
    times: Dict[Action, Tuple[Fraction, Fraction]] = {}
    position = [0] * len(workers)
    free = [Fraction(0)] * len(workers)
    # The action each busy worker is at: when it started, and its work left
    # (in time alone on a core).
    working: Dict[int, Tuple[Action, Fraction, Fraction]] = {}
    now = Fraction(0)

    def ready(w: int) -> Optional[Fraction]:
        """When worker ``w``'s next action may start; ``None``: not known yet."""
        if position[w] == len(workers[w]):
            return None
        start = free[w]
        for need in needs[workers[w][position[w]]]:
            if need not in times:
                return None
            start = max(start, times[need][1])
        return start

    total = sum(len(actions) for actions in workers)
    while len(times) < total:
        for w in range(len(workers)):
            start = ready(w) if w not in working else None
            if start is not None and start <= now:
                action = workers[w][position[w]]
                working[w] = (action, now, cost(action))
        share = min(Fraction(1), capacity / len(working)) if working else Fraction(1)
        events = [now + left / share for _, _, left in working.values()]
        events += [t for t in (ready(w) for w in range(len(workers)) if w not in working)
                   if t is not None]
        if not events:
            clock_order(workers, n)  # raises, naming the circle of actions
        later = min(events)
        for w, (action, started, left) in list(working.items()):
            left -= (later - now) * share
            if left:
                working[w] = (action, started, left)
            else:  # exact: Fractions
                times[action] = (started, later)
                free[w] = later
                position[w] += 1
                del working[w]
        now = later
    return times

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
every idle worker whose next action has what it waits for starts it, and
until the next end every action at work advances by the time passed times
``min(1, cores / at work)``.
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
    # Exact arithmetic, as the plain simulator's: a share of the cores is a
    # fraction with a small denominator.
    capacity = Fraction(cores).limit_denominator(1000)
    if capacity <= 0:
        raise ValueError(f'cores must be positive (got {cores}): give None for a core '
                         'per worker')
    return _shared(workers, n, cost, capacity)


def _shared(workers: Sequence[Sequence[Action]], n: int, cost: Cost, capacity: Fraction
            ) -> Dict[Action, Tuple[Fraction, Fraction]]:
    """:func:`simulate_sharing`'s events, with ``capacity`` cores (any positive number:
    at least the workers, it is the plain simulation)."""
    needs = dependencies(workers, n)
    times: Dict[Action, Tuple[Fraction, Fraction]] = {}
    position = [0] * len(workers)
    # The action each busy worker is at: when it started, and its work left
    # (in time alone on a core).
    working: Dict[int, Tuple[Action, Fraction, Fraction]] = {}
    now = Fraction(0)
    total = sum(len(actions) for actions in workers)
    while len(times) < total:
        # Whatever an idle worker's next action waits for ended at an event
        # already past: it starts now.
        for w, actions in enumerate(workers):
            if w in working or position[w] == len(actions):
                continue
            action = actions[position[w]]
            if all(need in times for need in needs[action]):
                working[w] = (action, now, Fraction(cost(action)))
        if not working:
            clock_order(workers, n)  # raises, naming the circle of actions
        share = min(Fraction(1), capacity / len(working))
        later = min(now + left / share for _, _, left in working.values())
        for w, (action, started, left) in list(working.items()):
            left -= (later - now) * share
            if left > 0:
                working[w] = (action, started, left)
            else:
                times[action] = (started, later)
                position[w] += 1
                del working[w]
        now = later
    return times

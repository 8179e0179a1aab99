"""The built-in schedules: short pure functions of the micro-batches ``m`` and partitions ``n``.

Fill-drain (GPipe) and 1F1B have one partition per worker. Interleaved 1F1B
loops ``v`` partitions over ``p = n / v`` workers (partition ``j`` on worker
``j % p``), ZB-H1 splits 1F1B's backward passes into ``I`` and ``W``, and ZBV
gives each of ``p = n / 2`` workers two partitions in a V (``w`` and
``n - 1 - w``) and splits them too. For ``m = 4``, ``n = 3`` (``m = 4``,
``n = 4`` for ZBV), one column per clock of unit actions::

    fill_drain  0: F0 F1 F2 F3             B3 B2 B1 B0
                1:    F0 F1 F2 F3       B3 B2 B1 B0
                2:       F0 F1 F2 F3 B3 B2 B1 B0

    1f1b        0: F0 F1 F2       B0 F3 B1    B2    B3
                1:    F0 F1    B0 F2 B1 F3 B2    B3
                2:       F0 B0 F1 B1 F2 B2 F3 B3

The schedules whose order is not a fixed pattern are laid out by
:func:`greedy`, which simulates the step with the costs of the paper's
analysis (``F = I = W = 1``, ``B = 2``; halved for half-size partitions)
and lets each free worker pick its next action by the schedule's rule. What
they leave idle, per worker, is what :data:`BUILT_INS` says beside each.
"""
import difflib
import functools
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Dict, Hashable, List, NamedTuple, Optional, Sequence, Tuple

from torchgpipe.engine.schedule import (Action, Kind, Schedule, ScheduleLike, clock_order,
                                        depends_on)
from torchgpipe.engine.simulator import idle, simulate, unit_cost
from torchgpipe.foundation.validation import brief, describe

__all__: List[str] = []


def worker_of(j: int, n: int, workers: int, layout: str) -> int:
    """The worker of partition ``j`` of ``n``: in a loop (``j % workers``), or in a V
    (``layout='v'``: worker ``w`` keeps partitions ``w`` and ``n - 1 - w``)."""
    return min(j, n - 1 - j) if layout == 'v' else j % workers


def fill_drain(m: int, n: int) -> Schedule:
    """GPipe's schedule: every forward pass, then every backward pass in reverse order.

    Example::

        >>> print(fill_drain(2, 2))
        0F0 0F1 0B1 0B0
        1F0 1F1 1B1 1B0
    """
    return Schedule([Action(Kind.F, i, j) for i in range(m)]
                    + [Action(Kind.B, i, j) for i in reversed(range(m))] for j in range(n))


def one_f_one_b(m: int, n: int) -> Schedule:
    """1F1B: ``n - j`` forward passes to warm up, then one backward and one forward, then drain.

    Example::

        >>> print(one_f_one_b(3, 2))
        0F0 0F1 0B0 0F2 0B1 0B2
        1F0 1B0 1F1 1B1 1F2 1B2
    """
    workers = []
    for j in range(n):
        warmup = min(n - j, m)
        actions = [Action(Kind.F, i, j) for i in range(warmup)]
        for i in range(m - warmup):
            actions += [Action(Kind.B, i, j), Action(Kind.F, warmup + i, j)]
        actions += [Action(Kind.B, i, j) for i in range(m - warmup, m)]
        workers.append(actions)
    return Schedule(workers)


class Worker(NamedTuple):
    """What a schedule's rule sees of a worker when it picks the worker's next action."""

    #: The worker's index.
    w: int
    #: Micro-batches (of any of its partitions) whose forward pass ran and whose
    #: activations are still kept (no B or W yet).
    alive: int


#: A rule: the action a free worker runs next, among those it can run now (or None: wait).
Rule = Callable[[Worker, List[Action]], Optional[Action]]


def greedy(m: int, n: int, placement: Sequence[int], split: bool, rule: Rule) -> Schedule:
    """Lays out a schedule by simulating it: each worker, when free, runs what ``rule`` picks.

    Each partition runs its ``F``, its ``B`` (or ``I`` if ``split``) and its ``W``
    each in micro-batch order, once what they wait for
    (:func:`~torchgpipe.engine.schedule.depends_on`) has ended, with the paper's
    costs divided by the partitions per worker; the result can finish by construction.

    Args:
        m: micro-batches
        n: partitions
        placement: the worker of each partition
        split: whether backward passes are split into ``I`` and ``W``
        rule: picks a worker's next action
    """
    p = max(placement) + 1
    size = Fraction(p, n)
    kinds = (Kind.F, Kind.I, Kind.W) if split else (Kind.F, Kind.B)
    # The next micro-batch of each kind of action on each partition.
    next_i = {(kind, j): 0 for kind in kinds for j in range(n)}
    end: Dict[Action, Fraction] = {}
    free = [Fraction(0)] * p
    alive = [0] * p
    workers: List[List[Action]] = [[] for _ in range(p)]
    now = Fraction(0)
    left = m * n * len(kinds)
    while left:
        for w in range(p):
            if free[w] > now:
                continue
            heads = [Action(kind, next_i[kind, j], j) for j in range(n) if placement[j] == w
                     for kind in kinds if next_i[kind, j] < m]
            ready = [a for a in heads if all(end.get(d, now + 1) <= now
                                             for d in depends_on(a, n, lambda i, j: split))]
            action = rule(Worker(w, alive[w]), ready) if ready else None
            if action is None:
                continue
            next_i[action.kind, action.j] += 1
            alive[w] += {Kind.F: 1, Kind.B: -1, Kind.I: 0, Kind.W: -1}[action.kind]
            free[w] = end[action] = now + size * unit_cost(action)
            workers[w].append(action)
            left -= 1
        later = [t for t in free if t > now]
        assert later or not left, 'a greedy schedule never waits for nothing'
        now = min(later, default=now)
    return Schedule(workers)


def zb_h1(m: int, n: int) -> Schedule:
    """ZB-H1 (zero bubble at 1F1B's memory): 1F1B with the backward pass split, W put off.

    Partition ``j`` warms up with ``n - j`` forward passes, as in 1F1B, then
    runs ``I`` (which the partition before waits for), the ``W`` of ``j``
    micro-batches before, and the next forward pass; the ``W`` left run at
    the end, where 1F1B waits. Every partition keeps at most ``min(n, m)``
    micro-batches: 1F1B's first partition's peak.

    Example::

        >>> print(zb_h1(3, 2))
        0F0 0F1 0I0 0W0 0F2 0I1 0W1 0I2 0W2
        1F0 1I0 1F1 1I1 1W0 1F2 1I2 1W1 1W2
    """
    workers = []
    for j in range(n):
        warmup = min(n - j, m)
        actions = [Action(Kind.F, i, j) for i in range(warmup)]
        for i in range(m):
            actions.append(Action(Kind.I, i, j))
            if i >= j:
                actions.append(Action(Kind.W, i - j, j))
            if warmup + i < m:
                actions.append(Action(Kind.F, warmup + i, j))
        actions += [Action(Kind.W, i, j) for i in range(max(m - j, 0), m)]
        workers.append(actions)
    return Schedule(workers)


def interleaved_1f1b(m: int, n: int, p: int) -> Schedule:
    """Interleaved 1F1B: ``v = n / p`` partitions per worker, in a loop.

    Partition ``j`` runs on worker ``j % p``. A worker takes micro-batches in
    rounds of ``p``, forward through its partitions in order, backward in reverse.
    Worker ``w`` warms up with ``(v - 1) p + 2 (p - 1 - w)`` forward passes (as
    Megatron-LM and torch.distributed.pipelining do), then alternates one forward
    and one backward pass, keeping at most ``v p + p - 1 - 2 w`` partitions'
    activations. Twice ``p - 1 - w`` rather than once gives each message a forward
    pass of slack, so time on the wire does not add to the step. Where a short
    last round would leave the warm-up waiting in a circle, every worker warms
    up with as many more forward passes as it takes to finish.

    Raises:
        ValueError: ``n`` is not a multiple of ``p``
    """
    if n % p:
        raise ValueError(f"schedule 'interleaved_1f1b' needs the same number of partitions on "
                         f'each of its {p} devices, but there are {n} partitions; give a '
                         f'balance of a multiple of {p} entries')
    v = n // p
    rounds = [range(start, min(start + p, m)) for start in range(0, m, p)]

    def lay_out(more: int) -> Schedule:
        """Each worker warming up with ``more`` forward passes than the rule gives."""
        workers = []
        for w in range(p):
            mine = [j for j in range(n) if worker_of(j, n, p, 'loop') == w]
            forward = [Action(Kind.F, i, j) for r in rounds for j in mine for i in r]
            backward = [Action(Kind.B, i, j) for r in rounds for j in reversed(mine) for i in r]
            # One partition per worker (v = 1): 1F1B's warm-up, and 1F1B itself.
            warmup = min((v - 1) * p + (p - 1 - w) * (2 if v > 1 else 1) + more, len(forward))
            actions = forward[:warmup]
            for f, b in zip(forward[warmup:], backward):
                actions += [f, b]
            actions += backward[len(forward) - warmup:]
            workers.append(actions)
        return Schedule(workers)

    # A last round shorter than p can leave the rule's warm-up waiting in a
    # circle (4 workers with 3 or more partitions each, m = 5, 9, 13, ...):
    # one more forward pass at a time until it can finish. Every forward pass
    # first, the last layout tried, always can.
    for more in range(m * v):
        schedule = lay_out(more)
        try:
            clock_order(schedule.workers, n)
            return schedule
        except ValueError:
            continue
    return lay_out(m * v)


def zbv(m: int, n: int) -> Schedule:
    """ZBV: ``p = n / 2`` workers, each with partitions ``w`` and ``n - 1 - w`` (a V), split.

    Laid out by :func:`greedy`: a free worker runs an ``I`` if one can run,
    else a forward pass while it keeps fewer than ``2 p`` partitions'
    activations (each half of 1F1B's: 1F1B's first partition's peak), else
    a ``W``. Among one kind, the oldest micro-batch first, then the partition
    nearest the loss.

    Raises:
        ValueError: ``n`` is odd
    """
    if n % 2:
        raise ValueError(f"schedule 'zbv' runs two partitions per device in a V, but there "
                         f'are {n} partitions; give a balance of an even number of entries')

    def rule(worker: Worker, ready: List[Action]) -> Optional[Action]:
        for kind in (Kind.I, Kind.F, Kind.W):
            if kind is Kind.F and worker.alive >= n:
                continue
            actions = [a for a in ready if a.kind is kind]
            if actions:
                return min(actions, key=lambda a: (a.i, -a.j))
        return None

    return greedy(m, n, [worker_of(j, n, n // 2, 'v') for j in range(n)], True, rule)


@dataclass(frozen=True)
class BuiltIn:
    """A built-in schedule, as all its users read it: a new schedule is one entry."""

    #: Its action lists for ``m`` micro-batches, ``n`` partitions and ``p`` workers.
    lay_out: Callable[[int, int, int], Schedule]
    #: Its idle time per worker, as a formula of ``p``, ``v``, F, B and W (the costs of
    #: a worker's share of the model, ``B = I + W``), and the formula's value.
    formula: str
    bubble: Callable[[int, int, Fraction, Fraction, Fraction], Fraction]
    #: The partitions per worker the planner tries, and their layout (:func:`worker_of`).
    shapes: Tuple[Tuple[int, str], ...] = ((1, 'loop'),)


#: The built-in schedules, by name.
BUILT_INS: Dict[str, BuiltIn] = {
    'fill_drain': BuiltIn(lambda m, n, p: fill_drain(m, n), '(p-1)(F+B)',
                          lambda p, v, f, b, w: (p - 1) * (f + b)),
    '1f1b': BuiltIn(lambda m, n, p: one_f_one_b(m, n), '(p-1)(F+B)',
                    lambda p, v, f, b, w: (p - 1) * (f + b)),
    'interleaved_1f1b': BuiltIn(interleaved_1f1b, '(p-1)(F+B)/v',
                                lambda p, v, f, b, w: (p - 1) * (f + b) / v,
                                ((2, 'loop'), (4, 'loop'))),
    'zb_h1': BuiltIn(lambda m, n, p: zb_h1(m, n), '(p-1)(F+B-2W)',
                     lambda p, v, f, b, w: (p - 1) * (f + b - 2 * w)),
    'zbv': BuiltIn(lambda m, n, p: zbv(m, n), '~0', lambda p, v, f, b, w: Fraction(0), ((2, 'v'),)),
}


@functools.lru_cache(maxsize=64)
def named(name: str, m: int, n: int, p: int) -> Schedule:
    """The built-in schedule ``name`` for ``m`` micro-batches, ``n`` partitions and ``p`` workers.

    ``p`` counts only for interleaved 1F1B; the others know their workers.
    The result is checked, and shared by the calls with the same arguments.
    """
    schedule = BUILT_INS[name].lay_out(m, n, p)
    schedule.name = name
    schedule.check(micro_batches=m, partitions=n)
    return schedule


def resolve(schedule: ScheduleLike, m: int, n: int, workers: Sequence[Hashable],
            fix: Optional[str] = None) -> Schedule:
    """The schedule a step runs: a built-in one by name, or the user's; checked before any work.

    Args:
        schedule: a name of :data:`SCHEDULES` (as :func:`built_in` reads it), or
            a schedule (its text, or a list of action lists)
        m: micro-batches
        n: partitions
        workers: what runs each partition (a device's thread, a rank)
        fix: how to lay out the partitions otherwise (default: which
            ``devices`` to give)

    Raises:
        ValueError: the schedule does not fit the step, or cannot finish, or a
            worker of it has partitions on two devices
    """
    name = built_in(schedule)
    if name is not None:
        result = named(name, m, n, len(set(workers)))
        label = repr(name)
    else:
        result = Schedule.parse(schedule)
        result.check(micro_batches=m, partitions=n)
        label = 'given'
    placement = result.placement()
    for w in set(placement.values()):
        partitions = sorted(j for j, v in placement.items() if v == w)
        if len({workers[j] for j in partitions}) > 1:
            distinct = list(dict.fromkeys(workers))
            fit = [str(distinct[placement[j] % len(distinct)]) for j in range(n)]
            where = [str(workers[j]) for j in partitions]
            raise ValueError(f'schedule {label} runs partitions {partitions} on one worker, but '
                             f'they are on {where}; '
                             + (fix or f'give them one device, e.g. devices={fit}'))
    return result


def expected_bubble(schedule: Schedule, n: int) -> Tuple[str, float]:
    """The idle fraction of a step of ``schedule`` on ``n`` partitions, if F = I = W (B = 2).

    Returns:
        the formula it follows (a built-in schedule's), and its value,
        computed from the schedule itself
    """
    workers = [actions for actions in schedule.workers if actions]
    times = simulate(workers, n, unit_cost)
    span = max((end for _, end in times.values()), default=Fraction(0))
    waiting = idle(workers, n, unit_cost)
    facts = BUILT_INS.get(schedule.name)
    text = f'{facts.formula} ({schedule.name})' if facts is not None else 'its schedule'
    return text, float(waiting / span) if span else 0.0


#: The schedules :meth:`torchgpipe.GPipe.train_step` knows, by name.
SCHEDULES = tuple(BUILT_INS)


def _key(name: str) -> str:
    """A name as :func:`built_in` compares it: lowercase, without spaces, ``-`` or ``_``."""
    return re.sub(r'[\s_-]', '', name.lower())


#: Other names users write for a built-in schedule: the paper's, for fill-drain.
ALIASES = {'gpipe': 'fill_drain'}

_BY_KEY = {_key(name): name for name in SCHEDULES} | ALIASES


def built_in(name: object) -> Optional[str]:
    """The built-in schedule that ``name`` means, as users write it; ``None`` if none.

    Case, spaces, ``-`` and ``_`` do not count: ``'1F1B'``, ``'ZB-H1'``,
    ``'zbh1'``, ``'Interleaved-1F1B'`` and ``' fill-drain '`` are built-in names;
    ``'gpipe'``, the paper's name, is fill-drain.

    Example::

        >>> built_in('ZB-H1'), built_in('Interleaved-1F1B'), built_in('gpipe'), built_in('1fb1')
        ('zb_h1', 'interleaved_1f1b', 'fill_drain', None)
    """
    return _BY_KEY.get(_key(name)) if isinstance(name, str) else None


def closest_name(name: str) -> Optional[str]:
    """The built-in schedule whose name is closest to ``name``, if one is close."""
    close = difflib.get_close_matches(_key(name), list(_BY_KEY), n=1, cutoff=0.5)
    return _BY_KEY[close[0]] if close else None


def unknown_name(name: str) -> ValueError:
    """The error for a name that is no built-in schedule: it lists them, and the closest."""
    close = closest_name(name)
    return ValueError(describe(
        f'schedule must be one of {", ".join(map(repr, SCHEDULES))}, or a schedule of its '
        "actions (text such as '0F0 0B0', or a list of action lists)", f'schedule: {name!r}',
        f'did you mean {close!r}?' if close else "use schedule='1f1b'"))


def check_schedule(schedule: object) -> None:
    """Checks that ``schedule`` names a built-in schedule or is one, before any work.

    Raises:
        ValueError: an unknown name (with the closest, if one is close), or
            an action written wrong (named)
        TypeError: neither a name nor a schedule
    """
    if built_in(schedule) is not None:
        return
    try:
        Schedule.parse(schedule)  # type: ignore[arg-type]
    except ValueError as exc:
        # One word meant as a name: not of an action's shape ('zbh2'), or
        # close to a name ('1fb1' is shaped as an action but means '1f1b').
        if isinstance(schedule, str) and not re.search(r'[\s,]', schedule.strip()) and (
                not re.fullmatch(r'\d+[A-Za-z]+\d+', schedule.strip())
                or closest_name(schedule)):
            raise unknown_name(schedule) from exc
        raise  # meant as a schedule: it names the action written wrong
    except TypeError as exc:
        raise TypeError(describe(f'schedule must be one of {", ".join(map(repr, SCHEDULES))}, '
                                 "or a schedule of its actions (text such as '0F0 0B0', or a "
                                 'list of action lists)', f'schedule: {brief(schedule)}',
                                 "use schedule='1f1b'")) from exc

"""The built-in schedules: short pure functions of the micro-batches ``m`` and partitions ``n``.

For ``m = 4``, ``n = 3``, one column per clock of unit actions::

    fill_drain  0: F0 F1 F2 F3             B3 B2 B1 B0
                1:    F0 F1 F2 F3       B3 B2 B1 B0
                2:       F0 F1 F2 F3 B3 B2 B1 B0

    1f1b        0: F0 F1 F2       B0 F3 B1    B2    B3
                1:    F0 F1    B0 F2 B1 F3 B2    B3
                2:       F0 B0 F1 B1 F2 B2 F3 B3
"""
import difflib
import functools
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Dict, Hashable, List, Optional, Sequence, Tuple

from torchgpipe.engine.schedule import Action, Kind, Schedule, ScheduleLike, clock_order
from torchgpipe.engine.simulator import idle, simulate, unit_cost
from torchgpipe.foundation.validation import brief, describe

__all__: List[str] = []


def worker_of(j: int, n: int, workers: int, layout: str) -> int:
    """The worker of partition ``j`` of ``n``: ``j % workers`` in a loop; in a V
    (``layout='v'``), worker ``w`` keeps partitions ``w`` and ``n - 1 - w``."""
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
    """1F1B: ``n - j`` forward passes to warm up, then a backward and a forward, then drain
    (:func:`interleaved_1f1b` with a partition per worker).

    Example::

        >>> print(one_f_one_b(3, 2))
        0F0 0F1 0B0 0F2 0B1 0B2
        1F0 1B0 1F1 1B1 1F2 1B2
    """
    return interleaved_1f1b(m, n, n)


def zb_h1(m: int, n: int) -> Schedule:
    """ZB-H1 (zero bubble at 1F1B's memory): 1F1B's warm-up, then ``I``, the ``W`` of
    ``j`` micro-batches before, and the next ``F``; the ``W`` left run where 1F1B waits.

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
    """Interleaved 1F1B: ``v = n / p`` partitions a worker (``j`` on ``j % p``), micro-batches
    in rounds of ``p``. Worker ``w`` warms up with ``(v - 1) p + 2 (p - 1 - w)`` forward passes (as
    Megatron-LM does: twice gives each message a forward pass of slack), then alternates.

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

    # A short last round can leave the warm-up waiting in a circle (p = 4, v >= 3,
    # m = 5, 9, ...): warm up more until it finishes (all forward passes first always does).
    for more in range(m * v):
        schedule = lay_out(more)
        try:
            clock_order(schedule.workers, n)
            return schedule
        except ValueError:
            continue
    return lay_out(m * v)


def zbv(m: int, n: int) -> Schedule:
    """ZBV, as the zero-bubble paper draws it: ``n / 2`` workers, worker ``w`` with partitions
    ``w`` and ``n - 1 - w`` (a V), split. After a warm-up of forward passes, each partition
    in turn runs an ``F``, an ``I`` and its ``W`` at once: whatever they cost, no ``W``
    holds up an ``I`` another worker waits for. Fewer than ``n - 1`` micro-batches are laid
    out as ``n - 1``, the missing ones left out. Its peak memory is 1F1B's.

    Raises:
        ValueError: ``n`` is odd
    """
    if n % 2:
        raise ValueError(f"schedule 'zbv' runs two partitions per device in a V, but there "
                         f'are {n} partitions; give a balance of an even number of entries')
    p, steps = n // 2, max(m, n - 1)
    workers: List[List[Action]] = []
    for w in range(p):
        down, up = w, n - 1 - w
        actions: List[Action] = []
        # The next micro-batch of each kind on each of the two partitions.
        next_i = {(kind, j): 0 for kind in (Kind.F, Kind.I, Kind.W) for j in (down, up)}

        def run(*kinds_and_partitions: Tuple[Kind, int]) -> None:
            for kind, j in kinds_and_partitions:
                actions.append(Action(kind, next_i[kind, j], j))
                next_i[kind, j] += 1
        run(*[(Kind.F, down)] * (2 * (p - w) - 1), *[(Kind.F, up), (Kind.F, down)] * w,
            *[(Kind.F, up), (Kind.I, up), (Kind.W, up)] * (p - w))
        while next_i[Kind.F, down] < steps or next_i[Kind.F, up] < next_i[Kind.F, down]:
            run(*[(Kind.F, down)] * (next_i[Kind.F, down] < steps), (Kind.I, down),
                (Kind.W, down), (Kind.F, up), (Kind.I, up), (Kind.W, up))
        run(*[(Kind.I, down), (Kind.I, up)] * w, *[(Kind.I, down), (Kind.W, down)] * (p - w))
        run(*[(Kind.W, up)] * (next_i[Kind.I, up] - next_i[Kind.W, up]),
            *[(Kind.W, down)] * (next_i[Kind.I, down] - next_i[Kind.W, down]))
        workers.append([a for a in actions if a.i < m])
    return Schedule(workers)


@dataclass(frozen=True)
class BuiltIn:
    """A built-in schedule, as all its users read it: a new schedule is one entry.

    ``lay_out(m, n, p)`` gives its actions; ``formula`` and ``bubble(p, v, F, B, W)`` its
    idle time per worker; ``shapes`` the partitions per worker the planner tries, and their
    layout (:func:`worker_of`).
    """

    lay_out: Callable[[int, int, int], Schedule]
    formula: str
    bubble: Callable[[int, int, Fraction, Fraction, Fraction], Fraction]
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
    """The built-in schedule ``name``, checked, cached (``p`` counts for interleaved 1F1B)."""
    schedule = BUILT_INS[name].lay_out(m, n, p)
    schedule.name = name
    schedule.check(micro_batches=m, partitions=n)
    return schedule


def resolve(schedule: ScheduleLike, m: int, n: int, workers: Sequence[Hashable],
            fix: Optional[str] = None) -> Schedule:
    """The schedule a step runs, checked before any work: built-in by name, or the user's.

    ``workers`` runs each partition (a device's thread, a rank); ``fix`` ends the message
    of a schedule worker with partitions on two of them (default: which ``devices`` to give).
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
    """A step's idle fraction: its formula (a built-in's) and its value with unit costs."""
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
    return re.sub(r'[\s_-]', '', name.lower())


#: Other names users write for a built-in schedule: the paper's, for fill-drain.
ALIASES = {'gpipe': 'fill_drain'}

_BY_KEY = {_key(name): name for name in SCHEDULES} | ALIASES


def built_in(name: object) -> Optional[str]:
    """The built-in schedule that ``name`` means (case, spaces, ``-`` and ``_`` aside;
    ``'gpipe'`` is fill-drain), or ``None``.

    Example::

        >>> built_in('ZB-H1'), built_in('Interleaved-1F1B'), built_in('gpipe'), built_in('1fb1')
        ('zb_h1', 'interleaved_1f1b', 'fill_drain', None)
    """
    return _BY_KEY.get(_key(name)) if isinstance(name, str) else None


def closest_name(name: str) -> Optional[str]:
    """The built-in schedule whose name is closest to ``name``, if one is close."""
    close = difflib.get_close_matches(_key(name), list(_BY_KEY), n=1, cutoff=0.5)
    return _BY_KEY[close[0]] if close else None


#: What a schedule must be, as its errors say.
REQUIRED = (f'schedule must be one of {", ".join(map(repr, SCHEDULES))}, or a schedule of its '
            "actions (text such as '0F0 0B0', or a list of action lists)")


def unknown_name(name: str) -> ValueError:
    """The error for a name that is no built-in schedule, with the closest."""
    close = closest_name(name)
    return ValueError(describe(REQUIRED, f'schedule: {name!r}',
                               f'did you mean {close!r}?' if close else "use schedule='1f1b'"))


def check_schedule(schedule: object) -> None:
    """Checks that ``schedule`` names a built-in schedule or is one (``ValueError`` for a
    wrong name or action, ``TypeError`` for neither)."""
    if built_in(schedule) is not None:
        return
    try:
        Schedule.parse(schedule)  # type: ignore[arg-type]
    except ValueError as exc:
        # One word meant as a name: not shaped as an action ('zbh2'), or close to a
        # name ('1fb1').
        if isinstance(schedule, str) and not re.search(r'[\s,]', schedule.strip()) and (
                not re.fullmatch(r'\d+[A-Za-z]+\d+', schedule.strip())
                or closest_name(schedule)):
            raise unknown_name(schedule) from exc
        raise  # meant as a schedule: it names the action written wrong
    except TypeError as exc:
        raise TypeError(describe(REQUIRED, f'schedule: {brief(schedule)}',
                                 "use schedule='1f1b'")) from exc

"""Trials: the configurations predicted fastest, timed on the model before one is chosen.

On CPU predictions are off by a tenth and steps vary by a fifth, so among
close predictions the error decides. Where the pilot runs, the fastest
balance of each :func:`kind` within ``SPREAD`` (``trials`` at most) trains,
and the fastest measured is chosen::

    predicted   A 10.0 ms   B 10.3 ms   C 10.9 ms   D 12.4 ms   E 13.1 ms ...
    measured    A 12.1 ms   B 10.8 ms   C 11.5 ms   D 13.0 ms   (the shortlist)
    chosen      B, then C, A, D (measured), then E ... (predicted)
"""
import functools
import statistics
from typing import Any, Callable, Dict, List, Optional, Tuple

from torchgpipe.planner.option import Option
from torchgpipe.planner.calibrate import in_turns
from torchgpipe.planner.pilot import ModelStep
from torchgpipe.planner.result import Plan

__all__: List[str] = []

#: Steps timed per configuration, after one to warm up.
STEPS = 5
#: How much slower than the fastest a configuration may be predicted and still be tried.
SPREAD = 1.25

#: The keyword arguments of the pipeline of an option (as ``Plan.kwargs`` gives them).
Layout = Callable[[Option], Dict[str, Any]]


def kind(option: Option) -> Tuple[str, int, int]:
    """What sets configurations apart beyond their balance: the schedule, the micro-batches,
    and how many are checkpointed."""
    checkpointed = {'always': option.chunks, 'except_last': option.chunks - 1}
    return option.schedule, option.chunks, checkpointed.get(option.checkpoint, 0)


def shortlist(options: List[Option], trials: int) -> List[Option]:
    """Of ``options`` (fastest predicted first), the fastest of each :func:`kind` within
    ``SPREAD`` of the fastest, ``trials`` at most: balances of one kind differ by noise."""
    short: Dict[Tuple[str, int, int], Option] = {}
    for option in options:
        if len(short) == trials or option.step > SPREAD * options[0].step:
            break
        short.setdefault(kind(option), option)
    return list(short.values())


def tried(options: List[Option], trials: int, steps: ModelStep, layout: Layout
          ) -> List[Option]:
    """``options`` that fit (fastest predicted first) with their shortlist of at most
    ``trials`` timed by ``steps`` in the pipelines ``layout`` gives: those first, fastest
    measured first (``measured`` set), then the rest. Nothing is timed unless two or more
    are on the shortlist."""
    short = shortlist(options, trials)
    if len(short) < 2:
        return options
    times = in_turns([functools.partial(steps, layout(o), o.schedule) for o in short], STEPS)
    for option, into in zip(short, times):
        option.measured = statistics.median(into)
    rest = [o for o in options if all(o is not s for s in short)]
    return sorted(short, key=lambda o: o.measured or 0.0) + rest


def order(steps: Optional[ModelStep], trials: int, devices: List[str], processes: bool
          ) -> Callable[[List[Option]], List[Option]]:
    """How the planner orders the configurations that fit: by :func:`tried` where the pilot
    runs (``steps``), else as predicted."""
    if steps is None:
        return lambda options: options
    timed = steps
    return lambda options: tried(
        options, trials, timed, lambda o: Plan(o, [], devices, None, processes=processes).kwargs)

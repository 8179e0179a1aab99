"""The pace of layers in a pipeline of threads or processes, measured on the model itself.

Workers of CPU devices in one process share the cores and the interpreter's
lock. Once two of them work at once, each waits for the other at the lock
between its operations, and a worker handed a micro-batch waits to be
woken: a step whose micro-batches overlap takes longer than the simulator
predicts from layers timed one at a time (1.4 to 2 times, measured on two
cores for an MLP of 512 wide at 2 to 8 micro-batches), while a step of one
micro-batch takes just that. Nothing measured beside the model (the empty
pipeline of :mod:`~torchgpipe.planner.calibrate`, or copies trained beside
the layers) reproduces it, for it depends on how long each operation holds
the lock.

Processes of one machine share its cores and its memory's bandwidth, and
their messages wait for the receiving process to be scheduled: steps
across them, too, take longer than their layers timed on one rank (by a
quarter at 2 to 32 micro-batches for a CNN on two cores). Where the ranks
outnumber the cores, the simulator shares the cores among the ranks at
work (``Costs.cores``, :mod:`~torchgpipe.engine.simulator`), and the pace
is what is left beyond that.

So the planner runs the model itself: for each micro-batch size it timed
the layers at, a copy of the model trains with 1F1B on the workers, one
partition each (the balance that evens their time), in as many
micro-batches as make that size: a :class:`~torchgpipe.GPipe` on the
devices, or a :class:`~torchgpipe.distributed.DistributedGPipe` across
the group. That size's layer times
are then scaled by the *pace* with which the simulator predicts the steps
measured (found by halving, as :func:`~torchgpipe.planner.calibrate.solve`
finds a message's cost). Sizes no number of micro-batches makes whole take
the pace of the nearest sizes, on the line between them. At the mini-batch
(one micro-batch, nothing overlaps) the pace is about 1; it grows as more
micro-batches overlap.
"""
import copy
import functools
import statistics
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from torchgpipe.balance import blockpartition
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors
from torchgpipe.gpipe import GPipe
from torchgpipe.planner.calibrate import solve, traced_span
from torchgpipe.planner.costs import TIMES, Costs
from torchgpipe.planner.predict import Candidate, micro_batches, predict

__all__: List[str] = []

#: Steps timed per size (a step of the whole model each, on top of the
#: layers' timing): the steps of a pipeline on CPU vary by a fifth or more
#: from one to the next, and more than one in five may be far slower than
#: the rest.
STEPS = 11
#: The largest pace searched for: a step this many times what the layers
#: timed alone predict.
SLOWEST = 8.0

#: Times one of the pilot's training steps: ``step(balance, chunks)`` trains a
#: copy of the model with 1F1B for a step, and gives its time in seconds.
Step = Callable[[Sequence[int], int], float]


def time_balance(costs: Costs, size: int, partitions: int) -> Tuple[int, ...]:
    """The balance of the layers into ``partitions`` whose times at ``size`` are as even
    as can be (the pilot's, one partition per worker)."""
    at = costs.at(size)
    work = [round((at.forward[k] + at.backward[k]) * 1e9) for k in range(costs.layers)]
    return tuple(len(block) for block in blockpartition.solve(work, partitions))


def pace(costs: Costs, workers: int, step: Step) -> List[float]:
    """The pace of each size of ``costs``: the factor on its layers' times with which the
    simulator predicts the median of the steps ``step`` measured.

    The steps of the sizes take turns, a round at a time (the first warms
    up), so that a slow spell of the machine falls on one step of each size,
    which the median leaves out.

    A size whose steps the simulator cannot predict with a factor between 0
    and ``SLOWEST`` (steps shorter than the pipeline's overheads alone,
    or slower than that), like a size no number of micro-batches makes
    whole, takes the pace of its neighbours.

    Args:
        costs: the layers' costs, with the pipeline's overheads
        workers: the pipeline's workers
        step: times a step of the model on them

    Returns:
        a factor per size of ``costs.sizes``
    """
    pilots: Dict[int, Candidate] = {}
    for size in costs.sizes:
        chunks = costs.batch // size
        if micro_batches(costs.batch, chunks) == [size] * chunks:  # made whole
            pilots[size] = Candidate('1f1b', time_balance(costs, size, workers), chunks,
                                     'never', workers)
    measured = dict(zip(pilots, in_turns(
        [functools.partial(step, c.balance, c.chunks) for c in pilots.values()], STEPS)))
    found: Dict[int, float] = {}
    for size, candidate in pilots.items():
        def predicted(factor: float, size: int = size, candidate: Candidate = candidate
                      ) -> float:
            return predict(scaled(costs, {size: factor}), candidate).step
        target = statistics.median(measured[size])
        if predicted(0.0) < target < predicted(SLOWEST):
            found[size] = solve(predicted, target, SLOWEST)
    return fill_in(costs.sizes, [found.get(size) for size in costs.sizes])


def in_turns(calls: Sequence[Callable[[], float]], rounds: int) -> List[List[float]]:
    """What each of ``calls`` measured in ``rounds`` turns, after one more to warm up:
    a turn calls each once, so that a slow spell of the machine falls on one call of
    each, which a median leaves out."""
    measured: List[List[float]] = [[] for _ in calls]
    for turn in range(rounds + 1):
        for call, into in zip(calls, measured):
            seconds = call()
            if turn:
                into.append(seconds)
    return measured


def fill_in(sizes: Sequence[int], found: Sequence[Optional[float]]) -> List[float]:
    """The paces found, and for each size without one the line between its neighbours'
    (the nearest one's beyond the last; 1 if none was found)."""
    known = [(s, f) for s, f in zip(sizes, found) if f is not None]
    if not known:
        return [1.0] * len(sizes)
    filled = []
    for size, factor in zip(sizes, found):
        if factor is None:
            below = [k for k in known if k[0] < size]
            above = [k for k in known if k[0] > size]
            if below and above:
                (low, a), (high, b) = below[-1], above[0]
                factor = a + (b - a) * (size - low) / (high - low)
            else:
                factor = (below[-1] if below else above[0])[1]
        filled.append(factor)
    return filled


def scaled(costs: Costs, factors: Dict[int, float]) -> Costs:
    """``costs`` with each size's times (F, I, B and W) times its factor (sizes not given:
    1)."""
    table = []
    for size, layers in zip(costs.sizes, costs.table):
        factor = factors.get(size, 1.0)
        table.append(replace(layers, **{name: [t * factor for t in getattr(layers, name)]
                                        for name in TIMES}))
    return replace(costs, table=table, _cache={})


#: Makes a pipeline around the model's copy from the keyword arguments of
#: :class:`~torchgpipe.GPipe` (of DistributedGPipe, across processes).
Make = Callable[[nn.Sequential, Dict[str, Any]], Any]
#: Times a training step of the model's copy: ``step(kwargs, schedule)`` in the
#: pipeline of ``kwargs`` (as for ``Make``), in seconds.
ModelStep = Callable[[Dict[str, Any], str], float]


def model_steps(module: nn.Sequential, sample: TensorOrTensors,
                target: Optional[TensorOrTensors], loss_fn: Optional[LossFunction],
                make: Make, ready: Callable[[], object] = lambda: None,
                agree: Callable[[float], float] = lambda seconds: seconds) -> ModelStep:
    """Times training steps of a copy of ``module`` in the pipelines ``make`` makes
    (``module`` itself is left as it is). Without a loss, the loss is the mean of each
    output.

    The pipelines of every configuration asked for wrap the one copy (a step
    at a time), each made at its first step. ``ready()`` runs before each
    step, untimed; ``agree`` turns this process's time into the step's
    (across processes, the slowest rank's).
    """
    model = copy.deepcopy(module)
    loss = loss_fn or _mean_of_outputs
    labels = sample if target is None else target
    pipes: Dict[str, Any] = {}

    def step(kwargs: Dict[str, Any], schedule: str) -> float:
        key = repr(sorted(kwargs.items()))
        if key not in pipes:
            pipes[key] = make(model, kwargs)
        model.zero_grad()
        ready()
        pipe = pipes[key]
        return agree(traced_span(pipe, functools.partial(
            pipe.train_step, sample, labels, loss, schedule=schedule)))
    return step


def one_f_one_b(steps: ModelStep) -> Step:
    """The pilot's steps: 1F1B without checkpointing, one partition per worker."""
    return lambda balance, chunks: steps(
        {'balance': list(balance), 'chunks': chunks, 'checkpoint': 'never'}, '1f1b')


def gpipes(devices: Sequence[torch.device]) -> Make:
    """Pipelines as :class:`~torchgpipe.GPipe` on ``devices``, a worker thread each (by
    default one partition each)."""
    def make(model: nn.Sequential, kwargs: Dict[str, Any]) -> GPipe:
        return GPipe(model, **{'devices': list(devices), **kwargs})
    return make


def _mean_of_outputs(output: TensorOrTensors, target: TensorOrTensors) -> Tensor:
    means = [y.float().mean() for y in Batch(output)
             if isinstance(y, Tensor) and y.is_floating_point()]
    return torch.stack(means).sum() if means else torch.zeros(())


def paced(costs: Costs, factors: Sequence[float]) -> Costs:
    """``costs`` with each size's times scaled by its pace, the paces kept beside them."""
    result = scaled(costs, dict(zip(costs.sizes, factors)))
    result.pace = list(factors)
    return result


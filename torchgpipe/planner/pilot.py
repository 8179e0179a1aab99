"""The pace of layers in a pipeline of threads or processes, measured on the model itself.

CPU workers share the cores (threads also the interpreter's lock), so once
micro-batches overlap a step takes longer than layers timed alone predict,
by an amount only the model reproduces. For each size it timed, the
planner trains a copy of the model with 1F1B on the workers and scales
that size's layer times by the *pace* with which the simulator predicts
the steps measured; sizes no number of micro-batches makes take their
neighbours'.
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
from torchgpipe.planner.calibrate import Make, in_turns, solve, traced_span
from torchgpipe.planner.costs import TIMES, Costs
from torchgpipe.planner.predict import Candidate, micro_batches, predict

__all__: List[str] = []

#: Steps timed per size: steps on CPU vary by a fifth or more, some far slower.
STEPS = 11
#: The largest pace searched for.
SLOWEST = 8.0

#: ``step(balance, chunks)``: the seconds of a 1F1B step of the model's copy.
Step = Callable[[Sequence[int], int], float]


def time_balance(costs: Costs, size: int, partitions: int) -> Tuple[int, ...]:
    """The balance of the layers into ``partitions`` whose times at ``size`` are most even."""
    at = costs.at(size)
    work = [round((at.forward[k] + at.backward[k]) * 1e9) for k in range(costs.layers)]
    return tuple(len(block) for block in blockpartition.solve(work, partitions))


def pace(costs: Costs, workers: int, step: Step) -> List[float]:
    """The pace of each size of ``costs``: the factor on its layers' times with which the
    simulator predicts the median of the steps ``step`` measured on ``workers``.

    A size without a factor between 0 and ``SLOWEST`` that predicts its steps
    takes the pace of its neighbours.
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


def fill_in(sizes: Sequence[int], found: Sequence[Optional[float]]) -> List[float]:
    """The paces found, and for each size without one the line between its neighbours'
    (the nearest one's beyond them; 1 if none was found)."""
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
    """``costs`` with each size's times times its factor in ``factors`` (default 1)."""
    table = []
    for size, layers in zip(costs.sizes, costs.table):
        factor = factors.get(size, 1.0)
        table.append(replace(layers, **{name: [t * factor for t in getattr(layers, name)]
                                        for name in TIMES}))
    return replace(costs, table=table, _cache={})


def model_steps(module: nn.Sequential, sample: TensorOrTensors,
                target: Optional[TensorOrTensors], loss_fn: Optional[LossFunction],
                make: Make, ready: Callable[[], object] = lambda: None,
                agree: Callable[[float], float] = lambda seconds: seconds) -> Step:
    """The pilot's steps: 1F1B without checkpointing of a copy of ``module`` in the
    pipelines ``make`` makes, one per balance and chunks, made at its first step. Without
    a loss, the loss is each output's mean. ``ready()`` runs before each step, untimed;
    ``agree`` turns this process's time into the step's (the slowest rank's)."""
    model = copy.deepcopy(module)
    loss = loss_fn or _mean_of_outputs
    labels = sample if target is None else target
    pipes: Dict[Tuple[Tuple[int, ...], int], Any] = {}

    def step(balance: Sequence[int], chunks: int) -> float:
        key = (tuple(balance), chunks)
        if key not in pipes:
            pipes[key] = make(model, {'balance': list(balance), 'chunks': chunks,
                                      'checkpoint': 'never'})
        model.zero_grad()
        ready()
        pipe = pipes[key]
        return agree(traced_span(pipe, functools.partial(
            pipe.train_step, sample, labels, loss, schedule='1f1b')))
    return step


def _mean_of_outputs(output: TensorOrTensors, target: TensorOrTensors) -> Tensor:
    means = [y.float().mean() for y in Batch(output)
             if isinstance(y, Tensor) and y.is_floating_point()]
    return torch.stack(means).sum() if means else torch.zeros(())


def paced(costs: Costs, factors: Sequence[float]) -> Costs:
    """``costs`` with each size's times scaled by its pace, the paces kept beside them."""
    result = scaled(costs, dict(zip(costs.sizes, factors)))
    result.pace = list(factors)
    return result


"""What the pipeline itself costs, beside the layers: time per task and per message.

The overhead per task and a message's latency are measured the way they
are used: a pipeline of layers too small to cost anything (one
``nn.Linear(1, 1)`` per worker) runs training steps, and the simulator,
each task costing the overhead and each message between workers arriving
a latency after its task, must predict their time (the tasks' span, as a
trace gives it: :func:`traced_span`). Two schedules tell the two apart:
1F1B's workers wait for each other's messages at nearly every task,
fill-drain's only while the pipeline fills and drains (on two processes,
8 micro-batches: 11.3 ms against 6.7 ms, for the same tasks). Checkpointed
tasks add more (the recomputation's bookkeeping and the random state they
restore): steps of 1F1B with ``checkpoint='always'`` give that extra; and so
do split backward passes (the walk that splits the graph), from steps of
ZB-H1.

Copies between devices cost nothing between CPU devices, which share one
memory; between CUDA devices, a copy's time per byte is measured. Between
processes, a message's time per byte is the one that makes the simulator
predict the measured steps of a pipeline whose every message is large.
"""
import statistics
import time
from fractions import Fraction
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchgpipe.engine.generators import named
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.simulator import simulate_sharing
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.placement import same_memory
from torchgpipe.gpipe import GPipe
from torchgpipe.planner.costs import measure
from torchgpipe.planner.predict import Candidate, predict
from torchgpipe.timeline import trace

__all__: List[str] = []

#: Micro-batches and steps of the calibration: enough tasks that the
#: step's own start and end are a small part of it.
CHUNKS = 8
STEPS = 5
#: The elements of each row of the wide calibration's micro-batches: a
#: message of 1 MiB (float32), long enough to take far more than its start.
WIDE = 1 << 18


#: Times training steps of a calibration model on the planner's workers:
#: ``timer(model, checkpoint, schedule, input)`` builds a pipeline of one layer per
#: worker and gives the median time of its steps, in seconds (the slowest
#: worker's, across processes). The input's target is its own zeros.
Timer = Callable[[nn.Sequential, str, str, Tensor], float]


class Overheads(NamedTuple):
    """What the pipeline adds to a step, beside the layers, in seconds.

    Args:
        task: the time it adds to each task
        checkpoint: the further time it adds to each checkpointed ``B`` or ``I``
        split: the time it adds to an ``I`` or a ``W``, instead of ``task``
        latency: the time from a task's end to its message's arrival on
            another worker (the simulator's ``latency``)
    """

    task: float
    checkpoint: float
    split: float
    latency: float


def task_overhead(timer: Timer, p: int, cores: Optional[float] = None) -> Overheads:
    """What the pipeline adds to each task, to each checkpointed backward, and to I or W,
    and a message's latency between workers.

    Args:
        timer: runs the calibration's steps on the ``p`` workers
        p: the workers
        cores: the cores they share, if fewer than ``p`` (``Costs.cores``)
    """
    model, input = empty(p), torch.zeros(CHUNKS, 1)
    each = timer(model, 'never', '1f1b', input)
    drained = timer(model, 'never', 'fill_drain', input) if p > 1 else each
    task, latency = _task_and_latency(each, drained, p, cores)
    checkpointed = timer(model, 'always', '1f1b', input)
    split = timer(model, 'never', 'zb_h1', input)
    plain = {Kind.F: task, Kind.B: task}
    return Overheads(
        task,
        # Checkpointing costs nothing more in F, and all of its extra in B.
        _solved(lambda extra: _span('1f1b', p, {**plain, Kind.B: task + extra}, latency,
                                    cores), checkpointed),
        # I and W each take the split's overhead instead of the task's.
        _solved(lambda other: _span('zb_h1', p, {**plain, Kind.I: other, Kind.W: other},
                                    latency, cores), split),
        latency)


def _task_and_latency(each: float, drained: float, p: int, cores: Optional[float]
                      ) -> Tuple[float, float]:
    """The overhead per task and the latency with which the simulator predicts 1F1B's
    step ``each`` and fill-drain's ``drained`` of the empty pipeline.

    For each latency, one overhead predicts 1F1B's step; the larger the
    latency, the less of fill-drain's step that pair predicts (1F1B pays
    the latency more often), up to the latency that leaves no overhead.
    Fill-drain's step measured picks the pair. No latency if fill-drain took
    as long as it does without one (as on four processes sharing two cores).
    """
    def task(latency: float) -> float:
        return _solved(lambda overhead: _span('1f1b', p, dict.fromkeys(Kind, overhead),
                                              latency, cores), each)

    def fill_drain(latency: float) -> float:
        overhead = task(latency)
        return _span('fill_drain', p, dict.fromkeys(Kind, overhead), latency, cores)

    if p < 2 or fill_drain(0.0) <= drained:
        return task(0.0), 0.0
    most = _solved(lambda latency: _span('1f1b', p, dict.fromkeys(Kind, 0.0), latency,
                                         cores), each)
    latency = solve(lambda latency: -fill_drain(latency), -drained, most)
    return task(latency), latency


def empty(p: int) -> nn.Sequential:
    """A model of ``p`` layers too small to cost anything: one per worker."""
    return nn.Sequential(*[nn.Linear(1, 1) for _ in range(p)])


def zeros_loss(output: TensorOrTensors, target: TensorOrTensors) -> Tensor:
    """The calibration's loss (its target is zeros)."""
    return F.mse_loss(cast(Tensor, output), cast(Tensor, target))


def threads(devices: Sequence[torch.device]) -> Timer:
    """The timer of a :class:`~torchgpipe.GPipe` on ``devices``, one worker each."""
    def timer(model: nn.Sequential, checkpoint: str, schedule: str, input: Tensor) -> float:
        pipe = GPipe(model, [1] * len(devices), devices=list(devices), chunks=CHUNKS,
                     checkpoint=checkpoint)
        target = torch.zeros_like(input)
        return median_step(pipe, lambda: pipe.train_step(input, target, zeros_loss,
                                                         schedule=schedule))
    return timer


def median_step(pipe: Any, step: Callable[[], object],
                ready: Callable[[], object] = lambda: None) -> float:
    """The median time of ``step()`` of ``pipe`` (as :func:`traced_span` measures it),
    the first call (which starts the workers) left out.

    ``ready()`` runs before each step, untimed.
    """
    times = []
    for _ in range(STEPS + 1):
        ready()
        times.append(traced_span(pipe, step))
    return statistics.median(times[1:])


def traced_span(pipe: Any, step: Callable[[], object]) -> float:
    """The time of one training step of ``pipe`` (a GPipe or a DistributedGPipe, every
    rank's), ``step()``: from its first task's start to its last task's end, as a trace
    of the step gives it and the simulator predicts it, without the call's own start
    and end around them. Across processes, every rank must call it together.
    """
    with trace(pipe) as timeline:
        step()
    return timeline.summary(0).step_time


def _span(schedule: str, p: int, seconds: Dict[Kind, float], latency: float,
          cores: Optional[float]) -> float:
    """The empty pipeline's step with the schedule, each action of a kind taking its
    ``seconds`` and each message its ``latency``."""
    def cost(action: Action) -> Fraction:
        return Fraction(round(max(0.0, seconds[action.kind]) * 1e9))
    times = simulate_sharing(named(schedule, CHUNKS, p, p).workers, p, cost, cores,
                             latency=Fraction(round(latency * 1e9)))
    return float(max(end for _, end in times.values())) / 1e9


def _solved(span: Callable[[float], float], step: float) -> float:
    """The ``x`` with which ``span(x)``, never smaller for a larger ``x``, is ``step``
    (0 if even that is too long; no more than the step itself)."""
    return solve(span, step, step)


def copy_cost(devices: Sequence[torch.device], size: int = 1 << 24) -> float:
    """A copy's time per byte between the first two devices (its latency is in the
    calibration's steps, whose messages are copies too).

    Zero within one memory (every CPU device): the pipeline hands the
    tensor over as it is.
    """
    if len(devices) < 2 or same_memory(devices[0], devices[1]):
        return 0.0
    source = torch.empty(size, dtype=torch.uint8, device=devices[0])
    times = {}
    for nbytes in (1, size):
        runs = []
        for _ in range(STEPS):
            torch.cuda.synchronize(devices[0])
            started = time.perf_counter()
            source[:nbytes].to(devices[1])
            torch.cuda.synchronize(devices[1])
            runs.append(time.perf_counter() - started)
        times[nbytes] = statistics.median(runs)
    return max(0.0, (times[size] - times[1]) / (size - 1))


def wide_step(timer: Timer, p: int) -> float:
    """The step of the empty pipeline whose every message is 1 MiB (for :func:`message_cost`)."""
    return timer(empty(p), 'never', '1f1b', torch.zeros(CHUNKS, WIDE, 1))


def message_cost(step: float, p: int, device: torch.device, overheads: Overheads,
                 cores: Optional[float] = None) -> Tuple[float, float]:
    """A message's latency and time per byte between the workers, as a 1F1B step sees them.

    The latency is the calibration's (``overheads``). The time per byte is
    the one that makes the simulator predict ``step``, the time
    :func:`wide_step` measured, whose messages are 1 MiB each (its layers'
    own times measured here, as the planner measures any layer).

    Args:
        step: what :func:`wide_step` measured on the ``p`` workers
        device: where to measure the wide pipeline's layers
        overheads: what :func:`task_overhead` gave
        cores: the cores the workers share, if fewer (``Costs.cores``)
    """
    if p < 2:
        return 0.0, 0.0  # no message
    input = torch.zeros(CHUNKS, WIDE, 1)
    costs = measure(empty(p), input, [1], device, repeat=STEPS,
                    loss=(zeros_loss, torch.zeros_like(input)))
    costs.overhead, costs.checkpoint_overhead, costs.split_overhead, latency = overheads
    costs.cores = cores
    candidate = Candidate('1f1b', (1,) * p, CHUNKS, 'never', p)

    def predicted(per_byte: float) -> float:
        costs.transfer = (latency, per_byte)
        return predict(costs, candidate).step

    # No message can take longer than the whole step.
    return latency, solve(predicted, step, step / (WIDE * 4))


def solve(grows: Callable[[float], float], target: float, high: float) -> float:
    """The ``x`` in ``[0, high]`` at which ``grows(x)``, never smaller for a larger ``x``,
    reaches ``target``: halving the interval."""
    low = 0.0
    for _ in range(30):
        middle = (low + high) / 2
        if grows(middle) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2

"""What the pipeline itself costs, beside the layers: time per task and per message.

The overhead per task is measured the way it is used: a pipeline of layers
too small to cost anything (one ``nn.Linear(1, 1)`` per worker) runs
training steps of 1F1B, and the step's time (its tasks' span, as a trace
gives it: :func:`traced_span`), over the number of tasks the simulator puts
on its longest path, is what each task adds. Checkpointed tasks add more
(the recomputation's bookkeeping and the random state they restore): the
same steps with ``checkpoint='always'`` give that extra; and
so do split backward passes (the walk that splits the graph), from steps of
ZB-H1.

Copies between devices cost nothing between CPU devices, which share one
memory; between CUDA devices, a copy's time per byte is measured. Between
processes, a message's time per byte is the one that makes the simulator
predict the measured steps of a pipeline whose every message is large.
"""
import statistics
import time
from fractions import Fraction
from typing import Any, Callable, List, Optional, Sequence, Tuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchgpipe.engine.generators import named
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.simulator import simulate_sharing
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.placement import same_memory
from torchgpipe.gpipe import GPipe
from torchgpipe.planner.costs import Costs, measure
from torchgpipe.planner.predict import Candidate, predict
from torchgpipe.skip import pop, skippable, stash
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


def task_overhead(timer: Timer, p: int, cores: Optional[float] = None
                  ) -> Tuple[float, float, float]:
    """The time the pipeline adds to each task, to each checkpointed backward, and to I or W.

    Args:
        timer: runs the calibration's steps on the ``p`` workers
        p: the workers
        cores: the cores they share, if fewer than ``p`` (``Costs.cores``)

    Returns:
        seconds per task, the further seconds per checkpointed ``B``, and
        the seconds per task of a split backward pass (``I`` or ``W``)
    """
    tasks = _span('1f1b', p, 1.0, cores=cores)  # in units of one task
    model, input = empty(p), torch.zeros(CHUNKS, 1)
    plain = timer(model, 'never', '1f1b', input) / tasks
    checkpointed = timer(model, 'always', '1f1b', input) / tasks
    split = _split_cost(timer(model, 'never', 'zb_h1', input), plain, p, cores)
    # Checkpointing costs nothing more in F, and all of its extra in B: half the tasks.
    return plain, max(0.0, 2.0 * (checkpointed - plain)), split


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


def _span(schedule: str, p: int, split: float, plain: float = 1.0,
          cores: Optional[float] = None) -> float:
    """The step of the schedule if F and B take ``plain`` and I and W ``split``."""
    def cost(action: Action) -> Fraction:
        seconds = split if action.kind in (Kind.I, Kind.W) else plain
        return Fraction(round(seconds * 1e9))
    times = simulate_sharing(named(schedule, CHUNKS, p, p).workers, p, cost, cores)
    return float(max(end for _, end in times.values())) / 1e9


def _split_cost(step: float, plain: float, p: int, cores: Optional[float]) -> float:
    """The cost of an I or a W that makes ZB-H1's step take ``step``, its F taking ``plain``."""
    return solve(lambda split: _span('zb_h1', p, split, plain, cores), step, step)


def copy_cost(devices: Sequence[torch.device], size: int = 1 << 24) -> Tuple[float, float]:
    """A copy's latency and its time per byte between the first two devices.

    Zero within one memory (every CPU device): the pipeline hands the
    tensor over as it is.
    """
    if len(devices) < 2 or same_memory(devices[0], devices[1]):
        return 0.0, 0.0
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
    per_byte = (times[size] - times[1]) / (size - 1)
    return times[1], max(0.0, per_byte)


def wide_step(timer: Timer, p: int) -> float:
    """The step of the empty pipeline whose every message is 1 MiB (for :func:`message_cost`)."""
    return timer(empty(p), 'never', '1f1b', torch.zeros(CHUNKS, WIDE, 1))


def message_cost(step: float, p: int, device: torch.device,
                 overheads: Tuple[float, float, float], cores: Optional[float] = None
                 ) -> Tuple[float, float]:
    """A message's latency and time per byte between the workers, as a 1F1B step sees them.

    The latency is zero: the small messages of the empty pipeline's steps
    are already in the overhead per task. The time per byte is the one that
    makes the simulator predict ``step``, the time :func:`wide_step`
    measured, whose messages are 1 MiB each (its layers' own times measured
    here, as the planner measures any layer).

    Args:
        step: what :func:`wide_step` measured on the ``p`` workers
        device: where to measure the wide pipeline's layers
        overheads: what :func:`task_overhead` gave
        cores: the cores the workers share, if fewer (``Costs.cores``)
    """
    if p < 2:
        return 0.0, 0.0  # no message
    costs = _calibration_costs(empty(p), torch.zeros(CHUNKS, WIDE, 1), device, overheads,
                               cores)
    candidate = Candidate('1f1b', (1,) * p, CHUNKS, 'never', p)

    def predicted(per_byte: float) -> float:
        costs.transfer = (0.0, per_byte)
        return predict(costs, candidate).step

    # No message can take longer than the whole step.
    return 0.0, solve(predicted, step, step / (WIDE * 4))


@skippable(stash=['skip'])
class _Stash(nn.Linear):
    """A layer of the skipping pipeline that stashes its output for the last one."""

    def forward(self, input: Tensor):  # type: ignore[no-untyped-def]
        output = super().forward(input)
        yield stash('skip', output)
        return output


@skippable(pop=['skip'])
class _PopAdd(nn.Linear):
    """The skipping pipeline's last layer, which adds the skip to its output."""

    def forward(self, input: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop('skip')
        return super().forward(input) + skip


def skipping(p: int) -> nn.Sequential:
    """The empty pipeline of ``p`` layers (at least 2: a skip needs two to cross) with a
    skip from its first to its last."""
    return nn.Sequential(_Stash(1, 1), *[nn.Linear(1, 1) for _ in range(p - 2)], _PopAdd(1, 1))


def skip_step(timer: Timer, p: int) -> float:
    """The step of the skipping pipeline (for :func:`skip_cost`)."""
    return timer(skipping(p), 'never', '1f1b', torch.zeros(CHUNKS, 1))


def skip_cost(step: float, p: int, device: torch.device,
              overheads: Tuple[float, float, float], transfer: Tuple[float, float],
              cores: Optional[float] = None) -> float:
    """What a skip's message between two processes adds beside its bytes' time, as a
    1F1B step sees it: the ``skip_overhead`` with which the simulator predicts
    ``step``, what :func:`skip_step` measured on the ``p`` workers (whose skip goes
    from the first to the last, and its gradient back: a message each way for each
    micro-batch).

    A message is cheap to send, but it has a header, a payload and a wait
    of its own: across two processes of the 2-core machine of the
    benchmarks, 1.4 ms each way, more than an empty task.

    Args:
        step: what :func:`skip_step` measured
        overheads: what :func:`task_overhead` gave
        transfer: what :func:`message_cost` gave
        cores: the cores the workers share, if fewer (``Costs.cores``)
    """
    if p < 2:
        return 0.0  # no message
    costs = _calibration_costs(skipping(p), torch.zeros(CHUNKS, 1), device, overheads, cores)
    costs.transfer = transfer
    candidate = Candidate('1f1b', (1,) * p, CHUNKS, 'never', p)

    def predicted(overhead: float) -> float:
        costs.skip_overhead = overhead
        return predict(costs, candidate).step

    # The first worker's forward passes send a message each, one after another:
    # together, no longer than the whole step.
    return solve(predicted, step, step / CHUNKS)


def _calibration_costs(model: nn.Sequential, input: Tensor, device: torch.device,
                       overheads: Tuple[float, float, float], cores: Optional[float]
                       ) -> Costs:
    """The costs of a calibration pipeline's layers (measured as the planner measures
    any layer, its target zeros), with the pipeline's overheads."""
    costs = measure(model, input, [1], device, repeat=STEPS,
                    loss=(zeros_loss, torch.zeros_like(input)))
    costs.overhead, costs.checkpoint_overhead, costs.split_overhead = overheads
    costs.cores = cores
    return costs


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

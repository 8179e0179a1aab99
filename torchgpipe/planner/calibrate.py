"""What the pipeline itself costs, beside the layers: time per task and per message.

A pipeline of layers too small to cost anything (one ``nn.Linear(1, 1)``
per worker) trains steps of 1F1B; the step's span over the number of tasks
on the simulator's longest path is what each task adds. The same steps with
``checkpoint='always'``, and of ZB-H1, give what checkpointed and split
backward passes add. Copies between CPU devices cost nothing (one memory);
between CUDA devices a copy's time per byte is measured; between processes,
the time per byte with which the simulator predicts steps of large messages.
"""
import statistics
import time
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchgpipe.engine.generators import named
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.simulator import simulate_sharing
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.placement import same_memory
from torchgpipe.modules.gpipe import GPipe
from torchgpipe.planner.costs import Costs, measure
from torchgpipe.planner.predict import Candidate, predict
from torchgpipe.skip import pop, skippable, stash
from torchgpipe.timeline import trace

__all__: List[str] = []

#: Micro-batches and steps of the calibration.
CHUNKS = 8
STEPS = 5
#: The elements of each row of the wide calibration's micro-batches: 1 MiB messages.
WIDE = 1 << 18


#: ``timer(model, checkpoint, schedule, input)``: the median step, in seconds, of a
#: pipeline of one layer per worker (the slowest rank's, across processes).
Timer = Callable[[nn.Sequential, str, str, Tensor], float]


def task_overhead(timer: Timer, p: int, cores: Optional[float] = None
                  ) -> Tuple[float, float, float]:
    """The time the pipeline adds to each task, to each checkpointed backward, and to I or
    W, from ``timer``'s steps on ``p`` workers sharing ``cores`` (``Costs.cores``)."""
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


#: Makes a pipeline of a model from :class:`~torchgpipe.GPipe`'s keyword arguments.
Make = Callable[[nn.Sequential, Dict[str, Any]], Any]


def gpipes(devices: Sequence[torch.device]) -> Make:
    """Pipelines as :class:`~torchgpipe.GPipe` on ``devices``, a worker thread each."""
    def make(model: nn.Sequential, kwargs: Dict[str, Any]) -> GPipe:
        return GPipe(model, **{'devices': list(devices), **kwargs})
    return make


def pipeline_timer(make: Make, ready: Callable[[], object] = lambda: None,
                   agree: Callable[[float], float] = lambda seconds: seconds) -> Timer:
    """The timer of the pipelines ``make`` makes, one layer per worker: ``ready()`` runs
    before each step, untimed; ``agree`` turns this process's median into the step's (the
    slowest rank's)."""
    def timed(model: nn.Sequential, checkpoint: str, schedule: str, input: Tensor) -> float:
        pipe = make(model, {'balance': [1] * len(model), 'chunks': CHUNKS,
                            'checkpoint': checkpoint})
        target = torch.zeros_like(input)
        return agree(median_step(pipe, lambda: pipe.train_step(input, target, zeros_loss,
                                                               schedule=schedule), ready))
    return timed


def median_step(pipe: Any, step: Callable[[], object],
                ready: Callable[[], object] = lambda: None) -> float:
    """The median :func:`traced_span` of ``step()``, the first call (which starts the
    workers) left out; ``ready()`` runs before each step, untimed."""
    def timed() -> float:
        ready()
        return traced_span(pipe, step)
    return statistics.median(in_turns([timed], STEPS)[0])


def in_turns(calls: Sequence[Callable[[], float]], rounds: int) -> List[List[float]]:
    """What each of ``calls`` measured in ``rounds`` turns after a warm-up, each turn calling
    each once, so that a slow spell of the machine falls on one call of each."""
    measured: List[List[float]] = [[] for _ in calls]
    for turn in range(rounds + 1):
        for call, into in zip(calls, measured):
            seconds = call()
            if turn:
                into.append(seconds)
    return measured


def traced_span(pipe: Any, step: Callable[[], object]) -> float:
    """The time of one training step ``step()`` of ``pipe`` from its first task's start to
    its last task's end, as a trace gives it (every rank calls it together)."""
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
    """A copy's latency and time per byte between the first two devices (zero within one memory)."""
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
    """The step of the empty pipeline whose messages are 1 MiB (for :func:`message_cost`)."""
    return timer(empty(p), 'never', '1f1b', torch.zeros(CHUNKS, WIDE, 1))


def message_cost(step: float, p: int, device: torch.device,
                 overheads: Tuple[float, float, float], cores: Optional[float] = None
                 ) -> Tuple[float, float]:
    """A message's latency (zero: the overhead per task has it) and time per byte between
    the workers: the one with which the simulator predicts ``step``, of :func:`wide_step`."""
    if p < 2:
        return 0.0, 0.0  # no message
    costs = _calibration_costs(empty(p), torch.zeros(CHUNKS, WIDE, 1), device, overheads,
                               cores)
    candidate = Candidate('1f1b', (1,) * p, CHUNKS, 'never', p)

    def predicted(per_byte: float) -> float:
        costs.transfer = (0.0, per_byte)
        return predict(costs, candidate).step

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
    """What a skip's own message between two processes adds beside its bytes' time: the
    ``skip_overhead`` with which the simulator predicts ``step``, of :func:`skip_step`
    (a message each way per micro-batch; about 1.4 ms on the benchmarks' machine)."""
    if p < 2:
        return 0.0  # no message
    costs = _calibration_costs(skipping(p), torch.zeros(CHUNKS, 1), device, overheads, cores)
    costs.transfer = transfer
    candidate = Candidate('1f1b', (1,) * p, CHUNKS, 'never', p)

    def predicted(overhead: float) -> float:
        costs.skip_overhead = overhead
        return predict(costs, candidate).step

    return solve(predicted, step, step / CHUNKS)


def _calibration_costs(model: nn.Sequential, input: Tensor, device: torch.device,
                       overheads: Tuple[float, float, float], cores: Optional[float]
                       ) -> Costs:
    """The costs of a calibration pipeline's layers, with the pipeline's overheads."""
    costs = measure(model, input, [1], device, repeat=STEPS,
                    loss=(zeros_loss, torch.zeros_like(input)))
    costs.overhead, costs.checkpoint_overhead, costs.split_overhead = overheads
    costs.cores = cores
    return costs


def solve(grows: Callable[[float], float], target: float, high: float) -> float:
    """The ``x`` in ``[0, high]`` at which the non-decreasing ``grows(x)`` reaches ``target``,
    by bisection."""
    low = 0.0
    for _ in range(30):
        middle = (low + high) / 2
        if grows(middle) < target:
            low = middle
        else:
            high = middle
    return (low + high) / 2

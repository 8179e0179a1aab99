"""What the pipeline itself costs, beside the layers: time per task and per message.

The overhead per task is measured the way it is used: a pipeline of layers
too small to cost anything (one ``nn.Linear(1, 1)`` per device) runs
training steps of 1F1B, and the step's time, over the number of tasks the
simulator puts on its longest path, is what each task adds. Checkpointed
tasks add more (the recomputation's bookkeeping and the random state they
restore): the same steps with ``checkpoint='always'`` give that extra; and
so do split backward passes (the walk that splits the graph), from steps of
ZB-H1.

Copies between devices cost nothing between CPU devices, which share one
memory; between CUDA devices, a copy's time per byte is measured.
"""
import statistics
import time
from fractions import Fraction
from typing import List, Sequence, Tuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchgpipe.engine.generators import named
from torchgpipe.engine.schedule import Action, Kind, simulate
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.placement import same_memory
from torchgpipe.gpipe import GPipe

__all__: List[str] = []

#: Micro-batches and steps of the calibration: enough tasks that the
#: step's own start and end are a small part of it.
CHUNKS = 8
STEPS = 5


def task_overhead(devices: Sequence[torch.device]) -> Tuple[float, float, float]:
    """The time the pipeline adds to each task, to each checkpointed backward, and to I or W.

    Returns:
        seconds per task, the further seconds per checkpointed ``B``, and
        the seconds per task of a split backward pass (``I`` or ``W``)
    """
    p = len(devices)
    tasks = _span('1f1b', p, 1.0)  # in units of one task
    plain = _step_time(devices, 'never', '1f1b') / tasks
    checkpointed = _step_time(devices, 'always', '1f1b') / tasks
    split = _split_cost(_step_time(devices, 'never', 'zb_h1'), plain, p)
    # Checkpointing costs nothing more in F, and all of its extra in B: half the tasks.
    return plain, max(0.0, 2.0 * (checkpointed - plain)), split


def _span(schedule: str, p: int, split: float, plain: float = 1.0) -> float:
    """The step of the schedule if F and B take ``plain`` and I and W ``split``."""
    def cost(action: Action) -> Fraction:
        seconds = split if action.kind in (Kind.I, Kind.W) else plain
        return Fraction(round(seconds * 1e9))
    times = simulate(named(schedule, CHUNKS, p, p).workers, p, cost)
    return float(max(end for _, end in times.values())) / 1e9


def _split_cost(step: float, plain: float, p: int) -> float:
    """The cost of an I or a W that makes ZB-H1's step take ``step``, its F taking ``plain``.

    The step grows with that cost, so halving the interval finds it.
    """
    low, high = 0.0, step
    for _ in range(30):
        middle = (low + high) / 2
        if _span('zb_h1', p, middle, plain) < step:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def _step_time(devices: Sequence[torch.device], checkpoint: str, schedule: str) -> float:
    """The median time of a training step of the empty pipeline, in seconds."""
    model = nn.Sequential(*[nn.Linear(1, 1) for _ in devices])
    pipe = GPipe(model, [1] * len(devices), devices=list(devices), chunks=CHUNKS,
                 checkpoint=checkpoint)
    input, target = torch.zeros(CHUNKS, 1), torch.zeros(CHUNKS, 1)

    def loss_fn(output: TensorOrTensors, target: TensorOrTensors) -> Tensor:
        return F.mse_loss(cast(Tensor, output), cast(Tensor, target))

    times = []
    for _ in range(STEPS + 1):  # the first pays for starting the workers
        started = time.perf_counter()
        pipe.train_step(input, target, loss_fn, schedule=schedule)
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


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

"""A plan's predictions beside what a traced step measured: where the model is off.

:func:`compare` pairs each prediction with its measurement: the step, each
device's (or rank's) time at each kind of task, and each CUDA device's peak
memory (on CPU a trace reads a whole process's peak, not comparable).
"""
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from torchgpipe.foundation.validation import describe
from torchgpipe.planner.option import KINDS, Option, size
from torchgpipe.timeline import Timeline

__all__: List[str] = []


@dataclass
class Row:
    """One prediction and its measurement, in seconds or bytes: of a ``device`` (or
    ``'step'``), ``what``: a kind of task, ``'step'`` or ``'memory'``."""

    device: str
    what: str
    predicted: float
    measured: float

    @property
    def ratio(self) -> float:
        """The measurement over the prediction; above 1, the prediction was too low."""
        return self.measured / self.predicted if self.predicted else float('inf')

    def __str__(self) -> str:
        if self.what == 'memory':
            values = f'{size(self.predicted):>12} {size(self.measured):>12}'
        else:
            values = f'{self.predicted * 1e3:>9.2f} ms {self.measured * 1e3:>9.2f} ms'
        return f'{self.device:<10} {self.what:<10} {values} {self.ratio:>8.3f}x'


@dataclass
class Comparison:
    """The rows of :func:`compare`: the step first, then each device's tasks, then memory;
    printed, a table of prediction, measurement and their ratio."""

    rows: List[Row]

    @property
    def step(self) -> Row:
        """The step time's row."""
        return self.rows[0]

    @property
    def error(self) -> float:
        """How far the step time was from its prediction, as a fraction of it (signed)."""
        return self.step.ratio - 1.0

    def worst(self) -> Optional[Row]:
        """The row furthest from its prediction, by ratio; ``None`` if only the step."""
        rest = [r for r in self.rows[1:] if r.predicted > 0 and r.measured > 0]
        return max(rest, key=lambda r: max(r.ratio, 1 / r.ratio), default=None)

    def __str__(self) -> str:
        head = f'{"where":<10} {"what":<10} {"predicted":>12} {"measured":>12} {"ratio":>9}'
        return '\n'.join([head, *map(str, self.rows)])


def compare(chosen: Option, devices: List[str], timeline: Timeline,
            step: Optional[int] = None, processes: bool = False) -> Comparison:
    """Pairs the predictions of ``chosen`` with a traced training step, ``devices`` naming
    the workers as the timeline's rows do; ``ValueError`` if it is no step of the plan."""
    summary = timeline.summary(step)
    pipe = 'DistributedGPipe(module, **plan.kwargs, device=device), on every rank,' \
        if processes else 'GPipe(module, **plan.kwargs)'
    if not summary.kind.startswith('train_step') or summary.micro_batches != chosen.chunks:
        raise ValueError(describe(
            "compare needs a train_step of the plan's pipeline",
            f'traced: {summary.kind} of {summary.micro_batches} micro-batches, plan: '
            f'{chosen.chunks} micro-batches',
            f'trace {pipe} then .train_step(..., schedule=plan.schedule)'))
    measured: Dict[Tuple[str, str], float] = {}
    on: Dict[str, str] = {}  # the device of each row
    for event in timeline.events:
        if event.step == summary.step and event.kind in KINDS:
            key = (event.track, event.kind)  # (track: the device, or the rank)
            measured[key] = measured.get(key, 0.0) + event.busy
            on[event.track] = event.device
    unknown = {device for device, _ in measured} - set(devices)
    if unknown:
        raise ValueError(describe("compare needs a step on the plan's workers",
                                  f'traced: {sorted(unknown)}, plan: {devices}',
                                  f'trace the {pipe.split("(")[0]} built with plan.kwargs'))
    rows = [Row('step', 'step', chosen.step, summary.step_time)]
    for w, device in enumerate(devices):
        for kind in KINDS:
            predicted = chosen.busy[w].get(kind, 0.0) if w < len(chosen.busy) else 0.0
            if predicted or (device, kind) in measured:
                rows.append(Row(device, kind, predicted, measured.get((device, kind), 0.0)))
    rows += [Row(device, 'memory', chosen.memory[w], summary.peak_memory[device])
             for w, device in enumerate(devices)
             if on.get(device, '').startswith('cuda') and device in summary.peak_memory]
    return Comparison(rows)

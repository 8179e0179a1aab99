"""One configuration the planner predicted, as a plan reports it and saves it."""
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from torchgpipe.planner.predict import Candidate

__all__: List[str] = []

#: The kinds of task a prediction counts, in the order a report shows them.
KINDS = ('forward', 'recompute', 'backward', 'input', 'weight')


@dataclass
class Option:
    """A configuration the planner predicted: what it is and what it would cost.

    Args:
        schedule: the built-in schedule's name
        balance: the layers of each partition
        chunks: micro-batches
        checkpoint: the checkpoint mode
        placement: ``'loop'`` or ``'v'``: where each partition runs
        step: the predicted step time, in seconds
        memory: the predicted peak memory of each device, in bytes
        busy: the predicted work of each device by kind of task, in seconds
    """

    schedule: str
    balance: List[int]
    chunks: int
    checkpoint: str
    placement: str
    step: float
    memory: List[float]
    busy: List[Dict[str, float]] = field(default_factory=list)

    def fits(self, limit: Optional[float]) -> bool:
        """Whether every device's predicted peak is within ``limit`` bytes (``None``: no limit)."""
        return limit is None or max(self.memory) <= limit

    def describe(self) -> str:
        """The configuration in a few words."""
        where = ', V placement' if self.placement == 'v' else ''
        return (f'{self.schedule}, balance {self.balance}, chunks={self.chunks}, '
                f"checkpoint={self.checkpoint!r}{where}")


def option(candidate: Candidate, step: float, memory: List[float],
           busy: List[Dict[str, float]]) -> Option:
    """The option of a predicted candidate."""
    return Option(candidate.schedule, list(candidate.balance), candidate.chunks,
                  candidate.checkpoint, candidate.placement, step, list(memory), busy)


def size(nbytes: float) -> str:
    """Bytes, written in the largest binary unit that keeps a number of at least 1."""
    for unit, scale in (('GiB', 1 << 30), ('MiB', 1 << 20), ('KiB', 1 << 10)):
        if abs(nbytes) >= scale:
            return f'{nbytes / scale:.1f} {unit}'
    return f'{nbytes:.0f} B'

"""What running a partition has shown about it, so later runs can take shortcuts.

Two habits of a partition change what the pipeline must do, and neither can be
read off the modules reliably (any custom layer may have them):

- It **modifies its input in place** (``nn.ReLU(inplace=True)`` right after a
  partition boundary). A checkpointed first pass must then run on a copy of
  its input, or the input saved for the recomputation is overwritten.
- It **draws from the CPU generator** (dropout on CPU). With worker threads, its
  tasks must then take turns with others that do (see :mod:`torchgpipe.rng`).

Until a habit is known, the pipeline assumes the cautious answer and watches.
These facts belong to one GPipe instance's run, not to its model: a copy of the
GPipe starts with none (see :class:`RunState`).
"""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from torchgpipe.stream import AbstractStream

if TYPE_CHECKING:
    from torchgpipe.timeline import Timeline

__all__: List[str] = []


@dataclass
class PartitionTraits:
    """The habits of one partition, as far as runs have shown them."""

    #: Whether a checkpointed first pass changed its input tensors in place;
    #: ``None`` until one has run.
    modifies_input: Optional[bool] = None

    #: Whether a task drew from the CPU generator, for each setting of the
    #: partition's ``training`` flags (dropout draws only in training).
    draws_random: Dict[Tuple[bool, ...], bool] = field(default_factory=dict)


class RunState:
    """The per-run state of a GPipe: copy streams, partition traits, the recording timeline.

    Streams cannot be copied or pickled, and what one instance learned is not
    a property of its model: ``copy.deepcopy``, ``pickle`` and ``torch.save``
    of a GPipe give it a fresh, empty run state.

    Args:
        num_partitions: the number of partitions
    """

    def __init__(self, num_partitions: int) -> None:
        self.num_partitions = num_partitions
        #: For each partition, one copy stream per micro-batch, created on
        #: first use (creating a CUDA stream initializes CUDA).
        self.copy_streams: List[List[AbstractStream]] = []
        self.traits = [PartitionTraits() for _ in range(num_partitions)]
        #: The timeline recording the runs, inside :func:`torchgpipe.trace`.
        self.timeline: Optional['Timeline'] = None

    def __reduce__(self) -> Tuple[type, Tuple[int]]:
        return RunState, (self.num_partitions,)

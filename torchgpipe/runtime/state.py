"""What one GPipe instance keeps from run to run: copy streams, partition traits, the recorder."""
from typing import List, Optional, Sequence, Tuple

import torch

from torchgpipe.foundation.record import Recorder
from torchgpipe.foundation.stream import AbstractStream, new_stream
from torchgpipe.runtime.traits import PartitionTraits

__all__: List[str] = []


class RunState:
    """The per-run state of a GPipe: copy streams, partition traits, the recorder attached.
    Not a property of the model: a copied or pickled GPipe gets a fresh one."""

    def __init__(self, num_partitions: int) -> None:
        self.num_partitions = num_partitions
        #: For each partition, one copy stream per micro-batch, created on
        #: first use (creating a CUDA stream initializes CUDA).
        self.copy_streams: List[List[AbstractStream]] = []
        self.traits = [PartitionTraits() for _ in range(num_partitions)]
        #: The recorder of the runs (a timeline, inside :func:`torchgpipe.trace`).
        self.recorder: Optional[Recorder] = None

    def ensure_copy_streams(self, devices: Sequence[torch.device],
                            chunks: int) -> List[List[AbstractStream]]:
        """A copy stream per partition (on its device) per micro-batch, created once."""
        if not self.copy_streams:
            self.copy_streams.extend([new_stream(device) for _ in range(chunks)]
                                     for device in devices)
        return self.copy_streams

    def __reduce__(self) -> Tuple[type, Tuple[int]]:
        return RunState, (self.num_partitions,)

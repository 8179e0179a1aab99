"""The faces: :class:`~torchgpipe.GPipe` and :class:`~torchgpipe.distributed.DistributedGPipe`,
the modules a user wraps a model in, the base they share, and the state-dict key styles."""
from typing import List

__all__: List[str] = []

"""The faces: :class:`~torchgpipe.GPipe`, the module a user wraps a model in, the base it
shares with :class:`~torchgpipe.distributed.DistributedGPipe`, and the state-dict key styles."""
from typing import List

__all__: List[str] = []

"""The runtime both boundaries of the engine share: partitions, workers, checkpoints,
replay, what runs learned, deferred BatchNorm and the state-dict key styles."""
from typing import List

__all__: List[str] = []

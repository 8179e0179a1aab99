"""The runtime both boundaries of the engine share: partitions, workers, checkpoints,
replay, what runs learned and deferred BatchNorm."""
from typing import List

__all__: List[str] = []

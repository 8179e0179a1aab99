"""The runtime both boundaries of the engine share: partitions, workers, checkpoints.

:mod:`~torchgpipe.runtime.partition` places the partitions on their devices;
:mod:`~torchgpipe.runtime.worker` runs tasks, a thread per device;
:mod:`~torchgpipe.runtime.checkpoint` and :mod:`~torchgpipe.runtime.replay`
drop a micro-batch's activations and recompute them alike;
:mod:`~torchgpipe.runtime.traits` and :mod:`~torchgpipe.runtime.state` keep
what runs learned; :mod:`~torchgpipe.runtime.batchnorm` defers BatchNorm
statistics to the mini-batch; :mod:`~torchgpipe.runtime.plain` holds the
state-dict key styles.
"""
from typing import List

__all__: List[str] = []

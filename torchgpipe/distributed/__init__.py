"""Training beyond one process, on :mod:`torch.distributed`: data-parallel replicas
(:func:`train_step`), pipelines across processes (:class:`DistributedGPipe`), loss
scaling (:class:`GradScaler`), and the errors of a failing or disagreeing rank.
"""
from torchgpipe.distributed.ddp import train_step
from torchgpipe.distributed.scaler import GradScaler
from torchgpipe.modules.distributed import DistributedGPipe
from torchgpipe.transport.faults import Mismatch, PeerFailed, StepTimeout

__all__ = ['DistributedGPipe', 'GradScaler', 'Mismatch', 'PeerFailed', 'StepTimeout', 'train_step']

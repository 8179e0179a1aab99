"""Training beyond one process, on :mod:`torch.distributed`.

- :func:`train_step`: :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>`
  on data-parallel replicas wrapped in
  :class:`~torch.nn.parallel.DistributedDataParallel`, gradients averaged
  as DDP averages them.
- :class:`DistributedGPipe`: a pipeline whose partitions are spread over the
  processes of a group, one or several each, exchanging activations and
  gradients by point-to-point operations; its
  :meth:`~DistributedGPipe.clip_grad_norm_` clips by the norm over every rank.
- :class:`GradScaler`: loss scaling whose ranks skip a step together.
- :exc:`PeerFailed` (and its :exc:`StepTimeout`), :exc:`Mismatch`: what a rank
  raises when another fails or hangs, or when the ranks disagree.
"""
from torchgpipe.distributed.ddp import train_step
from torchgpipe.distributed.pipe import DistributedGPipe
from torchgpipe.distributed.faults import Mismatch, PeerFailed, StepTimeout
from torchgpipe.distributed.scaler import GradScaler

__all__ = ['DistributedGPipe', 'GradScaler', 'Mismatch', 'PeerFailed', 'StepTimeout', 'train_step']

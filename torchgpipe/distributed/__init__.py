"""Training beyond one process, on :mod:`torch.distributed`.

- :func:`train_step`: :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>`
  on data-parallel replicas wrapped in
  :class:`~torch.nn.parallel.DistributedDataParallel`, gradients averaged
  as DDP averages them.
"""
from torchgpipe.distributed.ddp import train_step

__all__ = ['train_step']

"""A GPipe implementation in PyTorch: pipeline parallelism with checkpointing.

Wrap an :class:`nn.Sequential <torch.nn.Sequential>` in :class:`GPipe`, give it a
``balance`` (layers per device) and ``chunks`` (micro-batches), and train it as
you would train the unwrapped module.
"""
from torchgpipe._version import __version__
from torchgpipe.checkpoint import is_checkpointing, is_recomputing
from torchgpipe.gpipe import GPipe

__all__ = ['GPipe', 'is_checkpointing', 'is_recomputing', '__version__']

"""A GPipe implementation in PyTorch: pipeline parallelism with checkpointing.

Wrap an :class:`nn.Sequential <torch.nn.Sequential>` in :class:`GPipe`, give it a
``balance`` (layers per device) and ``chunks`` (micro-batches), and train it as
you would train the unwrapped module.
"""
# Imported through the submodule torchgpipe.__version__ (0.0.7's home of the
# version), not straight from torchgpipe._version: importing a submodule binds
# it as an attribute of the package, so the first import of it must happen
# here, before this line binds the attribute to the string for good.
from torchgpipe.__version__ import __version__
from torchgpipe.checkpoint import is_checkpointing, is_recomputing
from torchgpipe.flatten import to_sequential
from torchgpipe.gpipe import GPipe
from torchgpipe.microbatch import NoChunk
from torchgpipe.timeline import trace

__all__ = ['GPipe', 'NoChunk', 'is_checkpointing', 'is_recomputing', 'to_sequential',
           'trace', '__version__']

"""A GPipe implementation in PyTorch: pipeline parallelism with checkpointing.

Wrap an :class:`nn.Sequential <torch.nn.Sequential>` in :class:`GPipe`, give it a
``balance`` (layers per device) and ``chunks`` (micro-batches), and train it as
you would train the unwrapped module.

:mod:`torchgpipe.distributed` (training over several processes) is loaded on
first use, so ``import torchgpipe`` alone is enough to write
``torchgpipe.distributed.train_step(...)``.
"""
import types

# Imported through the submodule torchgpipe.__version__ (0.0.7's home of the
# version), not straight from torchgpipe._version: importing a submodule binds
# it as an attribute of the package, so the first import of it must happen
# here, before this line binds the attribute to the string for good.
from torchgpipe.__version__ import __version__
from torchgpipe.phase import is_checkpointing, is_recomputing
from torchgpipe.flatten import to_sequential
from torchgpipe.gpipe import GPipe
from torchgpipe.generation import generate
from torchgpipe.nochunk import NoChunk
from torchgpipe.timeline import trace


def __getattr__(name: str) -> types.ModuleType:
    # Called only for names the package does not hold yet. Importing the
    # submodule binds it as an attribute of the package, so this runs once,
    # and a script that never trains over several processes does not load it.
    if name == 'distributed':
        import torchgpipe.distributed as distributed
        return distributed
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = ['GPipe', 'NoChunk', 'generate', 'is_checkpointing', 'is_recomputing',
           'to_sequential', 'trace', '__version__']

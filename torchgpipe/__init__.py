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
from torchgpipe.foundation.phase import is_checkpointing, is_recomputing
from torchgpipe.flatten import to_sequential
from torchgpipe.gpipe import GPipe
from torchgpipe.generation import generate
from torchgpipe.foundation.nochunk import NoChunk
from torchgpipe.timeline import trace
from torchgpipe.planner import Plan, plan

# torchgpipe 0.0.7's modules, bound as attributes of the package as its
# import bound them; each is the module of a layer's folder (see its file).
from torchgpipe import (batchnorm, checkpoint, copy, dependency,  # noqa: F401
                        microbatch, phony, pipeline, stream, worker)


def __getattr__(name: str) -> types.ModuleType:
    # Called only for names the package does not hold yet. Importing the
    # submodule binds it as an attribute of the package, so this runs once,
    # and a script that never trains over several processes does not load it.
    if name == 'distributed':
        import torchgpipe.distributed as distributed
        return distributed
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = ['GPipe', 'NoChunk', 'Plan', 'generate', 'is_checkpointing', 'is_recomputing',
           'plan', 'to_sequential', 'trace', '__version__']

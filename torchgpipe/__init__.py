"""A GPipe implementation in PyTorch: pipeline parallelism with checkpointing."""
import sys
import types

# Through 0.0.7's submodule: its first import binds the module as an attribute, which
# this line then binds to the string for good.
from torchgpipe.__version__ import __version__
from torchgpipe.foundation.phase import is_checkpointing, is_recomputing
from torchgpipe.capture.flatten import to_sequential
from torchgpipe.modules.gpipe import GPipe
from torchgpipe.generation import generate
from torchgpipe.foundation.nochunk import NoChunk
from torchgpipe.timeline import trace
from torchgpipe.planner import Plan, plan

# torchgpipe 0.0.7's modules, bound as its import bound them; each old path is the
# module itself (what a script patches there, the library sees), its file for type checkers.
from torchgpipe.engine import pipeline
from torchgpipe.foundation import copy, dependency, microbatch, phony, stream
from torchgpipe.modules import gpipe
from torchgpipe.runtime import batchnorm, checkpoint, worker

for _module in (batchnorm, checkpoint, copy, dependency, gpipe, microbatch, phony, pipeline,
                stream, worker):
    sys.modules[f'{__name__}.{_module.__name__.rpartition(".")[2]}'] = _module
del _module


def __getattr__(name: str) -> types.ModuleType:
    # torchgpipe.distributed loads on first use (then it is an attribute).
    if name == 'distributed':
        import torchgpipe.distributed as distributed
        return distributed
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')


__all__ = ['GPipe', 'NoChunk', 'Plan', 'generate', 'is_checkpointing', 'is_recomputing',
           'plan', 'to_sequential', 'trace', '__version__']

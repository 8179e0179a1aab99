"""torchgpipe 0.0.7's path of :mod:`torchgpipe.runtime.batchnorm`: the module itself."""
import sys

from torchgpipe.runtime.batchnorm import *  # noqa: F401,F403 (its names, for type checkers)
from torchgpipe.runtime import batchnorm as _module

sys.modules[__name__] = _module

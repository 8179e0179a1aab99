"""torchgpipe 0.0.7's path of :mod:`torchgpipe.runtime.checkpoint`: the module itself."""
import sys

from torchgpipe.runtime.checkpoint import *  # noqa: F401,F403 (its names, for type checkers)
from torchgpipe.runtime import checkpoint as _module

sys.modules[__name__] = _module

"""torchgpipe 0.0.7's path of :mod:`torchgpipe.runtime.worker`: the module itself."""
import sys

from torchgpipe.runtime.worker import *  # noqa: F401,F403 (its names, for type checkers)
from torchgpipe.runtime import worker as _module

sys.modules[__name__] = _module

"""torchgpipe 0.0.7's path of :mod:`torchgpipe.foundation.stream`: the module itself."""
import sys

from torchgpipe.foundation.stream import *  # noqa: F401,F403 (its names, for type checkers)
from torchgpipe.foundation import stream as _module

sys.modules[__name__] = _module

"""torchgpipe 0.0.7's path of :mod:`torchgpipe.modules.gpipe`: the module itself."""
import sys

from torchgpipe.modules.gpipe import *  # noqa: F401,F403 (its names, for type checkers)
from torchgpipe.modules import gpipe as _module

sys.modules[__name__] = _module

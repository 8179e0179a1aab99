"""torchgpipe 0.0.7's path of :mod:`torchgpipe.engine.pipeline`: the module itself."""
import sys

from torchgpipe.engine.pipeline import *  # noqa: F401,F403 (its names, for type checkers)
from torchgpipe.engine import pipeline as _module

sys.modules[__name__] = _module

"""torchgpipe 0.0.7's path of :mod:`torchgpipe.foundation.phony`: the module itself."""
import sys

from torchgpipe.foundation.phony import *  # noqa: F401,F403 (its names, for type checkers)
from torchgpipe.foundation import phony as _module

sys.modules[__name__] = _module

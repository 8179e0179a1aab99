"""torchgpipe 0.0.7's path of :mod:`torchgpipe.foundation.microbatch`: the module itself."""
import sys

from torchgpipe.foundation.microbatch import *  # noqa: F401,F403 (its names, for type checkers)
from torchgpipe.foundation import microbatch as _module

sys.modules[__name__] = _module

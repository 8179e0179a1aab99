"""torchgpipe 0.0.7's path of :mod:`torchgpipe.foundation.copy`, which is the module itself.

This module puts that one in its place in :data:`sys.modules`: every name,
private or not, and the module's state are the same by either path.
"""
import sys

from torchgpipe.foundation.copy import *  # noqa: F401,F403 (its names, for type checkers)
from torchgpipe.foundation import copy as _module

sys.modules[__name__] = _module

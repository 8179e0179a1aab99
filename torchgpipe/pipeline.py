"""torchgpipe 0.0.7's path of :mod:`torchgpipe.engine.pipeline`, which is the module itself.

This module puts that one in its place in :data:`sys.modules`: every name,
private or not, and the module's state are the same by either path.
"""
import sys

from torchgpipe.engine.pipeline import *  # noqa: F401,F403 (its names, for type checkers)
from torchgpipe.engine import pipeline as _module

sys.modules[__name__] = _module

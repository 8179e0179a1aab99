"""torchgpipe 0.0.7's path of :mod:`torchgpipe.foundation.stream`, bound to it by the package."""
from torchgpipe.foundation.stream import *  # noqa: F401,F403 (its names, for type checkers)

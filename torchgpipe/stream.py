"""torchgpipe 0.0.7's path of :mod:`torchgpipe.foundation.stream` (the package binds it)."""
from torchgpipe.foundation.stream import *  # noqa: F401,F403 (its names, for type checkers)

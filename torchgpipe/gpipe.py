"""torchgpipe 0.0.7's path of :mod:`torchgpipe.modules.gpipe` (the package binds it)."""
from torchgpipe.modules.gpipe import *  # noqa: F401,F403 (its names, for type checkers)

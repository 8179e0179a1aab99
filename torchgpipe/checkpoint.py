"""torchgpipe 0.0.7's path of :mod:`torchgpipe.runtime.checkpoint` (the package binds it)."""
from torchgpipe.runtime.checkpoint import *  # noqa: F401,F403 (its names, for type checkers)

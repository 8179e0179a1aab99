"""torchgpipe 0.0.7's path of :mod:`torchgpipe.runtime.worker` (the package binds it)."""
from torchgpipe.runtime.worker import *  # noqa: F401,F403 (its names, for type checkers)

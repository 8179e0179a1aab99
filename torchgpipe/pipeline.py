"""torchgpipe 0.0.7's path of :mod:`torchgpipe.engine.pipeline` (the package binds it)."""
from torchgpipe.engine.pipeline import *  # noqa: F401,F403 (its names, for type checkers)

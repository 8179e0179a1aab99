"""torchgpipe 0.0.7's path of :mod:`torchgpipe.runtime.batchnorm` (the package binds it)."""
from torchgpipe.runtime.batchnorm import *  # noqa: F401,F403 (its names, for type checkers)

"""torchgpipe 0.0.7's path of :mod:`torchgpipe.runtime.batchnorm`, bound to it by the package."""
from torchgpipe.runtime.batchnorm import *  # noqa: F401,F403 (its names, for type checkers)

"""torchgpipe 0.0.7's path of :mod:`torchgpipe.foundation.dependency`, bound to it by the package."""
from torchgpipe.foundation.dependency import *  # noqa: F401,F403 (its names, for type checkers)

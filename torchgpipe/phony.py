"""torchgpipe 0.0.7's path of :mod:`torchgpipe.foundation.phony`, bound to it by the package."""
from torchgpipe.foundation.phony import *  # noqa: F401,F403 (its names, for type checkers)

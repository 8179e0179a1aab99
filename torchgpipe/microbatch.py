"""torchgpipe 0.0.7's path of :mod:`torchgpipe.foundation.microbatch` (the package binds it)."""
from torchgpipe.foundation.microbatch import *  # noqa: F401,F403 (its names, for type checkers)

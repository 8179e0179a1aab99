"""torchgpipe 0.0.7's path of :mod:`torchgpipe.engine.pipeline`, bound to it by the package."""
from torchgpipe.engine.pipeline import *  # noqa: F401,F403 (its names, for type checkers)

"""The version, where torchgpipe 0.0.7 kept it: ``from torchgpipe.__version__ import __version__``.

It is defined once, in :mod:`torchgpipe._version` (which the packaging reads).
"""
from torchgpipe._version import __version__

__all__ = ['__version__']

"""The version, where torchgpipe 0.0.7 kept it (defined in ``_version``, for the packaging)."""
from torchgpipe._version import __version__

__all__ = ['__version__']

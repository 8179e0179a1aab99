"""Capturing the graph of a module's ``forward`` for :func:`~torchgpipe.to_sequential`
(:mod:`torchgpipe.capture.flatten`), with :mod:`torch.fx` (no example) or
:func:`torch.export.export` (on an example), in one form (:mod:`torchgpipe.capture.graph`)."""
from torchgpipe.capture.interface import Interface

__all__ = ['Interface']

"""Capturing the graph of a module's ``forward``, for :func:`~torchgpipe.to_sequential`.

Two ways, one form of graph (:mod:`torchgpipe.capture.graph`): with
:mod:`torch.fx`, on symbolic values and no example
(:mod:`torchgpipe.capture.fx`); with :func:`torch.export.export`, on an
example (:mod:`torchgpipe.capture.export`).
"""
from torchgpipe.capture.interface import Interface

__all__ = ['Interface']

"""CUDA streams, with a CPU stand-in so the same code runs on CPU.

Computation stays on each device's default stream and every copy runs on
another stream (Section 3.2.3), so they overlap. On CPU, :data:`CPUStream`
makes every stream operation a no-op.
"""
from contextlib import nullcontext
from typing import Any, ContextManager, List, Union, cast

import torch

__all__: List[str] = []


class CPUStreamType:
    """The type of :data:`CPUStream`: a stream on CPU, where every kernel is synchronous."""

    def __repr__(self) -> str:
        return 'CPUStream'

    def __reduce__(self) -> str:
        # Still the one CPUStream once copied: is_cuda() compares identity.
        return 'CPUStream'


#: The single stream object standing for "any stream" on CPU.
CPUStream = CPUStreamType()

#: A CUDA stream or :data:`CPUStream`.
AbstractStream = Union[torch.cuda.Stream, CPUStreamType]


def new_stream(device: torch.device) -> AbstractStream:
    """Creates a new non-default stream on the device (:data:`CPUStream` on CPU)."""
    if device.type != 'cuda':
        return CPUStream
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]


def current_stream(device: torch.device) -> AbstractStream:
    """Returns the current stream of the device (:data:`CPUStream` on CPU)."""
    if device.type != 'cuda':
        return CPUStream
    return torch.cuda.current_stream(device)


def default_stream(device: torch.device) -> AbstractStream:
    """Returns the default stream of the device (:data:`CPUStream` on CPU)."""
    if device.type != 'cuda':
        return CPUStream
    return torch.cuda.default_stream(device)


# Entered for every task: on CPU, a shared no-op context is cheapest.
_NO_OP = nullcontext()


def use_device(device: torch.device) -> ContextManager[Any]:
    """Makes the device current within the context (a no-op on CPU)."""
    if device.type != 'cuda':
        return _NO_OP
    return torch.cuda.device(device)


def use_stream(stream: AbstractStream) -> ContextManager[Any]:
    """Makes the stream current on its device within the context (a no-op on CPU)."""
    if not is_cuda(stream):
        return _NO_OP
    return torch.cuda.stream(as_cuda(stream))


def get_device(stream: AbstractStream) -> torch.device:
    """Returns the device of the stream."""
    if is_cuda(stream):
        return as_cuda(stream).device
    return torch.device('cpu')


def wait_stream(source: AbstractStream, target: AbstractStream) -> None:
    """Makes ``source`` wait for every kernel queued on ``target`` so far (a CPU ``source``
    blocks the host; a CPU ``target`` is done already)."""
    if not is_cuda(target):
        return
    if is_cuda(source):
        as_cuda(source).wait_stream(as_cuda(target))
    else:
        as_cuda(target).synchronize()


def record_stream(tensor: torch.Tensor, stream: AbstractStream) -> None:
    """Marks ``tensor`` as in use by ``stream``, so the caching allocator does not reuse its
    memory while ``stream`` still works on it."""
    if is_cuda(stream):
        tensor.record_stream(as_cuda(stream))


def is_cuda(stream: AbstractStream) -> bool:
    """Tells whether the stream is a CUDA stream rather than :data:`CPUStream`."""
    return stream is not CPUStream


def as_cuda(stream: AbstractStream) -> torch.cuda.Stream:
    """Casts the stream to :class:`torch.cuda.Stream` for the type checker."""
    return cast(torch.cuda.Stream, stream)

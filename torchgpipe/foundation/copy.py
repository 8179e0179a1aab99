"""Moving a micro-batch between devices and streams: Copy and Wait, and Ready.

:func:`copy_tensors` moves tensors for the forward path's ``Copy`` and
``Wait`` and for a training step's messages (:class:`Ready`). ``Copy`` runs
on the copy streams of both devices, never a compute stream; ``Wait`` makes
the consumer's stream wait for it. Gradients go back the same way::

    forward:  compute(j) ─Wait─► copy stream(j) ─Copy─► copy stream(j+1) ─Wait─► compute(j+1)
    backward: compute(j) ◄─Wait─ copy stream(j) ◄─Copy─ copy stream(j+1) ◄─Wait─ compute(j+1)
"""
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor

from torchgpipe.foundation.stream import (AbstractStream, as_cuda, current_stream, get_device,
                                          is_cuda, record_stream, use_stream, wait_stream)

__all__: List[str] = []

# Gradients may be undefined (None) in a backward pass.
OptionalTensors = Tuple[Optional[Tensor], ...]


class Copy(torch.autograd.Function):
    """Copies tensors to ``next_stream``'s device, and their gradients back:
    ``Copy.apply(prev_stream, next_stream, *tensors)``."""

    @staticmethod
    def forward(ctx: Any,
                prev_stream: AbstractStream, next_stream: AbstractStream,
                *input: Optional[Tensor]) -> OptionalTensors:
        return move_forward(ctx, copy_tensors, prev_stream, next_stream, input)

    @staticmethod
    def backward(ctx: Any, *grad_output: Optional[Tensor]) -> Tuple[Any, ...]:
        return move_backward(ctx, copy_tensors, grad_output)


Move = Callable[[AbstractStream, AbstractStream, OptionalTensors], OptionalTensors]


def move_forward(ctx: Any, move: Move, prev_stream: AbstractStream, next_stream: AbstractStream,
                 input: OptionalTensors) -> OptionalTensors:
    """The forward pass of :class:`Copy` and :class:`Wait`: ``move`` from ``prev_stream`` on."""
    ctx.prev_stream = prev_stream
    ctx.next_stream = next_stream
    # An output nothing used gets None, not zeros: see Fork.
    ctx.set_materialize_grads(False)
    return move(prev_stream, next_stream, input)


def move_backward(ctx: Any, move: Move, grad_output: OptionalTensors) -> Tuple[Any, ...]:
    """Their backward pass: the gradients ``move`` the other way; none for the streams."""
    return (None, None) + move(ctx.next_stream, ctx.prev_stream, grad_output)


def copy_tensors(source: AbstractStream, target: AbstractStream,
                 tensors: OptionalTensors) -> OptionalTensors:
    """Copies ``tensors`` from ``source``'s device to ``target``'s, on those two streams;
    ``None`` (an undefined gradient) passes as it is."""
    device = get_device(target)
    consumer = current_stream(device)  # (after a Wait)
    output: list[Optional[Tensor]] = []
    # A copy runs on both devices' current streams: make them the copy streams.
    with use_stream(source), use_stream(target):
        for x in tensors:
            if x is None:
                output.append(x)
                continue
            # Blocking on the CPU, where the next line of Python reads the copy.
            y = x.to(device, non_blocking=device.type == 'cuda')
            # x was allocated on another stream and is read by the copy;
            # y was allocated on the copy stream and is read by its consumer.
            record_stream(x, source)
            record_stream(y, consumer)
            output.append(y)
    return tuple(output)


class Wait(torch.autograd.Function):
    """Makes ``next_stream`` wait for ``prev_stream`` (the reverse in backward); the tensors
    pass through: ``Wait.apply(prev_stream, next_stream, *tensors)``."""

    @staticmethod
    def forward(ctx: Any,
                prev_stream: AbstractStream, next_stream: AbstractStream,
                *input: Optional[Tensor]) -> OptionalTensors:
        return move_forward(ctx, _wait, prev_stream, next_stream, input)

    @staticmethod
    def backward(ctx: Any, *grad_output: Optional[Tensor]) -> Tuple[Any, ...]:
        return move_backward(ctx, _wait, grad_output)


def _wait(source: AbstractStream, target: AbstractStream,
          tensors: OptionalTensors) -> OptionalTensors:
    """Makes ``target`` wait for ``source``, and hands the tensors over to ``target``."""
    wait_stream(target, source)
    for x in tensors:
        if x is not None:
            record_stream(x, target)
    # Detached: a Function must return new tensors, not its inputs.
    return tuple(x if x is None else x.detach() for x in tensors)


class Ready:
    """Marks, on CUDA, the moment the tensors a worker sends are computed on its stream
    (``device``); the receiver copies them on the sender's copy stream ``stream`` and its
    own, both waiting for it. On CPU it holds nothing::

        sender compute   ──F──●event
        sender copy               ╰wait─┐
        receiver copy             ╰wait─┴─copy─┐
        receiver compute ──────────────────────╰wait──F──
    """

    __slots__ = ('event', 'stream')

    def __init__(self, device: torch.device, stream: Optional[AbstractStream] = None) -> None:
        self.event: Any = None
        self.stream = stream
        if device.type == 'cuda':
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            self.event.record(as_cuda(current_stream(device)))

    def receive(self, x: Tensor, device: torch.device,
                stream: Optional[AbstractStream] = None) -> Tensor:
        """``x`` on ``device``, without history, safe to use on ``device``'s current stream;
        ``stream``: the receiver's copy stream (default: the current one copies)."""
        if self.event is None and device.type == 'cpu' and x.device.type == 'cpu':
            # Every CPU device is one memory, and its work is done: nothing moves.
            return x.detach()
        compute = current_stream(device)
        source = current_stream(x.device) if self.stream is None else self.stream
        target = compute if stream is None else stream
        if self.event is not None:
            # A copy waits for both devices' current streams: both wait for the sender.
            for copying in {target, source}:
                if is_cuda(copying):
                    as_cuda(copying).wait_event(self.event)
        y, = copy_tensors(source, target, (x.detach(),))
        assert y is not None
        if target is not compute:
            wait_stream(compute, target)
        return y

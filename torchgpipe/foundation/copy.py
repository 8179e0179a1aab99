"""Moving a micro-batch between devices and streams: Copy and Wait, and Ready.

Both engines move tensors with :func:`copy_tensors`: the forward path through
the autograd functions ``Copy`` and ``Wait``, a training step's messages with
:class:`Ready`. ``Copy`` issues the copy on the source's and the destination's
copy streams, never on the compute streams; ``Wait`` makes the consumer's
stream wait for it. The gradients go back the same way::

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
    """Copies tensors to ``next_stream``'s device, and their gradients back.

    Called as ``Copy.apply(prev_stream, next_stream, *tensors)``; returns the
    copies, as a tuple.
    """

    @staticmethod
    def forward(ctx: Any,
                prev_stream: AbstractStream, next_stream: AbstractStream,
                *input: Optional[Tensor]) -> OptionalTensors:
        return hand_over(ctx, copy_tensors, prev_stream, next_stream, input)

    @staticmethod
    def backward(ctx: Any, *grad_output: Optional[Tensor]) -> Tuple[Any, ...]:
        return hand_back(ctx, copy_tensors, grad_output)


Move = Callable[[AbstractStream, AbstractStream, OptionalTensors], OptionalTensors]


def hand_over(ctx: Any, move: Move, prev_stream: AbstractStream, next_stream: AbstractStream,
              input: OptionalTensors) -> OptionalTensors:
    """The forward pass of :class:`Copy` and :class:`Wait`: ``move`` from ``prev_stream`` on."""
    ctx.prev_stream = prev_stream
    ctx.next_stream = next_stream
    # An output nothing used gets None, not zeros: see Fork.
    ctx.set_materialize_grads(False)
    return move(prev_stream, next_stream, input)


def hand_back(ctx: Any, move: Move, grad_output: OptionalTensors) -> Tuple[Any, ...]:
    """Their backward pass: the gradients ``move`` the other way; none for the streams."""
    return (None, None) + move(ctx.next_stream, ctx.prev_stream, grad_output)


def copy_tensors(source: AbstractStream, target: AbstractStream,
                 tensors: OptionalTensors) -> OptionalTensors:
    """Copies tensors from ``source``'s device to ``target``'s, on those two streams.

    Args:
        source: a stream of the tensors' device
        target: a stream of the destination device
        tensors: the tensors; ``None`` (an undefined gradient) passes as it is

    Returns:
        the copies, in order
    """
    device = get_device(target)
    # Tensors produced here are consumed on the target device's current
    # stream (its compute stream, or the stream of the next Copy) once a Wait
    # lets it see them.
    consumer = current_stream(device)
    output: list[Optional[Tensor]] = []
    # A cross-device copy runs on the current streams of both devices: make
    # both of them the copy streams, so no compute stream is involved.
    with use_stream(source), use_stream(target):
        for x in tensors:
            if x is None:
                output.append(x)
                continue
            # Not blocking the host only where the consumer is a stream:
            # on the CPU, the next line of Python reads the copy.
            y = x.to(device, non_blocking=device.type == 'cuda')
            # x was allocated on another stream and is read by the copy;
            # y was allocated on the copy stream and is read by its consumer.
            record_stream(x, source)
            record_stream(y, consumer)
            output.append(y)
    return tuple(output)


class Wait(torch.autograd.Function):
    """Makes ``next_stream`` wait for ``prev_stream``; the tensors pass through unchanged.

    Called as ``Wait.apply(prev_stream, next_stream, *tensors)``. In the
    backward pass, ``prev_stream`` waits for ``next_stream`` instead, before
    the gradients go on.
    """

    @staticmethod
    def forward(ctx: Any,
                prev_stream: AbstractStream, next_stream: AbstractStream,
                *input: Optional[Tensor]) -> OptionalTensors:
        return hand_over(ctx, _wait, prev_stream, next_stream, input)

    @staticmethod
    def backward(ctx: Any, *grad_output: Optional[Tensor]) -> Tuple[Any, ...]:
        return hand_back(ctx, _wait, grad_output)


def _wait(source: AbstractStream, target: AbstractStream,
          tensors: OptionalTensors) -> OptionalTensors:
    """Makes ``target`` wait for ``source``, and hands the tensors over to ``target``."""
    wait_stream(target, source)
    for x in tensors:
        if x is not None:
            # The target stream uses the tensor too: its memory must not be
            # reused until the target is done with it.
            record_stream(x, target)
    # Detached: a Function must return new tensors, not its inputs.
    return tuple(x if x is None else x.detach() for x in tensors)


class Ready:
    """Marks, on CUDA, the moment the tensors a worker sends are computed on its stream.

    The receiver copies them with :func:`copy_tensors` on the sender's copy stream
    (given here) and its own (given to :meth:`receive`), both waiting for that
    moment; its compute stream waits for the copy::

        sender compute   ──F──●event
        sender copy               ╰wait─┐
        receiver copy             ╰wait─┴─copy─┐
        receiver compute ──────────────────────╰wait──F──

    On CPU, where work is done when a call returns, it holds nothing.

    Args:
        device: the sender's device
        stream: the sender's copy stream for this message (default: the current
            stream of the tensors' device, when it is received)
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
        """``x`` on ``device``, without history, safe to use on ``device``'s current stream.

        Args:
            x: a tensor of the message
            device: where the receiver uses it
            stream: the receiver's copy stream on ``device`` (default: its
                current stream, which then runs the copy itself)
        """
        if self.event is None and device.type == 'cpu' and x.device.type == 'cpu':
            # Every CPU device is one memory, and its work is done: nothing moves.
            return x.detach()
        compute = current_stream(device)
        source = current_stream(x.device) if self.stream is None else self.stream
        target = compute if stream is None else stream
        if self.event is not None:
            # PyTorch makes a copy between two devices wait for the current
            # streams of both (here the copy streams), and on a CPU target
            # nothing else waits: both wait for the sender.
            for copying in {target, source}:
                if is_cuda(copying):
                    as_cuda(copying).wait_event(self.event)
        y, = copy_tensors(source, target, (x.detach(),))
        assert y is not None
        if target is not compute:
            wait_stream(compute, target)
        return y

"""Copy and Wait: moving a micro-batch between devices and streams, both ways.

``Copy`` moves tensors to the device of ``next_stream``, issuing the copy on
``prev_stream`` (source device) and ``next_stream`` (destination device) so
that it never queues behind, or blocks, the compute streams. ``Wait`` makes
one stream wait for another, so the consumer of a copy starts only when the
copy is done. Both are autograd functions: in the backward pass the gradients
travel the same way back, on the same streams, in reverse::

    forward:  compute(j) ─Wait─► copy stream(j) ─Copy─► copy stream(j+1) ─Wait─► compute(j+1)
    backward: compute(j) ◄─Wait─ copy stream(j) ◄─Copy─ copy stream(j+1) ◄─Wait─ compute(j+1)
"""
from typing import Any, Callable, List, Optional, Tuple

import torch
from torch import Tensor

from torchgpipe.stream import (AbstractStream, current_stream, get_device, record_stream,
                               use_stream, wait_stream)

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
            y = x.to(device, non_blocking=True)
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

"""Portals: carrying a skip tensor from its stash to its pop, past the graph (Section 3.3.1).

Through the partitions in between, a skip would be copied to every device.
A :class:`Portal` hides it instead, and three autograd functions move it::

    stash partition          input of the pop partition          pop partition
    ───────────────          ──────────────────────────          ─────────────
    tensor ─► PortalBlue     PortalCopy: portal.tensor moved     PortalOrange ─► tensor
              │ (phony       to the pop partition's device       ▲ (phony forked
              ▼  joined into │ (phony joined into the input      │  off the input)
     layer output)           ▼  of the pop partition)

The gradient goes the reverse way. Each function's backward runs after
everything its phony was joined into.
"""
from typing import Any, List, Optional, Tuple, cast

import torch
from torch import Tensor

from torchgpipe.foundation.copy import copy_tensors
from torchgpipe.foundation.phony import get_phony
from torchgpipe.foundation.stream import AbstractStream

__all__: List[str] = []


class Portal:
    """Holds a stashed ``tensor`` for its ``tensor_life`` pops (then frees it), and its
    gradient back."""

    def __init__(self, tensor: Optional[Tensor], tensor_life: int) -> None:
        # Whether the pops send a gradient back: without grad (a checkpoint's
        # first pass) a floating point tensor is assumed to.
        if tensor is None:
            self.requires_grad = False
        elif torch.is_grad_enabled():
            self.requires_grad = tensor.requires_grad
        else:
            self.requires_grad = tensor.is_floating_point()
        # Hidden from the graph: the pop gets it back through PortalOrange.
        self.tensor = None if tensor is None else tensor.detach()
        self.tensor_life = tensor_life
        self.grad: Optional[Tensor] = None

    def blue(self, tensor: Tensor) -> Tensor:
        """A phony whose backward gives ``tensor`` (the stashed one) the portal's gradient: join
        it into the stashing layer's output."""
        return cast(Tensor, PortalBlue.apply(self, tensor))  # type: ignore[no-untyped-call]

    def orange(self, phony: Tensor) -> Optional[Tensor]:
        """The skip tensor, back in the graph, for a pop; ``phony`` is forked off the popping
        layer's input, so everything before the pop waits for the gradient.

        Raises:
            RuntimeError: every pop the portal was made for has happened
        """
        if self.tensor_life <= 0:
            raise RuntimeError('the skip tensor in this portal was already popped')
        if self.tensor is None:
            return self.use_tensor()
        return cast(Tensor, PortalOrange.apply(self, phony))  # type: ignore[no-untyped-call]

    def copy(self, prev_stream: AbstractStream, next_stream: AbstractStream,
             phony: Tensor) -> Tensor:
        """Moves the skip tensor to ``next_stream``'s device; returns a phony to join into the
        popping partition's input, so the gradient is copied back after its backward."""
        return cast(Tensor, PortalCopy.apply(  # type: ignore[no-untyped-call]
            self, prev_stream, next_stream, phony))

    def use_tensor(self) -> Optional[Tensor]:
        """Reads the tensor for a pop, letting go of it after the last one."""
        tensor = self.tensor
        self.tensor_life -= 1
        if self.tensor_life <= 0:
            self.tensor = None
        return tensor


class PortalBlue(torch.autograd.Function):
    """Hides a stashed tensor; its backward returns the gradient from the portal."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, tensor: Tensor) -> Tensor:
        ctx.portal = portal
        return get_phony(tensor.device, requires_grad=False).detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Optional[Tensor]) -> Tuple[None, Optional[Tensor]]:
        grad, ctx.portal.grad = ctx.portal.grad, None  # taken out of the portal
        return None, grad


class PortalOrange(torch.autograd.Function):
    """Brings a hidden tensor back into the graph; its backward puts the gradient in the portal."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, phony: Tensor) -> Tensor:
        ctx.portal = portal
        tensor = portal.use_tensor()
        assert tensor is not None
        output = tensor.detach()
        if not portal.requires_grad:
            ctx.mark_non_differentiable(output)
        return output

    @staticmethod
    def backward(ctx: Any, grad: Optional[Tensor]) -> Tuple[None, None]:
        ctx.portal.grad = grad
        return None, None


class PortalCopy(torch.autograd.Function):
    """Moves the hidden tensor between devices, and its gradient back."""

    @staticmethod
    def forward(ctx: Any, portal: Portal, prev_stream: AbstractStream,
                next_stream: AbstractStream, phony: Tensor) -> Tensor:
        ctx.portal = portal
        ctx.prev_stream = prev_stream
        ctx.next_stream = next_stream
        portal.tensor, = copy_tensors(prev_stream, next_stream, (portal.tensor,))
        return phony.detach()

    @staticmethod
    def backward(ctx: Any, grad_phony: Optional[Tensor]) -> Tuple[None, ...]:
        portal = ctx.portal
        # The copy stream waited for the gradient already: the popping input's Wait ran first.
        portal.grad, = copy_tensors(ctx.next_stream, ctx.prev_stream, (portal.grad,))
        return None, None, None, None

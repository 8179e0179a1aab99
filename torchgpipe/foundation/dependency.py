"""Fork and Join: arbitrary dependencies in the backward graph (Section 3.2.2).

Autograd orders backward tasks by data alone, so ``B(i, j)`` and
``B(i+1, j)`` could run in any order; GPipe needs ``B(i+1, j)`` first. ``fork``
splits a phony off ``x(i, j)`` and ``join`` glues it onto ``x(i+1, j-1)``, the
input of ``F(i+1, j)``::

    forward                            backward (arrows = "runs after")

    x(i,j) ──Fork──► x(i,j)            grad x(i,j) ◄── Fork.backward
               │                                            ▲ waits for the phony
               └─phony─┐                                    │ gradient, i.e. for
    x(i+1,j-1) ──Join──► x(i+1,j-1)    Join.backward ◄──────┘ B(i+1, j) to pass Join

So micro-batch ``i``'s recomputation and ``B(i, j)`` run after ``B(i+1, j)``.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from torchgpipe.foundation.phony import get_phony

__all__: List[str] = []


def fork(input: Tensor) -> Tuple[Tensor, Tensor]:
    """Branches a phony off ``input``, to be joined into another tensor with :func:`join`;
    returns the input (a new autograd node) and the phony, whose gradient its backward
    waits for."""
    if torch.is_grad_enabled() and input.requires_grad:
        input, phony = Fork.apply(input)  # type: ignore[no-untyped-call]
    else:
        phony = get_phony(input.device, requires_grad=False)
    return input, phony


class Fork(torch.autograd.Function):
    """The autograd function behind :func:`fork`: its backward runs once both outputs'
    gradients are in, so it waits for the tensor the phony was joined into."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, input: Tensor) -> Tuple[Tensor, Tensor]:
        # None, not zeros, as the unwrapped model leaves an unused input's (optimizers skip).
        ctx.set_materialize_grads(False)
        phony = get_phony(input.device, requires_grad=False)
        return input.detach(), phony.detach()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad_input: Optional[Tensor], grad_grad: Optional[Tensor]) -> Optional[Tensor]:
        return grad_input


def join(input: Tensor, phony: Tensor) -> Tensor:
    """Merges ``phony`` into ``input``, so the phony's fork waits for the input's backward;
    returns the input (a new autograd node)."""
    if torch.is_grad_enabled() and (input.requires_grad or phony.requires_grad):
        input = Join.apply(input, phony)  # type: ignore[no-untyped-call]
    return input


class Join(torch.autograd.Function):
    """The autograd function behind :func:`join`: its backward passes ``input``'s gradient on,
    releasing the phony's :class:`Fork`."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx,
                input: Tensor, phony: Tensor) -> Tensor:
        ctx.set_materialize_grads(False)  # as Fork's: None passes on as None
        return input.detach()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,
                 grad_input: Optional[Tensor]) -> Tuple[Optional[Tensor], None]:
        return grad_input, None

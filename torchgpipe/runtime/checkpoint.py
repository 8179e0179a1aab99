"""Checkpointing with two autograd functions sharing memory (Section 3.2.4).

GPipe starts the recomputation ``F'(i, j)`` *before* the gradient from the
next partition arrives, so they overlap: where a copy of the gradient separates
them (CUDA), :class:`Recompute` runs it ahead of :class:`Checkpoint`, sharing a
``recomputed`` slot, with the Wait for the gradient's copy between them::

    forward:   input ─► Checkpoint ─► output ─► Wait ─► Recompute ─► output'

    backward:  1. the gradient of output' arrives at Recompute (its copy,
                  issued on a copy stream, may still be running)
               2. Recompute.backward: recompute F with the saved input; stash
                  the local graph in the shared slot; pass the gradient on
               3. Wait.backward: the compute stream waits for the copy
               4. Checkpoint.backward: backpropagate through the stashed graph

Otherwise Checkpoint.backward recomputes. It also joins and forks as
:mod:`~torchgpipe.foundation.dependency` does, a node less each: it takes the phony of
the previous micro-batch's and returns its own, so ``B(i, j)`` waits for ``B(i+1, j)``.
Both passes replay the same random numbers and autocast
(:mod:`torchgpipe.runtime.replay`); the input is kept as saved tensors, so a retained
graph recomputes again.
"""
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor, nn
from torch.nn.modules import module as hooks

from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, Tensors, arrange
from torchgpipe.foundation.nochunk import Layout
# enable_checkpointing and enable_recomputing are reached here by users of 0.0.7.
from torchgpipe.foundation.phase import (collect_roots, enable_checkpointing, enable_recomputing,  # noqa: F401
                              is_checkpointing, is_recomputing)
from torchgpipe.foundation.phony import get_phony
from torchgpipe.runtime.replay import FirstPass, first_pass, recomputation
from torchgpipe.foundation.record import label
from torchgpipe.runtime.traits import PartitionTraits, call_on_copies

__all__ = ['is_checkpointing', 'is_recomputing']

Function = Callable[[TensorOrTensors], TensorOrTensors]

# Recompute's output, input leaves and added roots (phase.add_root), for Checkpoint.backward.
Recomputed = Tuple[TensorOrTensors, Tensors, List[Tensor]]


@dataclass(slots=True, eq=False)
class Context:
    """What a :class:`Checkpoint` and its :class:`Recompute` share besides tensors: the
    partition's ``function``, its input's form (``atomic``, ``layout``, ``num_inputs``
    leading tensors), its ``traits``, whether the recomputation may draw from the CPU
    generator (``exclusive_rng``), the ``task`` for labels, whether it is :func:`plain`."""

    function: Function
    atomic: bool
    layout: Optional[Layout]
    num_inputs: int
    traits: PartitionTraits
    exclusive_rng: bool
    task: Tuple[int, int]
    plain: bool = False
    #: The states to replay, from Checkpoint.forward to Recompute.backward.
    first_pass: Optional[FirstPass] = None
    #: The recomputed graph, from Recompute.backward to Checkpoint.backward.
    recomputed: Optional[Recomputed] = None
    #: Whether the output is a tensor, and where its tensors go in the output tuple
    #: (Checkpoint returns tensors only).
    output_atomic: bool = True
    output_layout: Optional[Layout] = None

    def arguments(self, input: Tensors) -> TensorOrTensors:
        """The function's argument, from the input tensors."""
        return arrange(self.atomic, self.layout, input)


class Checkpointing:
    """Makes a :class:`Checkpoint` for one ``batch``, and its :class:`Recompute` if asked.
    ``parameters`` requiring grad get their gradients from the checkpoint's backward,
    accumulated once per backward pass as without checkpointing (DDP relies on it);
    ``phony``, the :attr:`phony` of the previous micro-batch's, orders the backward passes;
    the other arguments are :class:`Context`'s."""

    def __init__(self, function: Function, batch: Batch, parameters: Sequence[Tensor] = (),
                 traits: Optional[PartitionTraits] = None, exclusive_rng: bool = True,
                 task: Tuple[int, int] = (0, 0), phony: Optional[Tensor] = None,
                 plain: bool = False) -> None:
        self.batch = batch
        self.parameters = parameters
        #: After :meth:`checkpoint`, a phony whose consumer's backward runs before this one.
        self.phony = phony
        self.context = Context(function, batch.atomic, batch.layout, len(batch),
                               PartitionTraits() if traits is None else traits, exclusive_rng,
                               task, plain)

    def checkpoint(self) -> Batch:
        """Runs the function without keeping activations; returns the output batch."""
        # A phony requiring grad: the output always has a backward node.
        phony = self.phony if self.phony is not None else get_phony(self.batch[0].device,
                                                                    requires_grad=True)
        *output, self.phony = apply_checkpoint(phony, self.context, *self.batch,
                                               *self.parameters)
        atomic, layout = self.context.output_atomic, self.context.output_layout
        if not atomic:
            # Only floating point tensors can carry gradients.
            output = [x if x.is_floating_point() else x.detach() for x in output]
        return Batch(arrange(atomic, layout, output), layout)

    def recompute(self, batch: Batch) -> None:
        """Hangs the recomputation ahead of the checkpoint's backward, on the first tensor of
        ``batch`` (:meth:`checkpoint`'s output) requiring grad (if it gets none, the
        checkpoint recomputes)."""
        k = batch.find(lambda x: x.requires_grad)
        if k is not None:
            batch[k] = Recompute.apply(  # type: ignore[no-untyped-call]
                batch[k], self.context, *self.batch)


def checkpoint_stop(checkpoint: str, chunks: int, m: int, training: bool) -> int:
    """How many of the first of ``m`` micro-batches ``checkpoint`` checkpoints (none without a
    backward; ``'except_last'`` spares the last of ``chunks``, as 0.0.7 does)."""
    if not (training and torch.is_grad_enabled()):
        return 0
    return {'always': m, 'except_last': min(m, chunks - 1), 'never': 0}[checkpoint]


def checkpoint(function: Function, input: TensorOrTensors) -> TensorOrTensors:
    """Checkpoints ``function`` on ``input``, like :func:`torch.utils.checkpoint.checkpoint`,
    for tests and debugging.

    Example::

        >>> x = torch.ones(2, requires_grad=True)
        >>> checkpoint(lambda x: x * 3, x).sum().backward()
        >>> x.grad
        tensor([3., 3.])
    """
    batch = Batch(input)
    chk = Checkpointing(function, batch)
    output = chk.checkpoint()
    chk.recompute(output)
    return output.values


class Checkpoint(torch.autograd.Function):
    """Runs the function without keeping activations; backward recomputes it, unless a
    :class:`Recompute` did. The parameters are inputs, their gradients outputs of the
    backward: the engine sums them over micro-batches and accumulates each once, as
    without checkpointing, so hooks on the accumulation (DDP's) fire as usual; other
    leaves of the recomputed graph (:func:`reachable_leaves`) get theirs directly."""

    @staticmethod
    def forward(ctx: Any, phony: Tensor, context: Context,
                *input_and_parameters: Tensor) -> Tensors:
        ctx.context = context
        # None, not zeros, for outputs nothing used, as the unwrapped model leaves them.
        ctx.set_materialize_grads(False)
        input = input_and_parameters[:context.num_inputs]
        ctx.parameters = input_and_parameters[context.num_inputs:]
        ctx.save_for_backward(*input)

        with first_pass(input[0].device, context.exclusive_rng) as context.first_pass:
            output = context.traits.call(context.function, input, context.arguments, 'GPipe')
        # Tensors only, the other values through the context; last, the phony of the fork.
        batch = Batch(output)
        context.output_atomic, context.output_layout = batch.atomic, batch.layout
        return (*batch, get_phony(phony.device, requires_grad=False).detach())

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        context: Context = ctx.context
        output, input_leaf, roots = context.recomputed or recompute(context, ctx.saved_tensors)
        context.recomputed = None
        pairs = [(o, g) for o, g in zip(Batch(output), grad_output)
                 if o.requires_grad and g is not None]
        # Roots whose backward must run whatever the outputs' (a skip's portal phony).
        pairs += [(root, root.detach()) for root in roots]
        tensors, grad_tensors = tuple(o for o, _ in pairs), tuple(g for _, g in pairs)

        # The gradients of the input and the parameters, then of other leaves (captured
        # tensors) unless the function's layers cannot reach any.
        known = (*input_leaf, *ctx.parameters)
        leaves = [x for x in known if x.requires_grad]
        extra: Dict[int, Tensor] = {}
        with label('backward', context.task):
            if tensors and not context.plain:
                extra = reachable_leaves(tensors)
                for x in leaves:
                    extra.pop(id(x), None)
                leaves += extra.values()
            # The engine called directly: torch.autograd.grad's checks cost as much as a
            # small partition's backward.
            grads = iter(ENGINE.run_backward(tensors, grad_tensors, False, False, tuple(leaves),
                                             True, False) if tensors and leaves else ())

        # None for the phony and the context, then the input and the parameters.
        result = (None, None, *(next(grads, None) if x.requires_grad else None for x in known))

        # The others' as a plain backward would.
        for leaf, grad in zip(extra.values(), grads):
            if grad is not None:
                leaf.grad = grad if leaf.grad is None else leaf.grad + grad
        return result


# Checkpoint.apply without the functorch checks of Function.apply: they loop over the
# arguments, every parameter of the partition, for every task.
apply_checkpoint = cast(Any, torch._C._FunctionBase).__dict__['apply'].__get__(None, Checkpoint)


# The autograd engine behind torch.autograd.grad and backward.
ENGINE = cast(Any, torch.autograd.Variable)._execution_engine


def reachable_leaves(tensors: Sequence[Tensor]) -> Dict[int, Tensor]:
    """Every leaf requiring grad that a backward from ``tensors`` reaches, by id()."""
    leaves = {id(t): t for t in tensors if t.grad_fn is None}
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen = set(stack)
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is None or node in seen:
                continue
            if type(node) is AccumulateGrad:
                # A leaf's one node, leading nowhere: not remembered.
                variable = cast(Any, node).variable
                leaves[id(variable)] = variable
            else:
                seen.add(node)
                stack.append(node)
    return leaves


def plain(module: nn.Module) -> bool:
    """Whether ``module``'s layers are PyTorch's own, without forward hooks, a forward of
    their own, tensor attributes or buffers requiring grad: a recomputation's graph then
    has no leaves but its input and parameters (no :func:`reachable_leaves`). Asked at
    every call: hooks and attributes come and go."""
    return not (hooks._global_forward_hooks or hooks._global_forward_pre_hooks) and all(
        type(m).__module__.startswith('torch.nn.modules.')
        and not (m._forward_hooks or m._forward_pre_hooks)
        and not any(name == 'forward' or isinstance(value, Tensor)
                    for name, value in vars(m).items())
        and not any(b is not None and b.requires_grad for b in m._buffers.values())
        for m in module.modules())


# The type of the autograd node that accumulates a leaf's gradient.
AccumulateGrad = type(torch.empty(1, requires_grad=True).view(1).grad_fn
                      .next_functions[0][0])  # type: ignore[union-attr]


class Recompute(torch.autograd.Function):
    """Recomputes the function of a :class:`Checkpoint` as an output's gradient arrives,
    before the checkpoint's backward."""

    @staticmethod
    def forward(ctx: Any, output: Tensor, context: Context, *input: Tensor) -> Tensor:
        ctx.context = context
        ctx.set_materialize_grads(False)  # as Checkpoint's: None passes on as None
        # Saved tensors: released by a backward pass unless the graph is retained.
        ctx.save_for_backward(*input)
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: Optional[Tensor]) -> Tuple[Optional[Tensor], ...]:
        context: Context = ctx.context
        context.recomputed = recompute(context, ctx.saved_tensors)
        return (grad_output, None, *(None for _ in range(context.num_inputs)))


def recompute(context: Context, input: Tensors) -> Recomputed:
    """Runs the checkpointed function again on ``input``, replaying its first pass."""
    input_leaf = tuple(x.detach().requires_grad_(x.requires_grad) for x in input)
    assert context.first_pass is not None
    roots: List[Tensor] = []
    with label('recompute', context.task), recomputation(
            input[0].device, context.first_pass, exclusive=context.exclusive_rng), \
            collect_roots(roots):
        if context.traits.modifies_input:
            # In place on a leaf is an error, and would change the saved input.
            output, _ = call_on_copies(context.function, input_leaf, context.arguments)
        else:
            output = context.function(context.arguments(input_leaf))
    return output, input_leaf, roots

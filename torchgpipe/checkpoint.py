"""Checkpointing with two autograd functions sharing memory (Section 3.2.4).

PyTorch's own checkpoint recomputes a forward inside the backward of a single
autograd node, tying the recomputation ``F'(i, j)`` to ``B(i, j)``. GPipe
wants the recomputation to start *before* the gradient from the next partition
has arrived, so the two overlap. Here :class:`Checkpoint` (forward without
keeping activations, backward through the recomputed graph) and
:class:`Recompute` (the recomputation) are separate nodes that share a
``recomputed`` slot. Recompute passes the output through; the pipeline puts
the Wait for the gradient's copy stream between the two::

    forward:   input ─► Checkpoint ─► output ─► Wait ─► Recompute ─► output'

    backward:  1. the gradient of output' arrives at Recompute (its copy,
                  issued on a copy stream, may still be running)
               2. Recompute.backward: recompute F with the saved input; stash
                  the local graph in the shared slot; pass the gradient on
               3. Wait.backward: the compute stream waits for the copy
               4. Checkpoint.backward: backpropagate through the stashed graph

On CUDA, the recomputation's kernels thus queue before the wait, and run
while the gradient is still being copied.

The recomputation replays the forward exactly: the CPU and CUDA random number
generator states and the autocast state of the first pass are restored, so
dropout draws the same masks and mixed precision computes in the same dtypes.
"""
import threading
from collections import deque
from contextlib import ExitStack, contextmanager, nullcontext
from typing import (Any, Callable, ContextManager, Deque, Dict, Generator, List, Optional,
                    Sequence, Tuple, cast)

import torch
from torch import Tensor

from torchgpipe.microbatch import Batch, TensorOrTensors, Tensors
from torchgpipe.phony import get_phony

__all__ = ['is_checkpointing', 'is_recomputing', 'enable_checkpointing', 'enable_recomputing',
           'Checkpointing', 'Checkpoint', 'Recompute', 'checkpoint']

Function = Callable[[TensorOrTensors], TensorOrTensors]

# The state Checkpoint leaves for Recompute and Checkpoint.backward: the
# recomputed (output, input leaves), the RNG states, and the autocast states.
Recomputed = Tuple[TensorOrTensors, Tensors]
RNGStates = Tuple[Tensor, Optional[Tensor]]
AutocastStates = Tuple[List[Tuple[str, torch.dtype]], bool]


class ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.is_checkpointing = False
        self.is_recomputing = False


thread_local = ThreadLocal()


class _EnableFlag:
    """Sets a flag of :data:`thread_local` within the context.

    A class rather than a generator-based context manager: it is entered
    for every checkpointed task, and this is the cheaper of the two.
    """

    __slots__ = ('name', 'orig')

    def __init__(self, name: str) -> None:
        self.name = name
        self.orig = False

    def __enter__(self) -> None:
        self.orig = getattr(thread_local, self.name)
        setattr(thread_local, self.name, True)

    def __exit__(self, *exc_info: object) -> None:
        setattr(thread_local, self.name, self.orig)


def enable_checkpointing() -> ContextManager[None]:
    """Makes :func:`is_checkpointing` return ``True`` within the context."""
    return _EnableFlag('is_checkpointing')


def enable_recomputing() -> ContextManager[None]:
    """Makes :func:`is_recomputing` return ``True`` within the context."""
    return _EnableFlag('is_recomputing')


def is_checkpointing() -> bool:
    """Whether the current forward propagation is under checkpointing.

    A checkpointed forward runs twice: once without keeping activations
    (here this returns ``True``) and once more, to recompute them, just
    before its backward (see :func:`is_recomputing`).

    Returns:
        bool: ``True`` if it's under checkpointing

    Example::

        class Probe(nn.Module):
            def forward(self, input):
                if is_checkpointing():
                    print('first pass of a checkpointed micro-batch')
                return input
    """
    return thread_local.is_checkpointing


def is_recomputing() -> bool:
    """Whether the current forward propagation is under checkpoint recomputation.

    Use this to prevent duplicated side effects at forward propagation.

    Returns:
        bool: ``True`` if it's under checkpoint recomputation

    Example::

        class Counter(nn.Module):
            def __init__(self):
                super().__init__()
                self.counter = 0

            def forward(self, input):
                if not is_recomputing():
                    self.counter += 1
                return input
    """
    return thread_local.is_recomputing


class Checkpointing:
    """Generates a pair of :class:`Checkpoint` and :class:`Recompute` for one batch.

    Args:
        function: the partition to run on the batch
        batch (Batch): the input micro-batch
        parameters: the parameters of the function. Their gradients are
            returned by the checkpoint's backward, summed by the autograd
            engine over micro-batches and accumulated once per backward pass,
            as without checkpointing (DistributedDataParallel relies on
            that). Gradients of other leaves the function reaches are
            accumulated directly.
    """

    def __init__(self, function: Function, batch: Batch,
                 parameters: Sequence[Tensor] = ()) -> None:
        self.function = function
        self.batch = batch
        self.parameters = tuple(p for p in parameters if p.requires_grad)
        # The slots Checkpoint, Recompute and Checkpoint.backward share. A
        # one-element deque is a mutable box that autograd does not look into.
        self.recomputed: Deque[Recomputed] = deque(maxlen=1)
        self.rng_states: Deque[RNGStates] = deque(maxlen=1)
        self.autocast_states: Deque[AutocastStates] = deque(maxlen=1)

    def checkpoint(self) -> Batch:
        """Runs the function without keeping activations; returns the output batch."""
        # The phony requires grad, so the output always has a backward node to
        # hang the recomputation on, even if no input requires grad.
        phony = get_phony(self.batch[0].device, requires_grad=True)
        output = Checkpoint.apply(phony, self.recomputed, self.rng_states,  # type: ignore[no-untyped-call]
                                  self.autocast_states, self.function, self.batch.atomic,
                                  len(self.batch), *self.batch, *self.parameters)
        if isinstance(output, tuple):
            # Only floating point tensors can carry gradients.
            output = tuple(x if x.is_floating_point() else x.detach() for x in output)
        return Batch(output)

    def recompute(self, batch: Batch) -> None:
        """Schedules the recomputation right before the checkpoint's backward.

        Args:
            batch (Batch): the output batch :meth:`checkpoint` returned; its
                first tensor is replaced by one that carries the dependency
        """
        # Every floating point output requires grad: it came out of Checkpoint
        # with a phony that does. With none, there is no backward to precede.
        index = batch.find(lambda x: x.requires_grad)
        if index is None:
            return
        batch[index] = Recompute.apply(batch[index], self.recomputed,  # type: ignore[no-untyped-call]
                                       self.rng_states, self.autocast_states, self.function,
                                       self.batch.atomic, *self.batch)


def checkpoint(function: Function, input: TensorOrTensors) -> TensorOrTensors:
    """Makes a checkpoint with a simple interface, like :func:`torch.utils.checkpoint.checkpoint`.

    It is only meant to test or debug :class:`Checkpoint` and
    :class:`Recompute` without boilerplate.

    Args:
        function: a function of a tensor or a tuple of tensors
        input (torch.Tensor or tuple of tensors): its input

    Returns:
        torch.Tensor or tuple of tensors: what ``function`` returns, with
        activations dropped and recomputed during the backward pass

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


def save_rng_states(device: torch.device, rng_states: Deque[RNGStates]) -> None:
    """Captures the CPU RNG state, and the CUDA one if the device is CUDA."""
    cpu_rng_state = torch.get_rng_state()
    gpu_rng_state: Optional[Tensor] = None
    if device.type == 'cuda':
        gpu_rng_state = torch.cuda.get_rng_state(device)
    rng_states.append((cpu_rng_state, gpu_rng_state))


@contextmanager
def restore_rng_states(device: torch.device,
                       rng_states: Deque[RNGStates]) -> Generator[None, None, None]:
    """Restores the RNG states of :func:`save_rng_states` within the context.

    Outside the context the generators are as they were, so the
    recomputation does not disturb the random stream of anything else.
    """
    cpu_rng_state, gpu_rng_state = rng_states.pop()
    saved_cpu = torch.get_rng_state()
    saved_gpu = torch.cuda.get_rng_state(device) if gpu_rng_state is not None else None
    torch.set_rng_state(cpu_rng_state)
    if gpu_rng_state is not None:
        torch.cuda.set_rng_state(gpu_rng_state, device)
    try:
        yield
    finally:
        torch.set_rng_state(saved_cpu)
        if saved_gpu is not None:
            torch.cuda.set_rng_state(saved_gpu, device)


_AUTOCAST_DEVICE_TYPES = ('cpu', 'cuda')

if hasattr(torch, 'get_autocast_dtype'):
    def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
        """The dtype autocast casts to on the device type, or ``None`` if it is off."""
        # torch >= 2.4: one API for every device type.
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
else:  # pragma: no cover (torch 2.1 - 2.3: separate functions per device type)
    _LEGACY_AUTOCAST = {'cpu': ('is_autocast_cpu_enabled', 'get_autocast_cpu_dtype'),
                        'cuda': ('is_autocast_enabled', 'get_autocast_gpu_dtype')}

    def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
        """The dtype autocast casts to on the device type, or ``None`` if it is off."""
        is_enabled, get_dtype = _LEGACY_AUTOCAST[device_type]
        if not getattr(torch, is_enabled)():
            return None
        dtype: torch.dtype = getattr(torch, get_dtype)()
        return dtype


def save_autocast_states() -> AutocastStates:
    """Captures the dtype of every enabled autocast, per device type, and the cache flag."""
    enabled = []
    for device_type in _AUTOCAST_DEVICE_TYPES:
        dtype = _autocast_dtype(device_type)
        if dtype is not None:
            enabled.append((device_type, dtype))
    return enabled, torch.is_autocast_cache_enabled()


_NO_AUTOCAST = nullcontext()


def restore_autocast_states(states: AutocastStates) -> ContextManager[Any]:
    """Enters exactly the autocast contexts described by ``states`` (and no other).

    Autocast state is thread-local: a worker thread or the autograd engine's
    thread starts without the caller's, so it has to be carried over.
    """
    if not states[0] and not save_autocast_states()[0]:
        # No autocast then or now, the common case: spare the contexts.
        return _NO_AUTOCAST
    return _restore_autocast_states(states)


@contextmanager
def _restore_autocast_states(states: AutocastStates) -> Generator[None, None, None]:
    enabled, cache_enabled = states
    dtypes = dict(enabled)
    with ExitStack() as stack:
        for device_type in _AUTOCAST_DEVICE_TYPES:
            if device_type in dtypes:
                stack.enter_context(torch.autocast(device_type, dtype=dtypes[device_type],
                                                   cache_enabled=cache_enabled))
            elif _autocast_dtype(device_type) is not None:
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


class Checkpoint(torch.autograd.Function):
    """Runs the function without keeping activations; backward uses :class:`Recompute`'s graph."""

    @staticmethod
    def forward(ctx: Any,
                phony: Tensor,
                recomputed: Deque[Recomputed],
                rng_states: Deque[RNGStates],
                autocast_states: Deque[AutocastStates],
                function: Function,
                input_atomic: bool,
                num_inputs: int,
                *input_and_parameters: Tensor) -> TensorOrTensors:
        ctx.recomputed = recomputed
        input = input_and_parameters[:num_inputs]
        ctx.parameters = input_and_parameters[num_inputs:]
        ctx.parameter_ids = {id(p) for p in ctx.parameters}

        save_rng_states(input[0].device, rng_states)
        autocast_states.append(save_autocast_states())

        with torch.no_grad(), enable_checkpointing():
            output = function(input[0] if input_atomic else input)

        return output

    @staticmethod
    def backward(ctx: Any, *grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        output, input_leaf = ctx.recomputed.pop()
        outputs = (output,) if isinstance(output, Tensor) else output
        pairs = [(o, g) for o, g in zip(outputs, grad_output) if o.requires_grad and g is not None]

        # Gradients by id() of the leaf: hashing tensors calls into Python.
        grads: Dict[int, Optional[Tensor]] = {}
        if pairs:
            tensors, grad_tensors = zip(*pairs)
            leaves = reachable_leaves(tensors)
            if leaves:
                grads = dict(zip(leaves, torch.autograd.grad(tensors, list(leaves.values()),
                                                             grad_tensors, allow_unused=True)))

            # Leaves that are neither inputs nor declared parameters (tensors
            # a layer captured) get their gradients as a plain backward would.
            for key in grads.keys() - {id(x) for x in input_leaf} - ctx.parameter_ids:
                grad = grads[key]
                if grad is not None:
                    leaf = leaves[key]
                    leaf.grad = grad if leaf.grad is None else leaf.grad + grad

        grad_input: List[Optional[Tensor]] = [None] * 7
        grad_input.extend(grads.get(id(x)) for x in input_leaf)
        grad_input.extend(grads.get(id(p)) for p in ctx.parameters)
        return tuple(grad_input)


def reachable_leaves(tensors: Sequence[Tensor]) -> Dict[int, Tensor]:
    """Finds every leaf requiring grad that a backward from ``tensors`` reaches, by id()."""
    leaves = {id(t): t for t in tensors if t.grad_fn is None}
    seen = set()
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if type(node) is AccumulateGrad:
            variable = cast(Any, node).variable
            leaves[id(variable)] = variable
            continue
        for next_node, _ in node.next_functions:
            if next_node is not None:
                stack.append(next_node)
    return leaves


# The type of the autograd node that accumulates a leaf's gradient.
AccumulateGrad = type(torch.empty(1, requires_grad=True).view(1).grad_fn
                      .next_functions[0][0])  # type: ignore[union-attr]


class Recompute(torch.autograd.Function):
    """Recomputes the function of a :class:`Checkpoint` during the backward pass.

    Its forward passes an output of the checkpoint through, so its backward
    runs when that output's gradient arrives, before the checkpoint's.
    """

    @staticmethod
    def forward(ctx: Any,
                output: Tensor,
                recomputed: Deque[Recomputed],
                rng_states: Deque[RNGStates],
                autocast_states: Deque[AutocastStates],
                function: Function,
                input_atomic: bool,
                *input: Tensor) -> Tensor:
        ctx.recomputed = recomputed
        ctx.rng_states = rng_states
        ctx.autocast_states = autocast_states
        ctx.function = function
        ctx.input_atomic = input_atomic
        ctx.save_for_backward(*input)
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> Tuple[Optional[Tensor], ...]:
        input = ctx.saved_tensors
        input_leaf = tuple(x.detach().requires_grad_(x.requires_grad) for x in input)

        with restore_rng_states(input[0].device, ctx.rng_states), \
                restore_autocast_states(ctx.autocast_states.pop()), \
                torch.enable_grad(), enable_recomputing():
            output = ctx.function(input_leaf[0] if ctx.input_atomic else input_leaf)

        ctx.recomputed.append((output, input_leaf))

        return (grad_output,) + (None,) * (5 + len(input))

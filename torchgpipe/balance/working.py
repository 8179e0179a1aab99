"""A layer's working memory: what its backward pass holds beside the activations kept.

The gradients of its output and input and the temporaries between them (a
softmax's gradient, as large as the logits) are alive together.
:func:`working_memory` runs the layer under :class:`Live`, which sees every
storage an operator makes until it is freed::

    live bytes   ^        ___
                 |   ____|   |__          the peak, beside the activations
                 |__|           |___      kept: the layer's working memory
                 +--------------------> time
                   grad_output  grad_input  (weights' gradients left out:
                                             param_scale counts them)

What an operator allocates inside itself is not seen.
"""
import weakref
from contextlib import contextmanager
from typing import (Any, Callable, Dict, Iterator, List, Optional, Sequence, Set, Tuple,
                    cast)

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from torchgpipe.balance.sandbox import detach_tensor
from torchgpipe.engine.split import input_pass
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, map_tensors

__all__: List[str] = []

#: A layer's forward pass as the planner runs it: the output, and the skip
#: tensors the layer stashed, whose gradients its backward pass receives.
LayerForward = Callable[[TensorOrTensors], Tuple[TensorOrTensors, List[Tensor]]]


def ends_of(output: TensorOrTensors, stashed: Sequence[Tensor]) -> List[Tensor]:
    """Where a layer's backward pass starts: its output and stashed skips that need a gradient."""
    return [y for y in [*Batch(output), *stashed] if isinstance(y, Tensor) and y.requires_grad]


class Live(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Notes the storage every operator's output holds, and when it is freed.

    ``log`` holds ``(storage number, +bytes)`` as a storage is first seen and
    ``(storage number, -bytes)`` as it is freed; storages alive before (the
    parameters, the input) are never counted.
    """

    def __init__(self, before: Set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.before = before
        #: The number of each storage alive, by address (a freed address may serve
        #: the next storage, so numbers name them in the log).
        self.alive: Dict[int, int] = {}
        self.log: List[Tuple[int, int]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Optional[Dict[str, Any]] = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, Tensor):
                self._note(tensor.untyped_storage())
        return out

    def _note(self, storage: torch.UntypedStorage) -> None:
        key = storage.data_ptr()
        if not key or key in self.before or key in self.alive:
            return
        number = self.alive[key] = len(self.log)
        self.log.append((number, storage.nbytes()))
        # One Python object per storage lives as long as its bytes, whatever views held them.
        weakref.finalize(storage, self._free, key, number, storage.nbytes())

    def _free(self, key: int, number: int, nbytes: int) -> None:
        if self.alive.get(key) == number:
            del self.alive[key]
            self.log.append((number, -nbytes))

    def numbers(self, tensors: List[Tensor]) -> Set[int]:
        """The numbers of the storages of ``tensors``, alive now."""
        return {self.alive[t.untyped_storage().data_ptr()] for t in tensors
                if t.untyped_storage().data_ptr() in self.alive}

    def peak(self, without: Set[int], since: int) -> int:
        """The most bytes alive at once after log entry ``since``, over those alive then,
        leaving out the storages numbered in ``without``."""
        live = base = top = 0
        for k, (key, change) in enumerate(self.log):
            if k == since:
                base = top = live
            if key not in without:
                live += change
                if k >= since:
                    top = max(top, live)
        return top - base if since < len(self.log) else 0


class _Seed(torch.autograd.Function):
    """The start of a layer's backward pass as within a partition: the output gradients
    come from the backward pass itself, which alone holds them, not from the caller."""

    @staticmethod
    def forward(ctx: Any, *ends: Tensor) -> Tensor:
        ctx.like = [(y.shape, y.dtype, y.device) for y in ends]
        # A tensor that is an end twice (a stash of the layer's own output)
        # gets two gradients in training, which the engine adds in place.
        firsts: Dict[int, int] = {}
        ctx.first = [firsts.setdefault(id(y), k) for k, y in enumerate(ends)]
        return torch.zeros(())

    @staticmethod
    def backward(ctx: Any, _: Tensor) -> Tuple[Optional[Tensor], ...]:
        grads: List[Optional[Tensor]] = []
        for k, (shape, dtype, device) in enumerate(ctx.like):
            grad = torch.ones(shape, dtype=dtype, device=device)
            if ctx.first[k] == k:
                grads.append(grad)
            else:
                cast(Tensor, grads[ctx.first[k]]).add_(grad)
                grads.append(None)
        return tuple(grads)


def working_memory(layer: nn.Module, values: TensorOrTensors, forward: LayerForward, *,
                   accumulating: bool = False, last: bool = False, held: bool = False
                   ) -> Tuple[TensorOrTensors, int]:
    """Runs ``forward(values)``, the pass of ``layer``, and its backward pass; returns the
    output and the most bytes the backward pass held beside what the forward pass left.

    Output gradients are made as training passes them: within a partition by
    the backward pass, which frees each once used; to a partition's ``last``
    layer by the pipeline, which holds them. The caller gets a copy of the
    output unless ``held`` (the layer before a loss). The weights' gradients
    count only ``accumulating``, as temporaries. The weights are left without
    gradients.
    """
    parameters = [p for p in layer.parameters() if p.requires_grad]
    if accumulating:
        for p in parameters:
            p.grad = torch.zeros_like(p)
    before = {x.untyped_storage().data_ptr()
              for x in [*layer.parameters(), *layer.buffers(), *Batch(values),
                        *[p.grad for p in parameters if p.grad is not None]]
              if isinstance(x, Tensor)}
    live = Live(before)
    weights: Set[int] = set()  # (the copy of the output, left out as the weights' gradients)
    with live:
        output, stashed = forward(values)
        ends = ends_of(output, stashed)
        if ends and last:
            since = len(live.log)
            torch.autograd.backward(ends, [torch.ones_like(y) for y in ends])
        elif held:
            since = len(live.log)
            if ends:
                _Seed.apply(*ends).backward()  # type: ignore[no-untyped-call]
        else:
            # Only what saved the output holds it, as within a partition.
            copy = map_tensors(lambda y: y.detach().clone().requires_grad_(y.requires_grad),
                               output)
            seed = _Seed.apply(*ends) if ends else None  # type: ignore[no-untyped-call]
            del output, ends
            since = len(live.log)
            if seed is not None:
                seed.backward()
            output = copy
            weights = live.numbers([y for y in Batch(copy) if isinstance(y, Tensor)])
    # Gradients made in the pass (none when accumulating) became the weights' own.
    weights |= live.numbers([p.grad for p in parameters if p.grad is not None])
    for p in parameters:
        p.grad = None
    return output, live.peak(weights, since)


def forward_memory(layer: nn.Module, values: TensorOrTensors, forward: LayerForward) -> int:
    """Runs ``forward(values)``, the pass of ``layer``; returns the most bytes it held at
    once beyond what it left: its temporaries."""
    live = Live({x.untyped_storage().data_ptr()
                 for x in [*layer.parameters(), *layer.buffers(), *Batch(values)]
                 if isinstance(x, Tensor)})
    with live:
        made = forward(values)
        left = sum(change for _, change in live.log)  # (``made`` alive: in what it left)
    del made
    return max(0, live.peak(set(), 0) - left)


def input_memory(layer: nn.Module, values: TensorOrTensors, forward: LayerForward,
                 skips: Sequence[Tensor] = ()) -> int:
    """Runs ``forward(values)`` and ``I`` (the first half of a split backward pass); returns
    the most bytes ``I`` held beside what the forward pass left.

    ``I`` keeps the graph for ``W``, so what the layer saved stays while
    temporaries are made. ``skips`` are the leaves the layer may pop. Nothing is
    held when the input needs no gradient.
    """
    with _split(layer, values, skips) as (leaves, inputs, live), live:
        # A copy, not the leaves: the layer may work in place.
        output, stashed = forward(map_tensors(torch.Tensor.clone, leaves))
        since = len(live.log)
        ends = ends_of(output, stashed)
        if ends and inputs:
            # Within a partition with weights, I always keeps the graph (not
            # input_pass's choice for a layer alone without any).
            seed = _Seed.apply(*ends)  # type: ignore[no-untyped-call]
            torch.autograd.backward(seed, inputs=inputs, retain_graph=True)
    return live.peak(set(), since)


def retained_for_weights(layer: nn.Module, values: TensorOrTensors, forward: LayerForward,
                         skips: Sequence[Tensor] = ()) -> Tuple[int, int, Set[int]]:
    """Runs ``forward(values)`` and ``I`` (:func:`torchgpipe.engine.split.input_pass`): what
    ``I`` keeps for ``W`` (the gradient at each node leading to a weight) and what it
    frees (the nodes above them). ``skips`` are the leaves the layer may pop.

    Returns:
        the bytes of the gradients ``I`` keeps for ``W``, those of them that are
        the output's gradient itself, and the addresses of the storages freed
    """
    with _split(layer, values, skips) as (leaves, inputs, live):
        with live:
            # A copy, not the leaves: the layer may work in place (ReLU(inplace=True)).
            ends = ends_of(*forward(map_tensors(torch.Tensor.clone, leaves)))
            made = dict(live.alive)  # (the storages the forward pass left, by address)
            if not ends or not inputs:
                return 0, 0, set()
            seeds: List[Optional[Tensor]] = [torch.ones_like(y) for y in ends]
            weights = input_pass(ends, seeds, inputs)
            del ends
            freed = {ptr for ptr, number in made.items() if live.alive.get(ptr) != number}
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes()
                    for grads in weights.kept.values() for g in grads if g is not None}
        given = {g.untyped_storage().data_ptr() for g in seeds if g is not None}
        weights.run()
    return (sum(storages.values()), sum(n for ptr, n in storages.items() if ptr in given),
            freed)


@contextmanager
def _split(layer: nn.Module, values: TensorOrTensors, skips: Sequence[Tensor]
           ) -> Iterator[Tuple[TensorOrTensors, List[Tensor], Live]]:
    """For a split backward pass of ``layer`` alone: its leaves (``values`` detached), those
    that need a gradient (``skips`` too), and a :class:`Live` that counts none of them;
    afterwards, the weights without gradients and the skips' as they were."""
    leaves = map_tensors(detach_tensor, values)
    inputs = [x for x in [*Batch(leaves), *skips] if isinstance(x, Tensor) and x.requires_grad]
    before = [x.grad for x in skips]
    try:
        yield leaves, inputs, Live({
            x.untyped_storage().data_ptr()
            for x in [*layer.parameters(), *layer.buffers(), *Batch(leaves), *skips]
            if isinstance(x, Tensor)})
    finally:
        for p in layer.parameters():
            p.grad = None
        for x, grad in zip(skips, before):
            x.grad = grad

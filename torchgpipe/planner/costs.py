"""What each layer costs, measured once: the planner's input.

At each micro-batch size a plan may run, copies of the layers train in
whole passes, each layer timed in the parts a schedule runs apart::

    F  forward pass          y = layer(x)
    I  input gradients       dx = grad(y, x)       (what the layer before waits for)
    W  weights' gradients    once I is done, from where I left them
    B  whole backward pass   backward(y): dx and the weights' gradients at once

Times come from :mod:`~torchgpipe.balance.timing`, memory from
:mod:`~torchgpipe.balance.memory`; a loss is one more layer; sizes in between
are interpolated (:meth:`Costs.at`).
"""
from dataclasses import asdict, dataclass, field, fields
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from torchgpipe.balance.sandbox import (SandboxSkipTracker, layerwise_sandbox, preserve_rng_state,
                                        refuse_gradients, to_device)
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, map_tensors
from torchgpipe.foundation.placement import same_memory
from torchgpipe.balance.memory import LayerBytes, Route, layer_memory, tensor_bytes
from torchgpipe.balance.timing import PassTimes, layer_times
from torchgpipe.skip.tracker import use_skip_tracker

__all__: List[str] = []

#: The times of :class:`LayerCosts`, in seconds.
TIMES = ('forward', 'input', 'backward', 'weight')


@dataclass
class LayerCosts(LayerBytes):
    """The costs of every layer at one micro-batch size: its bytes, and its times: ``F``,
    ``I``, ``B``, and ``W`` (what the weights' gradients take once ``I`` is done)."""

    forward: List[float] = field(default_factory=list)
    input: List[float] = field(default_factory=list)
    backward: List[float] = field(default_factory=list)
    weight: List[float] = field(default_factory=list)


@dataclass
class Costs:
    """Measured costs of a model's layers at several micro-batch sizes (``sizes``,
    ascending; ``table`` the layers' at each), for mini-batches of ``batch``.

    Args:
        parameters, entry: the bytes of each layer's parameters; per sample of the
            input the first partition copies
        loss: whether the last entry of each list of ``table`` is a loss
        overhead: the seconds the pipeline adds to each task; ``checkpoint_overhead``
            further to a checkpointed ``B`` or ``I``; ``split_overhead`` to ``I``
            or ``W`` instead; ``skip_overhead`` a skip's own message, each way
        transfer: a message's latency and its seconds per byte between workers
        pace: the factor each size's times carry from the pilot
        shared: each parameter several layers hold: those layers, and its bytes
        skips: each skip's route ``(a, b)``: layer ``a`` stashes, ``b`` pops
        processes, cores: whether the workers are processes; how many can work at
            full speed at once, if fewer
    """

    batch: int
    sizes: List[int]
    table: List[LayerCosts]
    parameters: List[int]
    entry: float
    loss: bool = False
    overhead: float = 0.0
    checkpoint_overhead: float = 0.0
    split_overhead: float = 0.0
    transfer: Tuple[float, float] = (0.0, 0.0)
    skip_overhead: float = 0.0
    pace: List[float] = field(default_factory=list)
    shared: List[Tuple[List[int], int]] = field(default_factory=list)
    skips: List[Route] = field(default_factory=list)
    processes: bool = False
    cores: Optional[float] = None
    #: The interpolated costs, by micro-batch size, once asked for.
    _cache: Dict[int, LayerCosts] = field(default_factory=dict, repr=False, compare=False)

    @property
    def layers(self) -> int:
        """The model's layers (the loss, if measured, not counted)."""
        return len(self.parameters)

    def at(self, size: int) -> LayerCosts:
        """Each layer's costs for a micro-batch of ``size`` samples: linear between the
        sizes measured, the nearest one scaled beyond them."""
        if size not in self._cache:
            self._cache[size] = self._interpolate(size)
        return self._cache[size]

    def _interpolate(self, size: int) -> LayerCosts:
        sizes = self.sizes
        if size in sizes:
            return self.table[sizes.index(size)]
        if size < sizes[0] or size > sizes[-1]:
            near = 0 if size < sizes[0] else len(sizes) - 1
            return _combine(self.table[near], self.table[near], size / sizes[near], 0.0)
        upper = next(k for k, s in enumerate(sizes) if s > size)
        low, high = sizes[upper - 1], sizes[upper]
        share = (size - low) / (high - low)
        return _combine(self.table[upper - 1], self.table[upper], 1.0 - share, share)


def _combine(a: LayerCosts, b: LayerCosts, wa: float, wb: float) -> LayerCosts:
    """``wa a + wb b``, quantity by quantity and layer by layer."""
    mixed = {f.name: [wa * x + wb * y for x, y in zip(getattr(a, f.name), getattr(b, f.name))]
             for f in fields(LayerCosts)}
    return LayerCosts(**mixed)


#: A loss function and its target.
LossAndTarget = Tuple[LossFunction, TensorOrTensors]


class Loss(nn.Module):
    """A loss as a layer: ``loss_fn(output, target)`` of the output before it. A target
    ``given`` as the user's, in the loss's memory, is its buffer: no memory of the pass;
    otherwise the pipeline's copies of it count."""

    def __init__(self, loss_fn: LossFunction, target: TensorOrTensors,
                 given: bool = True) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.target = target
        if given:
            for k, tensor in enumerate(x for x in Batch(target) if isinstance(x, Tensor)):
                self.register_buffer(f'target_{k}', tensor, persistent=False)

    def forward(self, output: TensorOrTensors) -> Tensor:
        return self.loss_fn(output, self.target)


def rows(values: TensorOrTensors, size: int) -> TensorOrTensors:
    """The first ``size`` samples of each tensor of a batch."""
    return map_tensors(lambda x: x[:size], values)


def measure(module: nn.Sequential, sample: TensorOrTensors, sizes: Sequence[int],
            device: torch.device, *, repeat: int = 3, loss: Optional[LossAndTarget] = None
            ) -> Costs:
    """Measures every layer of ``module`` (and the ``loss``) at each micro-batch size of
    ``sizes`` on ``device``, from a ``sample`` of the largest size or more: a pass for
    the memory, then rounds visiting every size in turn, the first a warm-up, each time
    the least of ``repeat`` (interruptions only add time). ``module`` and the random
    generators are left as they were; the planner adds the overheads."""
    refuse_gradients(module)
    given = all(same_memory(x.device, device) for x in Batch(sample) if isinstance(x, Tensor))
    sample = to_device(sample, device)
    batch = next(x for x in Batch(sample) if isinstance(x, Tensor)).size(0)
    sizes = sorted(set(sizes))
    copies = list(layerwise_sandbox(module, device))
    tracker = SandboxSkipTracker()
    prepared = []  # each size's loss (as the last layer, or none) and memory
    routes: List[Route] = []
    with preserve_rng_state(device), torch.enable_grad(), use_skip_tracker(tracker):
        for size in sizes:
            tail = [] if loss is None else [_loss_at(loss, size, device)]
            memory, routes = layer_memory(copies + tail, rows(sample, size), tracker,
                                          loss=bool(tail))
            prepared.append((tail, memory))
        timed: List[List[Tuple[PassTimes, PassTimes]]] = [[] for _ in sizes]
        # Every size in turn: a slow spell of the machine falls on one round
        # of each size (the least leaves it out), not on one size.
        for turn in range(repeat + 1):
            for size, (tail, _), into in zip(sizes, prepared, timed):
                split = layer_times(copies + tail, rows(sample, size), device, True)
                whole = layer_times(copies + tail, rows(sample, size), device, False)
                if turn:
                    into.append((split, whole))
    table = []
    for (_, memory), rounds in zip(prepared, timed):
        splits, wholes = [r[0] for r in rounds], [r[1] for r in rounds]
        backward, input = _least([r.backward for r in wholes]), _least([r.input for r in splits])
        weight = _shared(min(r.weight for r in splits), splits[0].cut, backward, input)
        table.append(LayerCosts(forward=_least([r.forward for r in splits]), input=input,
                                backward=backward, weight=weight, **asdict(memory)))
    parameters = [sum(p.numel() * p.element_size() for p in c.parameters()) for c in copies]
    return Costs(batch=batch, sizes=sizes, table=table, parameters=parameters,
                 shared=shared_parameters(module), skips=routes,
                 entry=0.0 if given else tensor_bytes(rows(sample, 1)), loss=loss is not None)


def _least(rounds: List[List[float]]) -> List[float]:
    """Each layer's least time over ``rounds`` (interruptions only add time)."""
    return [min(layer) for layer in zip(*rounds)]


def _shared(weight: float, cut: int, backward: Sequence[float], input: Sequence[float]
            ) -> List[float]:
    """Each layer's part of ``W``'s time ``weight``, after the first ``cut`` layers
    (whose ``W`` is their whole backward pass): shared as their ``B`` exceeds their ``I``."""
    beyond = [max(0.0, b - i) for b, i in zip(backward[cut:], input[cut:])]
    whole = sum(beyond)
    return [*backward[:cut], *[weight * t / whole if whole else weight / len(beyond)
                               for t in beyond]]


def shared_parameters(module: nn.Sequential) -> List[Tuple[List[int], int]]:
    """Each parameter several layers of ``module`` hold: those layers, and its bytes."""
    holders: Dict[int, Tuple[List[int], int]] = {}
    for k, layer in enumerate(module):
        for p in layer.parameters():
            holders.setdefault(id(p), ([], p.numel() * p.element_size()))[0].append(k)
    return [held for held in holders.values() if len(held[0]) > 1]


def _loss_at(loss: LossAndTarget, size: int, device: torch.device) -> nn.Module:
    """The loss as a layer, against the first ``size`` samples of the target."""
    loss_fn, target = loss
    given = all(same_memory(x.device, device) for x in Batch(target) if isinstance(x, Tensor))
    micro = rows(to_device(target, device), size)
    return Loss(loss_fn, micro if given else map_tensors(torch.clone, micro), given)

"""What each layer costs, measured once: the planner's input.

For each micro-batch size a plan may run, every layer runs on a copy of
itself, on the detached output of the layer before (so that its backward
pass stays within it), and is timed in the parts a schedule runs apart::

    F  forward pass          y = layer(x)
    I  input gradients       dx = grad(y, x)       (what the layer before waits for)
    B  whole backward pass   backward(y): dx and the weights' gradients at once

``W``, the weights' gradients once ``I`` is done, is what ``B`` does beyond
``I`` (:mod:`torchgpipe.engine.split` keeps the gradients ``I`` reached, and
``W`` goes on from there).

The memory comes from the same runs: the bytes the forward pass keeps for
the backward pass (the tensors autograd saves, the outputs and stashed skip
tensors, each storage once; see :func:`~torchgpipe.balance.profile.saved_by_forward`),
the bytes of the output (what a boundary after the layer sends), and the
bytes of the parameters. A loss, if given, is measured as one more layer,
which the last partition runs.

Sizes in between those measured are read by linear interpolation
(:meth:`Costs.at`): a layer's time grows with its micro-batch in steps, not
smoothly, but between powers of two a line is close.
"""
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from torchgpipe.balance.profile import (SandboxSkipTracker, detach_tensor, fresh_input,
                                        layerwise_sandbox, preserve_rng_state, refuse_gradients,
                                        saved_by_forward, synchronize, to_device)
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, map_tensors
from torchgpipe.skip.tracker import use_skip_tracker

__all__: List[str] = []

#: What :func:`measure` reads of each layer, at each micro-batch size: times in seconds.
TIMES = ('forward', 'input', 'backward')
#: ... and memory in bytes.
BYTES = ('kept', 'output')


@dataclass
class LayerCosts:
    """The costs of every layer at one micro-batch size, a list per quantity.

    A loss measured with the layers is the last entry of each list.
    """

    forward: List[float]
    input: List[float]
    backward: List[float]
    kept: List[float]
    output: List[float]


@dataclass
class Costs:
    """Measured costs of a model's layers, at several micro-batch sizes.

    Args:
        batch: the size of the mini-batch the model trains on (the sample's)
        sizes: the micro-batch sizes measured, ascending
        table: for each size (in the order of ``sizes``), the layers' costs
        parameters: the bytes of each layer's parameters
        entry: the bytes of one sample of the model's input
        loss: whether the last entry of each list of ``table`` is a loss
        overhead: the time the pipeline adds to each task, in seconds
        checkpoint_overhead: what it adds further to a checkpointed ``B`` or ``I``
        transfer: a message's latency in seconds and its time per byte,
            between two workers (zero within one memory)
    """

    batch: int
    sizes: List[int]
    table: List[LayerCosts]
    parameters: List[int]
    entry: float
    loss: bool = False
    overhead: float = 0.0
    checkpoint_overhead: float = 0.0
    transfer: Tuple[float, float] = (0.0, 0.0)
    #: The interpolated costs, by micro-batch size, once asked for.
    _cache: Dict[int, LayerCosts] = field(default_factory=dict, repr=False, compare=False)

    @property
    def layers(self) -> int:
        """The model's layers (the loss, if measured, not counted)."""
        return len(self.parameters)

    def at(self, size: int) -> LayerCosts:
        """Each layer's costs for a micro-batch of ``size`` samples.

        Between two sizes measured, a straight line between them; below the
        smallest or above the largest, the nearest one scaled by ``size``.
        """
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

    def to_dict(self) -> Dict[str, Any]:
        """The costs as JSON-ready data; :meth:`from_dict` reads it back."""
        data = asdict(self)
        data.pop('_cache')
        return data

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> 'Costs':
        """The costs :meth:`to_dict` wrote."""
        data = dict(data)
        data['table'] = [LayerCosts(**row) for row in data['table']]
        data['transfer'] = tuple(data['transfer'])
        return cls(**data)


def _combine(a: LayerCosts, b: LayerCosts, wa: float, wb: float) -> LayerCosts:
    """``wa a + wb b``, quantity by quantity and layer by layer."""
    mixed = {name: [wa * x + wb * y for x, y in zip(getattr(a, name), getattr(b, name))]
             for name in TIMES + BYTES}
    return LayerCosts(**mixed)


#: A loss function and its target.
LossAndTarget = Tuple[Callable[[TensorOrTensors, TensorOrTensors], Tensor], TensorOrTensors]


class Loss(nn.Module):
    """A loss as a layer: ``loss_fn(output, target)`` of the output before it."""

    def __init__(self, loss_fn: Callable[[TensorOrTensors, TensorOrTensors], Tensor],
                 target: TensorOrTensors) -> None:
        super().__init__()
        self.loss_fn = loss_fn
        self.target = target

    def forward(self, output: TensorOrTensors) -> Tensor:
        return self.loss_fn(output, self.target)


def rows(values: TensorOrTensors, size: int) -> TensorOrTensors:
    """The first ``size`` samples of each tensor of a batch."""
    return map_tensors(lambda x: x[:size], values)


def storage_bytes(values: TensorOrTensors) -> int:
    """The bytes of the distinct storages of a batch's tensors."""
    storages = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()
                for x in Batch(values)}
    return sum(storages.values())


def measure(module: nn.Sequential, sample: TensorOrTensors, sizes: Sequence[int],
            device: torch.device, *, repeat: int = 3, loss: Optional[LossAndTarget] = None
            ) -> Costs:
    """Measures every layer of ``module`` (and the loss) at each micro-batch size of ``sizes``.

    The layers are copied to ``device``, then, at each size, run in whole
    passes as training runs them: every layer's forward pass in order, then
    every layer's backward pass in reverse order, each layer on the detached
    output of the one before. A first pass warms up and reads the memory;
    ``repeat`` passes with ``I`` apart, and as many with ``B`` whole, are
    timed, and the median of each time kept. (A layer timed alone, again and
    again, finds its weights in the cache, which a whole pass does not:
    times measured so come out too short.) ``module`` itself is left as it
    is, and so are the random number generators.

    Args:
        module: the model
        sample: a mini-batch of the model's input, at least as large as the
            largest of ``sizes``
        sizes: micro-batch sizes, each at most the sample's batch
        device: where to run the layers
        repeat: timed passes of each kind per size
        loss: ``(loss_fn, target)``, to measure the loss of the last layer's output

    Returns:
        Costs: without overhead and transfer costs, which the planner adds
    """
    refuse_gradients(module)
    sample = to_device(sample, device)
    batch = next(x for x in Batch(sample) if isinstance(x, Tensor)).size(0)
    sizes = sorted(set(sizes))
    copies = list(layerwise_sandbox(module, device))
    tracker = SandboxSkipTracker()
    table = []
    with preserve_rng_state(device), torch.enable_grad(), use_skip_tracker(tracker):
        for size in sizes:
            layers = copies + ([] if loss is None else [_loss_at(loss, size, device)])
            inputs, costs = _first_pass(layers, rows(sample, size), tracker)
            timed: Dict[str, List[List[float]]] = {name: [] for name in TIMES}
            for _ in range(repeat):
                for split in (True, False):
                    for name, times in _timed_pass(layers, inputs, tracker, device,
                                                   split).items():
                        timed[name].append(times)
            for name, passes in timed.items():
                costs[name] = [statistics.median(times) for times in zip(*passes)]
            table.append(LayerCosts(**costs))
    parameters = [sum(p.numel() * p.element_size() for p in c.parameters()) for c in copies]
    return Costs(batch=batch, sizes=sizes, table=table, parameters=parameters,
                 entry=storage_bytes(rows(sample, 1)), loss=loss is not None)


def _loss_at(loss: LossAndTarget, size: int, device: torch.device) -> nn.Module:
    """The loss as a layer, against the first ``size`` samples of the target."""
    loss_fn, target = loss
    return Loss(loss_fn, rows(to_device(target, device), size))


def _first_pass(layers: Sequence[nn.Module], values: TensorOrTensors, tracker: SandboxSkipTracker
                ) -> Tuple[List[TensorOrTensors], Dict[str, List[float]]]:
    """Each layer's input (detached) for the timed passes, and its memory."""
    inputs: List[TensorOrTensors] = []
    kept: List[float] = []
    output: List[float] = []
    for layer in layers:
        inputs.append(values)
        result, nbytes = saved_by_forward(layer, fresh_input(values), tracker)
        kept.append(float(nbytes))
        output.append(float(storage_bytes(result)))
        values = map_tensors(detach_tensor, result)
    return inputs, {'kept': kept, 'output': output}


def _timed_pass(layers: Sequence[nn.Module], inputs: Sequence[TensorOrTensors],
                tracker: SandboxSkipTracker, device: torch.device,
                split: bool) -> Dict[str, List[float]]:
    """One pass: each layer's F in order, then each one's I (if ``split``) or B in reverse."""
    clock = _Clock(device)
    graphs: List[Tuple[List[Tensor], List[Tensor]]] = []
    forward = []
    for layer, values in zip(layers, inputs):
        x = fresh_input(values)
        clock.lap()
        y = layer(x)
        forward.append(clock.lap())
        graphs.append(([t for t in (*Batch(y), *tracker.take_stashed()) if t.requires_grad],
                       [t for t in Batch(x) if t.requires_grad]))
    backward = [0.0] * len(layers)
    for index in reversed(range(len(layers))):
        ends, starts = graphs.pop()
        clock.lap()
        if ends and split and starts:
            torch.autograd.grad(ends, starts, ends, allow_unused=True)
        elif ends and not split:
            torch.autograd.backward(ends, ends)
        backward[index] = clock.lap()
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    if split:
        return {'forward': forward, 'input': backward}
    return {'backward': backward}


class _Clock:
    """Laps of the wall clock, the device synchronized at each."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        synchronize(device)
        self.last = time.perf_counter()

    def lap(self) -> float:
        """The time since the last lap (or the start), in seconds."""
        synchronize(self.device)
        now = time.perf_counter()
        elapsed, self.last = now - self.last, now
        return elapsed

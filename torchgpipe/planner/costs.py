"""What each layer costs, measured once: the planner's input.

For each micro-batch size a plan may run, the layers run on copies of
themselves in whole training passes, and each is timed in the parts a
schedule runs apart::

    F  forward pass          y = layer(x)
    I  input gradients       dx = grad(y, x)       (what the layer before waits for)
    W  weights' gradients    once I is done, from where I left them
    B  whole backward pass   backward(y): dx and the weights' gradients at once

``I`` and ``W`` run as :mod:`torchgpipe.engine.split` runs them, and take
more than ``B`` (1.1 to 1.6 times, on CPU): ``I`` first finds, in Python,
where ``W`` will start, and ``W`` is an engine call per group of weights.
The passes are timed by :mod:`~torchgpipe.planner.timing`.

The memory comes from a pass of each layer on the detached output of the
one before (:mod:`~torchgpipe.planner.memory`), and from the bytes of the
parameters. A loss is measured as one more layer, the last's.

Sizes in between those measured are read by linear interpolation
(:meth:`Costs.at`): a layer's time grows with its micro-batch in steps, not
smoothly, but between powers of two a line is close.
"""
import copy
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from torchgpipe.balance.profile import (SandboxSkipTracker, layerwise_sandbox, preserve_rng_state,
                                        refuse_gradients, to_device)
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, map_tensors
from torchgpipe.foundation.placement import same_memory
from torchgpipe.planner.memory import Route, layer_memory, tensor_bytes
from torchgpipe.planner.timing import layer_times
from torchgpipe.skip.tracker import use_skip_tracker

__all__: List[str] = []

#: What :func:`measure` reads of each layer, at each micro-batch size: times in seconds.
TIMES = ('forward', 'input', 'backward', 'weight')
#: ... and memory in bytes.
BYTES = ('kept', 'output', 'working', 'closing', 'holding', 'unsaved', 'accumulating',
         'accumulating_last', 'retained', 'given', 'shed', 'skipped', 'loose', 'reused', 'aliased',
         'passed', 'forwarding', 'through')


@dataclass
class LayerCosts:
    """The costs of every layer at one micro-batch size, a list per quantity.

    A loss measured with the layers is the last entry of each list, but of
    ``skipped``, ``loose``, ``reused`` and ``aliased``, which have an entry per skip
    connection (``skips`` of :class:`Costs`).
    """

    forward: List[float]
    input: List[float]
    backward: List[float]
    kept: List[float]
    output: List[float]
    #: What ``W`` takes once ``I`` is done (empty in older costs: ``B`` less ``I``).
    weight: List[float] = field(default_factory=list)
    #: The most its backward pass holds beyond ``kept`` (:mod:`~torchgpipe.planner.working`).
    working: List[float] = field(default_factory=list)
    #: ... as a partition's last layer, whose output gradient the pipeline
    #: holds (empty in older costs: ``working`` serves).
    closing: List[float] = field(default_factory=list)
    #: ... in ``I``, which frees nothing the forward pass saved (empty in
    #: older costs: ``working`` serves).
    holding: List[float] = field(default_factory=list)
    #: The bytes of its output left out of ``kept`` because the next layer
    #: does not save it: a partition's last layer keeps them all the same.
    unsaved: List[float] = field(default_factory=list)
    #: The bytes of its output in ``kept`` that it does not save itself (the
    #: next layer does, or none does: the last), freed before its own
    #: backward pass (empty in older costs).
    passed: List[float] = field(default_factory=list)
    #: What its backward pass holds further when its weights' gradients
    #: accumulate (every micro-batch of a step after the first): the new
    #: gradients, until added. Empty in costs saved before it was measured.
    accumulating: List[float] = field(default_factory=list)
    #: ... as a partition's last layer, which holds its output to the end
    #: (empty in older costs: ``accumulating`` serves).
    accumulating_last: List[float] = field(default_factory=list)
    #: The temporaries of its forward pass, the most it holds at once beyond
    #: what it leaves (empty in older costs).
    forwarding: List[float] = field(default_factory=list)
    #: The bytes of its output, where the output is (or holds) its input as it
    #: is (a shortcut that stashes a projection; empty in older costs).
    through: List[float] = field(default_factory=list)
    #: What a split backward pass keeps from ``I`` to ``W`` (empty in older costs).
    retained: List[float] = field(default_factory=list)
    #: ... of those, the output's gradient itself, as the layer was given it
    #: (its last node leads to a weight: a linear layer's; empty in older costs).
    given: List[float] = field(default_factory=list)
    #: The bytes of ``kept`` that ``I`` lets go of where the layer is the last with
    #: weights of its partition: what the nodes above where ``W`` starts saved
    #: (a ReLU's output, after a convolution; empty in older costs).
    shed: List[float] = field(default_factory=list)
    #: The bytes of each skip (``skips`` of :class:`Costs`; empty in older costs).
    skipped: List[float] = field(default_factory=list)
    #: ... of those only the skip keeps on its stashing layer, left out of
    #: ``kept``: freed at its pop, or held until the backward pass if a
    #: later partition pops it.
    loose: List[float] = field(default_factory=list)
    #: ... of those the popping layer saves for its backward pass, counted
    #: in its ``kept``.
    reused: List[float] = field(default_factory=list)
    #: ... of those whose gradient the popping layer's backward pass gives
    #: as its output's gradient itself (an addition's): one tensor until the
    #: layer before the pop is done (empty in older costs).
    aliased: List[float] = field(default_factory=list)


@dataclass
class Costs:
    """Measured costs of a model's layers, at several micro-batch sizes.

    Args:
        batch: the size of the mini-batch the model trains on (the sample's)
        sizes: the micro-batch sizes measured, ascending
        table: for each size (in the order of ``sizes``), the layers' costs
        parameters: the bytes of each layer's parameters
        entry: the bytes of one sample of the model's input that the first
            partition holds of its own: none where the input lies in the first
            device's memory (each micro-batch a view of the caller's batch, as
            a given target is, ``Loss``), a copy's otherwise
        loss: whether the last entry of each list of ``table`` is a loss
        overhead: the time the pipeline adds to each task, in seconds
        checkpoint_overhead: what it adds further to a checkpointed ``B`` or ``I``
            (after the wait for the gradient, where the calibration's steps
            put it: on the step's longest path)
        split_overhead: what it adds to an ``I`` or a ``W``, instead of ``overhead``
        transfer: a message's latency in seconds and its time per byte,
            between two workers (zero within one memory)
        skip_overhead: what a skip's message between two processes adds beside the
            latency and the bytes' time of ``transfer``, in seconds: a message of
            its own, after the task's own (whose cost ``overhead`` holds), each way
            (its gradient's too)
        pace: the factor each size's times carry from a pilot of the pipeline
        shared: each parameter that more than one layer holds (a tied
            embedding and head): the layers, and its bytes (counted in each
            layer's ``parameters``, once on a device that holds several)
        processes: whether the workers are processes, which sum the gradients
            of a weight they share by messages as a step ends
        skips: the route of each skip connection, ``(a, b)``: layer ``a``
            stashes it, layer ``b`` pops it (the bytes are ``skipped`` of
            :class:`LayerCosts`)
        cores: when the workers are processes of one machine that outnumber
            its cores, how many of them can be at work at full speed at once
            (its cores over each one's threads): they share the cores
            (:mod:`~torchgpipe.engine.simulator`). ``None``: a core each.
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
    #: For workers of CPU devices (threads or processes), the factor each
    #: size's times were scaled by (see :mod:`~torchgpipe.planner.pilot`);
    #: else empty.
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
        data['skips'] = [(a, b) for a, b in data.get('skips', [])]
        return cls(**data)


def _combine(a: LayerCosts, b: LayerCosts, wa: float, wb: float) -> LayerCosts:
    """``wa a + wb b``, quantity by quantity and layer by layer."""
    mixed = {name: [wa * x + wb * y for x, y in zip(getattr(a, name), getattr(b, name))]
             for name in TIMES + BYTES}
    return LayerCosts(**mixed)


#: A loss function and its target.
LossAndTarget = Tuple[LossFunction, TensorOrTensors]


class Loss(nn.Module):
    """A loss as a layer: ``loss_fn(output, target)`` of the output before it.

    ``given``: whether the target is the user's, in the loss's memory (each
    micro-batch of it a view, there before the step): what the loss saves of
    it is then no memory of the pass, and as buffers, its tensors are left
    out by kept_by_forward. Otherwise, the pipeline copies each micro-batch
    of it to the last device, and the copies count.
    """

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
    """Measures every layer of ``module`` (and the loss) at each micro-batch size of ``sizes``.

    The layers are copied to ``device`` (all of them: the model must fit
    there, with the graph of a pass at the largest size), then, at each
    size, run in whole passes as training runs them: every layer's forward
    pass in order, then one backward pass, timed at each layer's boundary.
    A first pass, of each layer on the detached output of the one before,
    reads the memory. Then, in rounds that visit every size in turn, a pass
    split in ``I`` and ``W`` and one with ``B`` whole: the first round warms up, the
    next ``repeat`` are timed, and the least of each time is kept: a pass
    that the operating system interrupts for another process takes longer,
    never shorter, and by a slice of milliseconds. (What slows every round
    alike stays in; on CPU workers, the pilot's pace carries the rest. A
    layer timed alone, again and again, finds its weights in the cache,
    which a whole pass does not: times so measured come out too short.)
    ``module`` and the random number generators are left as they were.

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
        timed: List[Dict[str, List[List[float]]]] = [{} for _ in sizes]
        # The rounds visit every size in turn, the first to warm up: a slow
        # spell of the machine then falls on one round of each size, which
        # the least leaves out, rather than on every round of one size,
        # which would skew every configuration of that size.
        for turn in range(repeat + 1):
            for size, (tail, _), into in zip(sizes, prepared, timed):
                for split in (True, False):
                    laps = layer_times(copies + tail, rows(sample, size), device, split)
                    for name, values in laps.items():
                        if turn:
                            into.setdefault(name, []).append(values)
    table = []
    for (_, costs), passes in zip(prepared, timed):
        for name, rounds in passes.items():
            costs[name] = [min(layer) for layer in zip(*rounds)]
        costs['weight'] = _shared(costs['weight'][0], int(costs.pop('cut')[0]),
                                  costs['backward'], costs['input'])
        table.append(LayerCosts(**costs))
    parameters = [sum(p.numel() * p.element_size() for p in c.parameters()) for c in copies]
    return Costs(batch=batch, sizes=sizes, table=table, parameters=parameters,
                 shared=shared_parameters(module), skips=routes,
                 entry=0.0 if given else tensor_bytes(rows(sample, 1)), loss=loss is not None)


def _shared(weight: float, cut: int, backward: Sequence[float], input: Sequence[float]
            ) -> List[float]:
    """Each layer's part of ``W``'s time, ``weight``, taken after the first ``cut`` layers:
    theirs is their whole backward pass (the first partition's ``W`` is its whole
    pass); the others share it as what their ``B`` does beyond their ``I`` (evenly,
    if none does)."""
    beyond = [max(0.0, b - i) for b, i in zip(backward[cut:], input[cut:])]
    whole = sum(beyond)
    return [*backward[:cut], *[weight * t / whole if whole else weight / len(beyond)
                               for t in beyond]]


def shared_parameters(module: nn.Sequential) -> List[Tuple[List[int], int]]:
    """Each parameter that more than one layer of ``module`` holds: those layers, and
    its bytes."""
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


class TrainingThreads:
    """Threads training copies of the layers while the layers are timed, as other workers do.

    Processes of a pipeline on one machine share its cores and its memory's
    bandwidth: a layer whose pipeline keeps the other ranks busy takes
    longer than it does alone. Ranks that do not time the layers train
    copies of them on ``sample`` in ``count`` threads meanwhile (as many
    as leave the timing rank a core of its own:
    :meth:`~torchgpipe.planner.group.PlanningGroup.loaders`), so
    that the layers take about what they take in a busy pipeline (the
    pilot, :mod:`~torchgpipe.planner.pilot`, corrects the rest).

    A thread that fails stops quietly: its only use was the load it made.
    """

    def __init__(self, count: int, layers: Sequence[nn.Module], sample: TensorOrTensors,
                 device: torch.device) -> None:
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._train, args=(copy.deepcopy(list(layers)),
                                                                   sample, device),
                                         name='torchgpipe planner load', daemon=True)
                        for _ in range(count)]

    def _train(self, layers: List[nn.Module], sample: TensorOrTensors,
               device: torch.device) -> None:
        try:
            with torch.enable_grad():
                while not self.stop.is_set():
                    layer_times(layers, sample, device, split=False)
        except Exception:  # noqa: BLE001 (a load only; the timed passes go on alone)
            return

    def __enter__(self) -> 'TrainingThreads':
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join()

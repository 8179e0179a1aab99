"""The layer timer of the planner and of :func:`~torchgpipe.balance.balance_by_time`: each
layer's part of a training pass.

:func:`layer_times` times a pass as training runs it, layer after layer,
the backward pass one engine call (``B``) or the two halves ``I`` and ``W``
of :mod:`torchgpipe.engine.split` (a layer timed alone again and again finds
its weights in the cache, and comes out short): the planner's. It holds the
whole model and a pass's activations on the device.
:func:`layer_times_apart` runs each layer's backward pass right after its
forward pass, a layer's copy on the device at a time, as balancing a model
larger than the device needs: :func:`~torchgpipe.balance.balance_by_time`'s,
as in torchgpipe 0.0.7.
"""
import functools
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from torchgpipe.balance.sandbox import (SandboxSkipTracker, detach_tensor, fresh_input,
                                        synchronize)
from torchgpipe.engine.split import children, input_pass
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, check, map_tensors
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.tracker import SkipTracker, use_skip_tracker

__all__: List[str] = []


@dataclass
class PassTimes:
    """A timed training pass, in seconds: each layer's ``F``, and its ``B``, or (a split
    pass) its ``I`` with ``W``'s whole time and ``cut``, the layers before the first
    whose output needs a gradient (their ``W`` is their whole backward pass)."""

    forward: List[float]
    backward: List[float] = field(default_factory=list)
    input: List[float] = field(default_factory=list)
    weight: float = 0.0
    cut: int = 0


def layer_times(layers: Sequence[nn.Module], sample: TensorOrTensors, device: torch.device,
                split: bool) -> PassTimes:
    """One training pass of the whole model, each layer's part of it timed at its boundaries.

    The forward pass is timed between layer calls; the backward pass is one
    call, a hook on each layer's output noting when its gradient is ready.
    ``split`` runs ``I`` then ``W`` instead of ``B``::

        forward:   x --[0]--> y0 --[1]--> y1 --[2]--> y2 (the loss, or the output)
        backward:  stamps at y2 (start), y1, y0, and the end:
                   layer 2 took y1 - y2, layer 1 y0 - y1, layer 0 end - y0

    Work a layer does for its stashed skips alone runs among later layers and
    is moved back to it (``_SkipWork``). What ``I`` does before its engine
    starts is shared among the layers as their ``I`` times are; ``W`` comes
    whole, for :func:`~torchgpipe.planner.costs.measure` to share.
    """
    clock = _Clock(device)
    forward: List[float] = []
    outputs: List[List[Tensor]] = []
    values = fresh_input(sample)
    skips = _SkipWork(device)
    with use_skip_tracker(skips):
        for layer in layers:
            since = _next_sequence_nr()
            clock.lap()
            values = layer(values)
            forward.append(clock.lap())
            if split and not any(outputs) and len(outputs) < len(layers) - 1:
                # I stops at the first output that needs a gradient, as at a partition's input.
                values = map_tensors(detach_tensor, values)
            outputs.append([y for y in Batch(values) if y.requires_grad])
            skips.made(len(outputs) - 1, since, outputs[-1])
    stamps = [0.0] * len(layers)
    ends = outputs[-1]
    # (Each end's too, in a split pass: when the engine starts.)
    hooks = [y.register_hook(functools.partial(_stamp, stamps, k, device))  # type: ignore
             for k, ys in enumerate(outputs if split else outputs[:-1]) for y in ys]
    hooks += skips.hooks()
    first = next((k for k, ys in enumerate(outputs[:-1]) if ys), None)
    weight = 0.0
    start = stamps[-1] = time.perf_counter()
    if split and first is not None:
        grads = [None if y.dim() == 0 else y for y in ends]
        weights = input_pass(ends, grads, outputs[first])
        synchronize(device)
        end = time.perf_counter()
        for hook in hooks:  # W's engine passes go through the outputs again
            hook.remove()
        weights.run()
        synchronize(device)
        weight = time.perf_counter() - end
    elif not split and ends:
        torch.autograd.backward(ends, ends)
        synchronize(device)
        end = time.perf_counter()
    else:
        end = start
    # Layer k's backward ran from stamps[k] to stamps[k - 1] (or the end); an
    # output whose gradient never came takes the next one's stamp.
    for hook in hooks:  # (each node's hook refers to the node: let the graph go)
        hook.remove()
    for k in range(len(layers) - 2, -1, -1):
        stamps[k] = stamps[k] or stamps[k + 1]
    times = [max(0.0, (stamps[k - 1] if k else end) - stamps[k]) for k in range(len(layers))]
    skips.move(times, stamps, end)
    for layer in layers:
        for p in layer.parameters():
            p.grad = None
    if not split:
        return PassTimes(forward, backward=times)
    for k in range((first or 0) + 1):
        times[k] = 0.0
    ahead, total = stamps[-1] - start, sum(times)
    return PassTimes(forward, input=[t + ahead * t / total if total else t for t in times],
                     weight=weight, cut=(first or 0) + 1)


def layer_times_apart(layers: Iterable[nn.Module], sample: TensorOrTensors,
                      device: torch.device) -> PassTimes:
    """Each layer's ``F`` and ``B``, its backward pass run right after its forward pass, on
    the detached output of the layer before (a pop on a detached copy of its skip, a
    stash's gradient coming with the layer's own): the layers may come one at a time
    (:func:`~torchgpipe.balance.sandbox.layerwise_sandbox`)."""
    clock = _Clock(device)
    times = PassTimes([], backward=[])
    tracker = SandboxSkipTracker()
    values = sample
    with use_skip_tracker(tracker):
        for index, layer in enumerate(layers):
            values = fresh_input(values)
            clock.lap()
            output = layer(values)
            times.forward.append(clock.lap())
            check(output, f'the output of layer {index}')
            ends = [y for y in (*Batch(output), *tracker.take_stashed()) if y.requires_grad]
            if ends:
                # Any gradient of the right shape will do: no allocation.
                torch.autograd.backward(ends, ends)
            times.backward.append(clock.lap())
            values = output
    return times


def _next_sequence_nr() -> int:
    """The sequence number of the next autograd node made in this thread."""
    probe = torch.zeros((), requires_grad=True).mul(1)
    return int(probe.grad_fn._sequence_nr()) + 1  # type: ignore[union-attr]


class _SkipWork(SkipTracker):
    """A skip tracker that times the work a layer does for its stashed skips alone.

    A shortcut stashing ``conv(x)`` and passing ``x`` on has no boundary of its
    own for ``conv``, whose backward runs when the pop's gradient reaches it,
    after every node made later::

        stamps:   layer 12 starts ........ layer 10 starts
        engine:   | 12's nodes | conv (11's) | 10's nodes ...
        without:  layer 12 took both, layer 11 nothing

    Hooks time the nodes a layer made that its skips reach and its outputs do
    not, and their time moves to that layer.
    """

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.stashed: List[Tensor] = []
        self.nodes: Dict[Node, int] = {}  # each node timed, and its layer
        self.spans: List[Tuple[int, float, float]] = []  # layer, start, end

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        super().save(batch, ns, name, tensor)
        if tensor is not None and tensor.requires_grad:
            self.stashed.append(tensor)

    def made(self, k: int, first: int, outputs: List[Tensor]) -> None:
        """Notes the nodes layer ``k`` (from sequence number ``first``) made for its skips."""
        own = _made_since(first, [t.grad_fn for t in self.stashed])
        own -= _made_since(first, [y.grad_fn for y in outputs])
        self.nodes.update((node, k) for node in own)
        self.stashed = []

    def hooks(self) -> List[RemovableHandle]:
        """Hooks that time each node noted, when it runs."""
        starts: Dict[Node, float] = {}

        def enter(node: Node, *_: object) -> None:
            synchronize(self.device)
            starts[node] = time.perf_counter()

        def leave(node: Node, *_: object) -> None:
            synchronize(self.device)
            self.spans.append((self.nodes[node], starts.pop(node), time.perf_counter()))
        return [handle for node in self.nodes
                for handle in (node.register_prehook(functools.partial(enter, node)),
                               node.register_hook(functools.partial(leave, node)))]

    def move(self, times: List[float], stamps: List[float], end: float) -> None:
        """Moves each timed node's time from the layer it ran among to its own."""
        for k, start, stop in self.spans:
            among = next((j for j in range(len(times))
                          if stamps[j] <= start < (stamps[j - 1] if j else end)), k)
            if among != k:
                moved = min(stop - start, times[among])
                times[among] -= moved
                times[k] += moved


def _made_since(first: int, roots: Sequence[Optional[Node]]) -> Set[Node]:
    """The nodes under ``roots`` made from sequence number ``first`` on (no accumulators)."""
    seen: Set[Node] = set()
    stack = [node for node in roots if node is not None]
    while stack:
        node = stack.pop()
        if node in seen or hasattr(node, 'variable') or node._sequence_nr() < first:
            continue
        seen.add(node)
        stack.extend(children(node))
    return seen


def _stamp(stamps: List[float], k: int, device: torch.device, grad: Tensor) -> None:
    """Notes when the gradient of layer ``k``'s output is ready (its last tensor's)."""
    synchronize(device)
    stamps[k] = max(stamps[k], time.perf_counter())


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

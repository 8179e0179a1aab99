"""A training pass of the whole model, each layer's part of it timed: what
:func:`~torchgpipe.planner.costs.measure` reads the layers' times from.

The times are those of a pass as training runs it, layer after layer, not
of each layer alone again and again (which finds its weights in the cache,
and comes out too short); the backward pass is one call of the engine
(``B``), or the two halves of a split one (``I``, then ``W``), as the
engine of :mod:`torchgpipe.engine.split` runs them.
"""
import functools
import time
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import Node
from torch.utils.hooks import RemovableHandle

from torchgpipe.balance.profile import detach_tensor, fresh_input, synchronize
from torchgpipe.engine.split import children, input_pass
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, map_tensors
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.tracker import SkipTracker, use_skip_tracker

__all__: List[str] = []


def layer_times(layers: Sequence[nn.Module], sample: TensorOrTensors, device: torch.device,
                split: bool) -> Dict[str, List[float]]:
    """One training pass of the whole model, each layer's part of it timed at its boundaries.

    The forward pass is timed between layer calls. The backward pass is one
    call, as in training (a call per layer would add the engine's start to
    every layer): a hook on each layer's output notes when its gradient is
    ready, which is when the layers after it are done. ``split`` runs the
    backward pass as a split one does (:mod:`torchgpipe.engine.split`): ``I``
    from the first layer's output back (the first layer's own input gradient
    reaches no partition before it), then ``W``, instead of ``B``::

        forward:   x --[0]--> y0 --[1]--> y1 --[2]--> y2 (the loss, or the output)
        backward:  stamps at y2 (start), y1, y0, and the end:
                   layer 2 took y1 - y2, layer 1 y0 - y1, layer 0 end - y0

    A layer that stashes a skip made by its own work (a shortcut's
    projection) and passes its input on has no boundary of its own for that
    work, which the engine runs later, among the layers after it: its
    nodes are timed one by one, and their time moved to the layer
    (``_SkipWork``), whose partition runs them in a pipeline.

    What ``I`` does before its engine starts (finding where ``W`` will start,
    in Python, for each node of the graph) is shared among the layers as
    their ``I`` times are; ``W``'s time comes whole (``weight``, one entry),
    with the number of layers before the cut (``cut``, one entry), whose
    weights' gradients it leaves out: :func:`~torchgpipe.planner.costs.measure`
    shares it among the others as what ``B`` does beyond ``I``.
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
                # I stops at the first output that needs a gradient (what no
                # output before it needs, a Flatten, integer preprocessing, has
                # no I), as a partition's at its input: a leaf.
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
    # Layer k's backward ran from its output's gradient (stamps[k]) to its
    # input's (stamps[k - 1], or the end for the first layer). An output
    # whose gradient never came (nothing needed it) takes the stamp of the
    # one after it: the layer after it then took no time of its own.
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
        return {'backward': times}
    for k in range((first or 0) + 1):
        times[k] = 0.0
    ahead, total = stamps[-1] - start, sum(times)
    return {'forward': forward, 'weight': [weight], 'cut': [float((first or 0) + 1)],
            'input': [t + ahead * t / total if total else t for t in times]}


def _next_sequence_nr() -> int:
    """The sequence number of the next autograd node made in this thread: nodes made
    later have larger ones."""
    probe = torch.zeros((), requires_grad=True).mul(1)
    return int(probe.grad_fn._sequence_nr()) + 1  # type: ignore[union-attr]


class _SkipWork(SkipTracker):
    """A skip tracker that times the work a layer does for its stashed skips alone.

    Take a shortcut that stashes ``conv(x)`` and passes ``x`` on: its output
    is its input, so its boundary stamp is the layer's before it, and the
    engine runs ``conv``'s backward when the pop's gradient reaches it,
    after every node made later (the layers between, by the engine's order
    of sequence numbers)::

        stamps:   layer 12 starts ........ layer 10 starts
        engine:   | 12's nodes | conv (11's) | 10's nodes ...
        without:  layer 12 took both, layer 11 nothing

    The nodes a layer made (sequence numbers from its first) that its
    skips reach and its outputs do not are timed by hooks, and their time
    moved from the layer they ran among to the layer that made them.
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
        """Moves each timed node's time (``times[k]``: from ``stamps[k]`` to
        ``stamps[k - 1]``, or ``end``) from the layer it ran among to its own."""
        for k, start, stop in self.spans:
            among = next((j for j in range(len(times))
                          if stamps[j] <= start < (stamps[j - 1] if j else end)), k)
            if among != k:
                moved = min(stop - start, times[among])
                times[among] -= moved
                times[k] += moved


def _made_since(first: int, roots: Sequence[Optional[Node]]) -> Set[Node]:
    """The nodes under ``roots`` made from sequence number ``first`` on (not the
    parameters' accumulators, which have none)."""
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

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
from typing import Dict, List, Sequence

import torch
from torch import Tensor, nn

from torchgpipe.balance.profile import detach_tensor, fresh_input, synchronize
from torchgpipe.engine.split import input_pass
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, map_tensors
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
    with use_skip_tracker(SkipTracker()):
        for layer in layers:
            clock.lap()
            values = layer(values)
            forward.append(clock.lap())
            if split and not any(outputs) and len(outputs) < len(layers) - 1:
                # I stops at the first output that needs a gradient (what no
                # output before it needs, a Flatten, integer preprocessing, has
                # no I), as a partition's at its input: a leaf.
                values = map_tensors(detach_tensor, values)
            outputs.append([y for y in Batch(values) if y.requires_grad])
    stamps = [0.0] * len(layers)
    ends = outputs[-1]
    # (Each end's too, in a split pass: when the engine starts.)
    hooks = [y.register_hook(functools.partial(_stamp, stamps, k, device))  # type: ignore
             for k, ys in enumerate(outputs if split else outputs[:-1]) for y in ys]
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
    for k in range(len(layers) - 2, -1, -1):
        stamps[k] = stamps[k] or stamps[k + 1]
    times = [max(0.0, (stamps[k - 1] if k else end) - stamps[k]) for k in range(len(layers))]
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

"""Each layer's memory, read in one pass: the bytes :func:`~torchgpipe.planner.costs.measure`
gives the planner.

Each layer runs on the detached output of the one before, so its share is
its own (:func:`~torchgpipe.balance.profile.kept_by_forward`,
:mod:`~torchgpipe.balance.working`). A skip is measured at both ends::

    layer a  stash(s) ──────── s ────────► layer b  pop(s)
             backward  ◄─── grad s ───────          backward

``a``'s backward takes the gradient of ``s`` as in training; the route, the
bytes of ``s``, those only the skip keeps (*loose*), and whether ``b`` gives
``s`` its output's gradient itself (*aliased*) let the planner count each
tensor once.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch import Tensor, nn

from torchgpipe.balance.profile import kept_by_forward
from torchgpipe.balance.sandbox import SandboxSkipTracker, detach_tensor, fresh_input
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, map_tensors
from torchgpipe.balance.working import (forward_memory, input_memory, retained_for_weights,
                                         working_memory)
from torchgpipe.skip.namespace import Namespace

__all__: List[str] = []

#: A skip's route: the layer that stashes it and the layer that pops it.
Route = Tuple[int, int]

#: A skip as a tracker keeps it.
SkipKey = Tuple[Namespace, str]

#: What a tracker holds no tensor under.
_NOTHING = object()


def tensor_bytes(values: TensorOrTensors) -> int:
    """The bytes of a batch's tensors, each once (a view counts what it shows)."""
    seen = {(x.data_ptr(), x.numel(), x.element_size()) for x in Batch(values)
            if isinstance(x, Tensor)}
    return sum(numel * size for _, numel, size in seen)


@dataclass
class LayerBytes:
    """The bytes of every layer at one micro-batch size, a list per quantity.

    A measured loss is the last entry of each list, but of ``skipped``,
    ``loose``, ``reused`` and ``aliased``, which have an entry per skip.
    """

    #: What its forward pass saved for its backward pass, and its output if the next saves it.
    kept: List[float] = field(default_factory=list)
    #: Its output.
    output: List[float] = field(default_factory=list)
    #: The most its backward pass holds beyond ``kept`` (:mod:`~torchgpipe.balance.working`).
    working: List[float] = field(default_factory=list)
    #: ... as a partition's last layer, whose output gradient the pipeline holds.
    closing: List[float] = field(default_factory=list)
    #: ... in ``I``, which frees nothing the forward pass saved.
    holding: List[float] = field(default_factory=list)
    #: The bytes of its output left out of ``kept`` as the next layer does not save them.
    unsaved: List[float] = field(default_factory=list)
    #: The bytes of its output in ``kept`` it does not save itself, freed before its backward.
    passed: List[float] = field(default_factory=list)
    #: What its backward pass holds further when its weights' gradients accumulate.
    accumulating: List[float] = field(default_factory=list)
    #: ... as a partition's last layer, which holds its output to the end.
    accumulating_last: List[float] = field(default_factory=list)
    #: The most its forward pass holds at once beyond what it leaves.
    forwarding: List[float] = field(default_factory=list)
    #: The bytes of its output where the output is (or holds) its input itself.
    through: List[float] = field(default_factory=list)
    #: What a split backward pass keeps from ``I`` to ``W``.
    retained: List[float] = field(default_factory=list)
    #: ... of those, the output's gradient itself (a linear layer's).
    given: List[float] = field(default_factory=list)
    #: The bytes of ``kept`` that ``I`` frees as its partition's last layer with
    #: weights: what the nodes above where ``W`` starts saved.
    shed: List[float] = field(default_factory=list)
    #: The bytes of each skip (``skips`` of :class:`~torchgpipe.planner.costs.Costs`).
    skipped: List[float] = field(default_factory=list)
    #: ... of those only the skip keeps, left out of ``kept``.
    loose: List[float] = field(default_factory=list)
    #: ... of those the popping layer saves, counted in its ``kept``.
    reused: List[float] = field(default_factory=list)
    #: ... of those whose gradient is the pop's output gradient itself (an addition's).
    aliased: List[float] = field(default_factory=list)


def layer_memory(layers: Sequence[nn.Module], values: TensorOrTensors,
                 tracker: SandboxSkipTracker, loss: bool = False
                 ) -> Tuple[LayerBytes, List[Route]]:
    """Each layer's memory, each on the detached output of the layer before; a warm-up too.

    An output is counted in ``kept`` only if the next layer saves it, else in
    ``unsaved`` (the pipeline holds a partition's output all the same). With
    ``loss``, the last layer is a loss.

    Returns:
        the bytes (``skipped`` in the order of the routes), and each skip's route
    """
    measured = LayerBytes()
    saves_input: List[bool] = []
    passes: List[bool] = []  # whether each layer's output is its input
    skips = _Skips()
    for k, layer in enumerate(layers):
        storages: List[Tuple[Dict[int, int], Set[int], Set[int], Set[int]]] = []

        def forward(x: TensorOrTensors, layer: nn.Module = layer
                    ) -> Tuple[TensorOrTensors, List[Tensor]]:
            result, held, saved, stashed = kept_by_forward(layer, x, tracker)
            inputs = {y.untyped_storage().data_ptr() for y in Batch(x)}
            storages.append((held, saved, inputs,
                             {y.untyped_storage().data_ptr() for y in Batch(result)}))
            return result, stashed
        # Accumulating or not, last of a partition or not; pops get their skips back.
        waiting = dict(tracker.tensors)
        peaks = {}
        to_loss = loss and k == len(layers) - 2  # (its output the loss's, which the pipeline holds)
        for accumulating, last in ((True, False), (True, True), (False, True)):
            peaks[accumulating, last] = working_memory(
                layer, fresh_input(values), forward, accumulating=accumulating, last=last,
                held=to_loss)[1]
            _restore(tracker, waiting)
        popped = [x for x in waiting.values() if isinstance(x, Tensor)]
        retained, given, freed = retained_for_weights(layer, values, forward, popped)
        measured.retained.append(float(retained))
        measured.given.append(float(given))
        held, saved = storages[-1][:2]
        measured.shed.append(float(sum(n for ptr, n in held.items()
                                          if ptr in saved and ptr in freed)))
        _restore(tracker, waiting)
        measured.holding.append(float(input_memory(layer, values, forward, popped)))
        _restore(tracker, waiting)
        measured.forwarding.append(float(_temporaries(
            forward_memory(layer, fresh_input(values), forward), tracker, waiting,
            storages[-1][0])))
        _restore(tracker, waiting)
        result, most = working_memory(layer, fresh_input(values), forward, held=to_loss)
        # (The storages of the output itself: working_memory hands back a copy.)
        held, saved, inputs, outputs = storages[-1]
        if loss and k == len(layers) - 1:
            held = {ptr: n for ptr, n in held.items() if ptr in saved or ptr not in outputs}
        loose = skips.note(k, waiting, tracker, {
            ptr: n for ptr, n in held.items() if ptr not in saved and ptr not in outputs}, saved,
            lambda: _aliased(layer, values, tracker, waiting))
        measured.kept.append(float(sum(held.values()) - loose))
        measured.unsaved.append(float(sum(n for ptr, n in held.items()
                                             if ptr in outputs and ptr not in saved)))
        saves_input.append(bool(inputs & saved))
        passes.append(bool(inputs & outputs))
        measured.output.append(float(tensor_bytes(result)))
        measured.through.append(measured.output[-1] if passes[-1] else 0.0)
        measured.working.append(float(most))
        measured.closing.append(float(peaks[False, True]))
        # (Within a partition the layer frees its output as it goes, and the
        # new gradients may come after its peak; as the last, it does not.)
        measured.accumulating.append(float(max(0, peaks[True, False] - most)))
        measured.accumulating_last.append(float(max(0, peaks[True, True] - peaks[False, True])))
        values = map_tensors(detach_tensor, result)
    _hand_on(measured, passes, saves_input)
    measured.skipped, measured.loose = skips.skipped, skips.loose
    measured.reused, measured.aliased = skips.reused, skips.aliased
    return measured, skips.routes


def _hand_on(measured: LayerBytes, passes: List[bool], saves_input: List[bool]) -> None:
    """Settles in ``measured`` where each layer's output it does not save is counted
    (``kept``, ``unsaved``, ``passed``), from which layers return their input (``passes``)
    and which save it (``saves_input``)."""
    kept, unsaved = measured.kept, measured.unsaved
    for k in range(len(passes)):
        # Layers returning their input as it is (a stash, an identity) hand it on.
        later = k + 1
        while later < len(passes) and passes[later] and not saves_input[later]:
            later += 1
        if later < len(passes) and not saves_input[later]:
            kept[k] -= unsaved[k]
            measured.passed.append(0.0)
        else:
            # Freed by the next layer's backward pass, if that layer saves it.
            measured.passed.append(unsaved[k] if later == k + 1 else 0.0)
            unsaved[k] = 0.0


class _Skips:
    """The skips of a pass, followed from the tracker as each layer stashes and pops."""

    def __init__(self) -> None:
        #: The layer that stashed each skip waiting, and its loose bytes, by key.
        self.waiting: Dict[SkipKey, Tuple[int, float]] = {}
        #: Each skip popped: its route, bytes, loose bytes, bytes the pop saved,
        self.routes: List[Route] = []
        self.skipped: List[float] = []
        self.loose: List[float] = []
        self.reused: List[float] = []
        #: ... and bytes of its gradient that are the pop's output gradient itself.
        self.aliased: List[float] = []

    def note(self, k: int, before: Dict[SkipKey, Optional[Tensor]],
             tracker: SandboxSkipTracker, loose: Dict[int, int], saved: Set[int],
             aliased: Callable[[], Set[SkipKey]]) -> float:
        """Notes what layer ``k`` popped and stashed, from the tracker's skips ``before`` its
        pass and after; returns the bytes of ``loose`` storages (neither ``saved`` nor
        outputs) it stashed. ``aliased()`` is asked only once the layer pops."""
        after = dict(tracker.tensors)
        popped = [key for key, x in before.items()
                  if after.get(key, _NOTHING) is not x and key in self.waiting]
        alike: Set[SkipKey] = set()
        if popped:
            alike = aliased()  # a pass of the layer again: the tracker as it was after
            tracker.tensors.clear()
            tracker.tensors.update(after)
        for key in popped:
            x = before[key]
            stasher, alone = self.waiting.pop(key)
            self.routes.append((stasher, k))
            self.skipped.append(float(tensor_bytes(x) if x is not None else 0))
            self.loose.append(alone)
            address, size = tracker.popped.pop(key, (0, 0))
            self.reused.append(float(size) if address in saved else 0.0)
            self.aliased.append(self.skipped[-1] if key in alike else 0.0)
        total = 0.0
        for key, x in after.items():
            if before.get(key, _NOTHING) is x:
                continue
            # (A storage stashed twice is counted once.)
            nbytes = float(loose.pop(x.untyped_storage().data_ptr(), 0)) if x is not None else 0.0
            self.waiting[key] = (k, nbytes)
            total += nbytes
        return total


def _aliased(layer: nn.Module, values: TensorOrTensors, tracker: SandboxSkipTracker,
             waiting: Dict[SkipKey, Optional[Tensor]]) -> Set[SkipKey]:
    """The skips ``layer`` pops whose gradient is its output's gradient itself (an
    addition's), from a pass of its own, its memory not measured."""
    _restore(tracker, waiting)
    popped = dict(tracker.popped)
    tracker.gradients = {}
    given: List[Tensor] = []
    try:
        output = layer(fresh_input(values))
        tracker.take_stashed()
        ends = [y for y in Batch(output) if isinstance(y, Tensor) and y.requires_grad]
        for y in ends:
            y.register_hook(given.append)  # type: ignore[no-untyped-call]
        if ends:
            torch.autograd.backward(ends, [torch.ones_like(y) for y in ends])
        return {key for key, grad in tracker.gradients.items()
                if any(_same(grad, g) for g in given)}
    finally:
        tracker.gradients = None
        tracker.popped.clear()
        tracker.popped.update(popped)
        for p in layer.parameters():
            p.grad = None


def _same(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors are one: the same elements of the same storage."""
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (b.data_ptr(), b.shape, b.stride(),
                                                            b.dtype)


def _temporaries(made: int, tracker: SandboxSkipTracker, waiting: Dict[SkipKey, Optional[Tensor]],
                 left: Dict[int, int]) -> int:
    """A forward pass's temporaries, ``made``, less the copies of the skips it popped and
    did not keep (a pipeline pops the tensor itself, or counts a copy as received)."""
    copies = sum(nbytes for key, (ptr, nbytes) in tracker.popped.items()
                 if key in waiting and key not in tracker.tensors and ptr not in left)
    return max(0, made - copies)


def _restore(tracker: SandboxSkipTracker, waiting: Dict[SkipKey, Optional[Tensor]]) -> None:
    """Puts back the skips that waited before a layer's pass (its pops took some)."""
    tracker.tensors.clear()
    tracker.tensors.update(waiting)

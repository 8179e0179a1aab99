"""Skip trackers: where stashed skip tensors wait for their pops.

A plain :class:`SkipTracker` per thread outside GPipe; inside it, a
:class:`SkipTrackerAcross` per micro-batch hands skips crossing partitions
to its engine (portals in the forward path: :class:`SkipTrackerThroughPortals`,
0.0.7's ``SkipTrackerThroughPotals``).
"""
import abc
import threading
from typing import ContextManager, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from torchgpipe.foundation.dependency import fork, join
from torchgpipe.foundation.microbatch import Batch
from torchgpipe.foundation.phase import Setting, add_root, is_checkpointing
from torchgpipe.foundation.phony import get_phony
from torchgpipe.foundation.stream import AbstractStream
from torchgpipe.skip.layout import SkipLayout
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.portal import Portal

__all__: List[str] = []


class SkipTracker:
    """Keeps stashed skip tensors in a dictionary until they are popped: outside GPipe,
    and inside it for skips within one partition."""

    def __init__(self) -> None:
        self.tensors: Dict[Tuple[Namespace, str], Optional[Tensor]] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        """Keeps ``tensor`` under ``(ns, name)`` until its pop; ``batch`` is the stashing
        layer's output, for a subclass to tie it to."""
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        """Takes the tensor under ``(ns, name)`` out for its pop; ``batch`` is the popping
        layer's input, for a subclass to tie it to.

        Raises:
            KeyError: nothing is stashed under the key
        """
        return self.tensors.pop((ns, name))

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
             ns: Namespace, name: str) -> Optional[Tensor]:
        """Refuses with a :class:`TypeError`: only skips in portals move between devices."""
        raise TypeError('copy is not supported for non-portal skip tensors')


class SkipTrackerAcross(SkipTracker, abc.ABC):
    """The skip tracker of one micro-batch in either engine: a skip crossing partitions
    goes to :meth:`send` at its stash and comes from :meth:`receive` at its pop (a
    portal in the forward path, a message in a training step)."""

    def __init__(self, skip_layout: SkipLayout) -> None:
        super().__init__()
        self.skip_layout = skip_layout

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        if self.skip_layout.requires_copy(ns, name):
            self.send(batch, ns, name, tensor)
        else:
            super().save(batch, ns, name, tensor)

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        if self.skip_layout.requires_copy(ns, name):
            return self.receive(batch, ns, name)
        return super().load(batch, ns, name)

    @abc.abstractmethod
    def send(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        """Sends a skip stashed here to the partition that pops it."""

    @abc.abstractmethod
    def receive(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        """Gives a skip popped here, from the partition that stashed it."""


class SkipTrackerThroughPortals(SkipTrackerAcross):
    """Tracks the skip tensors of one micro-batch in the forward path: a skip that crosses
    partitions (by ``skip_layout``) goes into a :class:`~torchgpipe.skip.portal.Portal`."""

    def __init__(self, skip_layout: SkipLayout) -> None:
        super().__init__(skip_layout)
        self.portals: Dict[Tuple[Namespace, str], Portal] = {}

    def send(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        """Keeps a skip that crosses partitions in a portal.

        Raises:
            RuntimeError: the skip requires grad but ``batch`` has no
                floating point tensor to carry its gradient
        """
        portal = self.portals.get((ns, name))
        if portal is None:
            # A checkpointed micro-batch pops twice: first pass and recomputation.
            tensor_life = 2 if is_checkpointing() else 1
            portal = Portal(tensor, tensor_life)
            self.portals[(ns, name)] = portal
        # (Else the recomputation: the portal keeps the first tensor for the pops.)

        if tensor is None:
            return
        phony = portal.blue(tensor)
        if not phony.requires_grad:
            return
        # The recomputation runs the phony's backward even if no output gets a gradient.
        add_root(phony)
        # The gradient leaves the portal after everything downstream of the stash:
        # join into every output carrying a gradient (one could be dropped downstream).
        index = batch.find(lambda x: x.is_floating_point())
        if index is None:
            raise RuntimeError(f"skip tensor '{name}' requires grad, but the stashing layer's "
                               'output has no floating point tensor to carry its gradient')
        carriers = [i for i in range(index, len(batch))
                    if batch[i].is_floating_point() and batch[i].requires_grad] or [index]
        for i in carriers:
            batch[i] = join(batch[i], phony)

    def receive(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        """Takes a skip out of its portal.

        Raises:
            KeyError: nothing is stashed under the key
            RuntimeError: the portal was popped as often as it was made for, or the
                skip requires grad and ``batch`` has no floating point tensor
        """
        portal = self.portals[(ns, name)]
        # Everything before the pop waits in backward for the portal's gradient.
        phony, _ = fork_from_batch(batch, portal.requires_grad, name)
        return portal.orange(phony)

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
             ns: Namespace, name: str) -> Optional[Tensor]:
        """Copies a skip to the popping partition's device on the copy streams, forked off and
        joined back into ``batch``, so the gradient's copy back runs after that partition's
        backward; returns the copy's phony (``None`` if nothing to copy).

        Raises:
            RuntimeError: the skip requires grad but ``batch`` has no floating point tensor
        """
        # No portal: a module running the layer by dispatch() handles the skip itself.
        portal = self.portals.get((ns, name))
        if portal is None or portal.tensor is None:
            return None
        phony, index = fork_from_batch(batch, portal.requires_grad, name)
        phony = portal.copy(prev_stream, next_stream, phony)
        if index is not None:
            batch[index] = join(batch[index], phony)
        return phony


#: torchgpipe 0.0.7's (misspelled) name of :class:`SkipTrackerThroughPortals`.
SkipTrackerThroughPotals = SkipTrackerThroughPortals


def fork_from_batch(batch: Batch, requires_grad: bool, name: str) -> Tuple[Tensor, Optional[int]]:
    """Forks a phony off every floating point tensor of the batch that may carry a gradient.

    Every one, not the first alone: a gradient leaving the batch without waiting
    for the phony could reach the stash's backward before its portal is filled::

        stash ──(joined into a)──► (a, b) ─► swap ─► (b, a) ─► pop
                                                        │
        forked off b alone: a's gradient does not wait ─┘

    Returns:
        ``(phony, index)``: the phony, and the index of the first forked tensor
        (``None`` if the batch has no floating point tensor)

    Raises:
        RuntimeError: the skip requires grad, grad is enabled, and the batch
            has no floating point tensor
    """
    index = batch.find(lambda x: x.is_floating_point())
    if index is None:
        if requires_grad and torch.is_grad_enabled():
            raise RuntimeError(f"skip tensor '{name}' requires grad, but the popping "
                               'partition has no floating point tensor to carry its gradient')
        return get_phony(batch[0].device, requires_grad=False), None
    x = batch[index]
    if requires_grad and not x.requires_grad:
        x = join(x, get_phony(x.device, requires_grad=True))
    batch[index], phony = fork(x)
    # The others need to wait only if a gradient may flow through them.
    for i in range(index + 1, len(batch)):
        other = batch[i]
        if other.is_floating_point() and other.requires_grad:
            batch[i], other_phony = fork(other)
            phony = join(phony, other_phony)
    return phony, index


class ThreadLocal(threading.local):
    """Holds each thread's current tracker: worker threads run different micro-batches at once."""

    def __init__(self) -> None:
        self.skip_tracker: Optional[SkipTracker] = None


thread_local = ThreadLocal()


def use_skip_tracker(skip_tracker: SkipTracker) -> ContextManager[None]:
    """Makes ``skip_tracker`` this thread's current tracker within the context."""
    return Setting(thread_local, 'skip_tracker', skip_tracker)


def current_skip_tracker() -> SkipTracker:
    """This thread's current tracker, a plain one made on first use."""
    skip_tracker = thread_local.skip_tracker
    if skip_tracker is None:
        skip_tracker = SkipTracker()
        thread_local.skip_tracker = skip_tracker
    return skip_tracker

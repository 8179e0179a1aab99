"""Skip trackers: where stashed skip tensors wait for their pops.

Outside GPipe, a plain :class:`SkipTracker` keeps them in a dictionary, one
tracker per thread. Inside GPipe, each micro-batch has a
:class:`SkipTrackerAcross`, which keeps the skips that stay within a
partition in its dictionary too and hands those that cross partitions to its
engine: in the forward path, :class:`SkipTrackerThroughPortals` sends them
through portals (:mod:`torchgpipe.skip.portal`). torchgpipe 0.0.7 spelled that class
``SkipTrackerThroughPotals``; the old name still works.
"""
import abc
import threading
from typing import ContextManager, Dict, List, Optional, Protocol, Tuple

import torch
from torch import Tensor

from torchgpipe.foundation.dependency import fork, join
from torchgpipe.foundation.microbatch import Batch
from torchgpipe.foundation.phase import add_root, is_checkpointing
from torchgpipe.foundation.phony import get_phony
from torchgpipe.foundation.stream import AbstractStream
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.portal import Portal

__all__: List[str] = []


class SkipTracker:
    """Keeps stashed skip tensors in a dictionary until they are popped: outside GPipe,
    and inside it for skips within one partition."""

    def __init__(self) -> None:
        self.tensors: Dict[Tuple[Namespace, str], Optional[Tensor]] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        """Keeps ``tensor``, stashed under ``(ns, name)``, until its pop; a subclass may tie
        it to ``batch``, the stashing layer's output."""
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        """Takes the tensor stashed under ``(ns, name)`` out, for its pop; a subclass may tie
        it to ``batch``, the popping layer's input.

        Raises:
            KeyError: nothing is stashed under the key
        """
        return self.tensors.pop((ns, name))

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
             ns: Namespace, name: str) -> Optional[Tensor]:
        """Refuses: only skips in portals move between devices.

        Raises:
            TypeError: always
        """
        raise TypeError('copy is not supported for non-portal skip tensors')


class Routes(Protocol):
    """What the tracker asks of a :class:`~torchgpipe.skip.layout.SkipLayout`.

    A protocol, so that the tracker needs nothing of the module that finds
    the routes (it reads the skippable layers, which use this tracker).
    """

    def requires_copy(self, ns: Namespace, name: str) -> bool:
        """Whether the skip is stashed and popped in different partitions."""


class SkipTrackerAcross(SkipTracker, abc.ABC):
    """The skip tracker of one micro-batch in either engine.

    A skip stashed and popped in one partition stays in the dictionary; one that
    crosses partitions (per ``skip_layout``) goes to :meth:`send` at its stash and
    comes from :meth:`receive` at its pop. The forward path carries it in a portal
    (:class:`SkipTrackerThroughPortals`); a training step sends it as a message
    (:class:`~torchgpipe.engine.mailbox.StepSkips`).
    """

    def __init__(self, skip_layout: Routes) -> None:
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
    """Tracks the skip tensors of one micro-batch in the forward path.

    A skip that crosses partitions goes into a :class:`Portal
    <torchgpipe.skip.portal.Portal>`, which the pipeline copies to the
    popping partition's device; the others stay in the dictionary.

    Args:
        skip_layout (SkipLayout): the partitions that stash and pop each skip
            (:class:`~torchgpipe.skip.layout.SkipLayout`)
    """

    def __init__(self, skip_layout: Routes) -> None:
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
            # A checkpointed micro-batch is popped twice: in the first pass
            # and in the recomputation. (Micro-batch i is checkpointed in
            # every partition or in none.)
            tensor_life = 2 if is_checkpointing() else 1
            portal = Portal(tensor, tensor_life)
            self.portals[(ns, name)] = portal
        # else: this is the recomputation of the stash. The portal keeps the
        # first tensor for the pops; the new one, part of the recomputed
        # graph, is only where the gradient must go.

        if tensor is None:
            return
        phony = portal.blue(tensor)
        if not phony.requires_grad:
            return
        # In a recomputation, the checkpoint's backward runs the phony's even
        # if no output it is joined into gets a gradient (a pop that ignores
        # its input): the skip's gradient comes through the portal alone.
        add_root(phony)
        # The phony's backward (the gradient's exit from the portal) must
        # run after everything downstream of the stash: join it there. Into
        # every output that carries a gradient, not only the first: the
        # phony's backward runs once every joined output that the loss
        # reaches has given its gradient, and would never run if the one
        # output it hung on were dropped or detached downstream.
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
            RuntimeError: the portal's skip was already popped as often as
                it was made for, or it requires grad and ``batch`` has no
                floating point tensor to carry its gradient
        """
        portal = self.portals[(ns, name)]
        # Forked off the popping layer's input: everything before the pop
        # waits in the backward pass until the gradient is in the portal.
        phony, _ = fork_from_batch(batch, portal.requires_grad, name)
        return portal.orange(phony)

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
             ns: Namespace, name: str) -> Optional[Tensor]:
        """Moves a skip tensor to the popping partition's device, on the copy streams of
        the stashing and popping devices, before the popping partition runs. The copy is
        forked off ``batch`` and joined back into it, so the gradient's copy back runs
        after that partition's backward and before the stashing partition's.

        Returns:
            torch.Tensor or None: the copy's phony, whose backward copies the gradient
            back; ``None`` if there was nothing to copy

        Raises:
            RuntimeError: the skip requires grad but ``batch`` has no floating point
                tensor to carry its gradient
        """
        # No portal: the stash did not go through this tracker. A module
        # that runs a skippable layer by its dispatch() handles the skip
        # itself (it may pass it on in its output); a pop that needs this
        # tracker reports the missing stash when it runs.
        portal = self.portals.get((ns, name))
        if portal is None or portal.tensor is None:
            return None
        phony, index = fork_from_batch(batch, portal.requires_grad, name)
        phony = portal.copy(prev_stream, next_stream, phony)
        if index is not None:
            batch[index] = join(batch[index], phony)
        return phony


#: torchgpipe 0.0.7's (misspelled) name of :class:`SkipTrackerThroughPortals`,
#: kept for the code that imports it.
SkipTrackerThroughPotals = SkipTrackerThroughPortals


def fork_from_batch(batch: Batch, requires_grad: bool, name: str) -> Tuple[Tensor, Optional[int]]:
    """Forks a phony off every floating point tensor of the batch that may carry a gradient.

    The phony requires grad when the skip does, so autograd reaches the skip's
    backward. Every tensor, not the first alone: a gradient that left the batch
    without waiting for the phony could reach the stashing layer's backward
    before its portal is filled::

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
    """Makes ``skip_tracker`` this thread's current tracker within the context.

    Args:
        skip_tracker (SkipTracker): the tracker skippable layers should use
    """
    return _UseSkipTracker(skip_tracker)


class _UseSkipTracker:
    """The context of :func:`use_skip_tracker`.

    A class rather than a generator-based context manager: it is entered
    for every task and every recomputation, and this is the cheaper of the two.
    """

    __slots__ = ('skip_tracker', 'orig')

    def __init__(self, skip_tracker: SkipTracker) -> None:
        self.skip_tracker = skip_tracker
        self.orig: Optional[SkipTracker] = None

    def __enter__(self) -> None:
        self.orig = thread_local.skip_tracker
        thread_local.skip_tracker = self.skip_tracker

    def __exit__(self, *exc_info: object) -> None:
        thread_local.skip_tracker = self.orig


def current_skip_tracker() -> SkipTracker:
    """Returns this thread's current tracker, making a plain one on first use.

    Returns:
        SkipTracker: the tracker skippable layers stash into and pop from
    """
    skip_tracker = thread_local.skip_tracker
    if skip_tracker is None:
        skip_tracker = SkipTracker()
        thread_local.skip_tracker = skip_tracker
    return skip_tracker

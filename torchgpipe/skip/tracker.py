"""Skip trackers: where stashed skip tensors wait for their pops.

Outside GPipe, a plain :class:`SkipTracker` keeps them in a dictionary, one
tracker per thread. Inside GPipe, each micro-batch has a
:class:`SkipTrackerThroughPotals` (the original's spelling) that sends skip
tensors crossing partitions through portals, and keeps the others in its
dictionary too.
"""
import threading
from contextlib import contextmanager
from typing import Dict, Generator, Optional, Tuple

import torch
from torch import Tensor

from torchgpipe.checkpoint import is_checkpointing
from torchgpipe.dependency import fork, join
from torchgpipe.microbatch import Batch
from torchgpipe.phony import get_phony
from torchgpipe.skip.layout import SkipLayout
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.portal import Portal
from torchgpipe.stream import AbstractStream

__all__ = ['SkipTracker', 'SkipTrackerThroughPotals', 'use_skip_tracker',
           'current_skip_tracker']


class SkipTracker:
    """Tracks saved skip tensors in a dictionary.

    It is the tracker outside of GPipe, and for skips within one partition.
    """

    def __init__(self) -> None:
        self.tensors: Dict[Tuple[Namespace, str], Optional[Tensor]] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        """Saves a stashed skip tensor; ``batch`` is the stashing layer's output."""
        self.tensors[(ns, name)] = tensor

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        """Takes out a stashed skip tensor; ``batch`` is the popping layer's input.

        Raises:
            KeyError: nothing was stashed under the name
        """
        return self.tensors.pop((ns, name))

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
             ns: Namespace, name: str) -> None:
        raise TypeError('copy is not supported for non-portal skip tensors')


class SkipTrackerThroughPotals(SkipTracker):
    """Tracks the skip tensors of one micro-batch in GPipe, through portals where they cross.

    Args:
        skip_layout (SkipLayout): where each skip tensor is stashed and popped
    """

    def __init__(self, skip_layout: SkipLayout) -> None:
        super().__init__()
        self.skip_layout = skip_layout
        self.portals: Dict[Tuple[Namespace, str], Portal] = {}

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        if not self.skip_layout.requires_copy(ns, name):
            super().save(batch, ns, name, tensor)
            return

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
        # The phony's backward (the gradient's exit from the portal) must
        # run after everything downstream of the stash: join it there.
        index = batch.find(lambda x: x.is_floating_point())
        if index is None:
            raise RuntimeError(f"skip tensor '{name}' requires grad, but the stashing layer's "
                               'output has no floating point tensor to carry its gradient')
        batch[index] = join(batch[index], phony)

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        if not self.skip_layout.requires_copy(ns, name):
            return super().load(batch, ns, name)

        portal = self.portals[(ns, name)]
        # Forked off the popping layer's input: everything before the pop
        # waits in the backward pass until the gradient is in the portal.
        phony, _ = fork_from_batch(batch, portal.requires_grad, name)
        return portal.orange(phony)

    def copy(self, batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
             ns: Namespace, name: str) -> None:
        """Moves a skip tensor to the popping partition's device, in its fence.

        ``batch`` is the popping partition's input. The copy is forked off and
        joined into it: the gradient's copy back runs after that partition's
        backward, and before anything earlier in the pipeline (the stash).
        """
        # No portal: the stash did not go through this tracker. A module
        # that runs a skippable layer by its dispatch() handles the skip
        # itself (it may pass it on in its output); a pop that needs this
        # tracker reports the missing stash when it runs.
        portal = self.portals.get((ns, name))
        if portal is None or portal.tensor is None:
            return
        phony, index = fork_from_batch(batch, portal.requires_grad, name)
        phony = portal.copy(prev_stream, next_stream, phony)
        if index is not None:
            batch[index] = join(batch[index], phony)


def fork_from_batch(batch: Batch, requires_grad: bool, name: str) -> Tuple[Tensor, Optional[int]]:
    """Forks a phony off the batch's first floating point tensor.

    If a skip tensor that requires grad depends on it, the phony is made to
    require grad too, or the skip's backward would never be reached.

    Returns:
        (phony, index): the phony, and the index of the forked tensor
        (``None`` if the batch has no floating point tensor)
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
    return phony, index


class ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.skip_tracker: Optional[SkipTracker] = None


thread_local = ThreadLocal()


@contextmanager
def use_skip_tracker(skip_tracker: SkipTracker) -> Generator[None, None, None]:
    """Makes ``skip_tracker`` the current tracker of this thread within the context."""
    orig = thread_local.skip_tracker
    thread_local.skip_tracker = skip_tracker
    try:
        yield
    finally:
        thread_local.skip_tracker = orig


def current_skip_tracker() -> SkipTracker:
    """Gets the current tracker of this thread, creating a default one if there is none."""
    skip_tracker = thread_local.skip_tracker
    if skip_tracker is None:
        skip_tracker = SkipTracker()
        thread_local.skip_tracker = skip_tracker
    return skip_tracker

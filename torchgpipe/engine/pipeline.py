"""The pipeline: every micro-batch through every partition, by clock cycles, the
partitions linked into one autograd graph whose backward is the caller's.

At clock ``k`` the tasks ``F(i, j)`` with ``i + j == k`` run at once::

    clock    0       1       2       3       4          m = 3 micro-batches
    dev 0  F(0,0)  F(1,0)  F(2,0)                       n = 3 partitions
    dev 1          F(0,1)  F(1,1)  F(2,1)
    dev 2                  F(0,2)  F(1,2)  F(2,2)

Each forward task ``F(i, j)``, on its partition's worker::

    receive   the skips popped here, then the input, copied on the copy
              streams of micro-batch i (from j-1's to j's)
    compute   on the compute stream, checkpointed or not; joined to the
              phony of F(i-1, j)'s fork: B(i, j) before B(i-1, j) (a
              checkpoint joins and forks by itself)
    send      the copy stream waits for the output; Recompute attached after
              that Wait (F'(i, j) overlaps the copy of its gradient); forked,
              so that B(i+1, j) can be made to precede this B(i, j)

What the caller's backward pass then does on each partition::

    B(m-1, j) ─► ... ─► F'(i+1, j) B(i+1, j) ─► F'(i, j) B(i, j) ─► ... ─► B(0, j)
"""
import functools
from typing import Callable, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor, nn

from torchgpipe.engine.mailbox import Activation, Mailbox
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.step import execute
from torchgpipe.foundation.copy import Copy, Wait
from torchgpipe.foundation.dependency import fork, join
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors
from torchgpipe.foundation.record import Recorder, run_task
from torchgpipe.foundation.rng import cpu_generator_held, training_flags, watch
from torchgpipe.foundation.stream import AbstractStream, is_cuda, use_device, use_stream
from torchgpipe.runtime.checkpoint import Checkpointing, plain
from torchgpipe.runtime.partition import partition_function
from torchgpipe.runtime.traits import PartitionTraits
from torchgpipe.runtime.worker import Stopped
from torchgpipe.skip.layout import SkipLayout
from torchgpipe.skip.tracker import SkipTrackerThroughPortals

__all__: List[str] = []


def copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
         ) -> Optional[Tensor]:
    """Moves the batch to ``next_stream``'s device, in place; returns a copied tensor, or
    ``None`` if nothing had to move (between CPU devices: no autograd node)."""
    if not (is_cuda(prev_stream) or is_cuda(next_stream)) or not len(batch):
        return None
    batch[:] = Copy.apply(prev_stream, next_stream, *batch)  # type: ignore[no-untyped-call]
    return batch[0]


def wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Makes ``next_stream`` wait for ``prev_stream`` before it uses the batch."""
    if is_cuda(prev_stream) or is_cuda(next_stream):
        batch[:] = Wait.apply(prev_stream, next_stream, *batch)  # type: ignore[no-untyped-call]


def fork_off(batch: Union[Batch, Checkpointing]) -> Optional[Tensor]:
    """The phony the next micro-batch joins: a checkpoint's own, or a fork of the first
    tensor of ``batch`` that requires grad (``None`` if none does)."""
    if isinstance(batch, Checkpointing):
        return batch.phony
    k = batch.find(lambda x: x.requires_grad)
    if k is None:
        return None
    batch[k], phony = fork(batch[k])
    return phony


def join_in(batch: Batch, phony: Optional[Tensor]) -> None:
    """Joins ``phony`` into ``batch``, if both exist: its backward then precedes the fork's."""
    k = batch.find(lambda x: x.is_floating_point())
    if phony is not None and k is not None:
        batch[k] = join(batch[k], phony)


def clock_cycles(m: int, n: int) -> Iterable[List[Tuple[int, int]]]:
    """For each clock ``k``, the ``(i, j)`` (micro-batch, partition) with ``i + j == k``.

    Example::

        >>> list(clock_cycles(2, 2))
        [[(0, 0)], [(1, 0), (0, 1)], [(1, 1)]]
    """
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


class Pipeline:
    """Runs micro-batches through linked partitions, in place of the input batches."""

    def __init__(self, batches: List[Batch], partitions: Sequence[nn.Sequential],
                 devices: Sequence[torch.device],
                 copy_streams: Sequence[Sequence[AbstractStream]],
                 streams: Sequence[AbstractStream], skip_layout: SkipLayout,
                 checkpoint_stop: int, traits: Sequence[PartitionTraits],
                 recorder: Optional[Recorder] = None) -> None:
        self.batches = batches
        self.devices = devices
        self.copy_streams = copy_streams
        self.streams = streams
        self.skip_layout = skip_layout
        self.checkpoint_stop = checkpoint_stop
        self.recorder = recorder
        self.mailbox = Mailbox()
        self.skip_trackers = [SkipTrackerThroughPortals(skip_layout) for _ in batches]
        self.stages = [LinkedStage(self, j, p, traits[j])
                       for j, p in enumerate(partitions)]

    def run(self) -> None:
        """Runs the pipeline, raising a task's failure as itself."""
        m, n = len(self.batches), len(self.devices)
        if self.recorder is not None:
            self.recorder.begin_step(m, self.devices)
        # clock_order's layout (tests/engine/test_order.py), at a third of its cost.
        order = [Action(Kind.F, i, j) for cycle in clock_cycles(m, n) for i, j in cycle]
        execute(order, dict(enumerate(self.stages)), self.mailbox)


class LinkedStage:
    """One partition in the forward path: its forward tasks, linked to its neighbours'."""

    def __init__(self, linked: Pipeline, j: int, partition: nn.Sequential,
                 traits: PartitionTraits) -> None:
        self.linked = linked
        self.j = j
        self.partition = partition
        self.device = linked.devices[j]
        self.traits = traits
        self.flags = training_flags(partition)
        self.last = j == len(linked.devices) - 1
        # Those a checkpoint returns gradients for (tied ones included), picked once.
        self.parameters = tuple(p for p in partition.parameters() if p.requires_grad) \
            if linked.checkpoint_stop else ()
        self.plain = bool(linked.checkpoint_stop) and plain(partition)
        #: The phony of the last output's fork, for the next input to join.
        self.phony: Optional[Tensor] = None

    def draws_random(self) -> Optional[bool]:
        """Whether the tasks may draw from the CPU generator, if known: if not, a recomputation
        skips replaying it, which costs small tasks about as much as their kernels."""
        return self.traits.draws(self.flags)

    def run(self, action: Action) -> None:
        """Runs forward task ``F(i, j)``: receives, computes and sends, linked."""
        linked = self.linked
        if linked.mailbox.stopped:
            raise Stopped()  # a task elsewhere failed: start nothing more
        i, j = action.i, self.j
        batch = self.receive(i)
        # The phony of F(i-1, j): joined in (by a checkpoint itself), B(i, j) runs before.
        phony, self.phony = self.phony, None
        chk = None
        if i < linked.checkpoint_stop:
            chk = Checkpointing(self.function(i), batch, self.parameters, self.traits,
                                task=(i, j), exclusive_rng=self.draws_random() is not False,
                                phony=phony, plain=self.plain)
            compute = chk.checkpoint
        else:
            join_in(batch, phony)
            compute = functools.partial(batch.call, self.function(i))
        # Inside a trace: where the walk through the task's backward stops.
        boundary = [x.grad_fn for x in [*batch, phony] if x is not None and x.grad_fn is not None] \
            if linked.recorder is not None else []
        output = self.compute(i, compute)
        waits = not self.last and is_cuda(linked.streams[j])
        if waits:  # the copy stream must wait for the output before copying it
            wait(output, linked.streams[j], linked.copy_streams[j][i])
        if chk is not None and (waits or linked.recorder is not None):
            # After the Wait: in backward, F'(i, j) runs before waiting for the gradient (and
            # a trace shows it apart). Forked after it: it waits for B(i+1, j) too.
            with use_device(self.device), use_stream(linked.streams[j]):
                chk.recompute(output)
            chk = None
        if linked.recorder is not None:
            linked.recorder.watch_backward(i, j, self.device, output, boundary)
        if i + 1 < len(linked.batches):
            self.phony = fork_off(output if chk is None else chk)
        if self.last:
            linked.batches[i] = output
        else:
            linked.mailbox.put(Activation(i, j + 1), output)

    def function(self, i: int) -> Callable[[TensorOrTensors], TensorOrTensors]:
        return partition_function(self.partition, self.j, self.linked.skip_trackers[i])

    def receive(self, i: int) -> Batch:
        """The input of ``F(i, j)``, on the compute stream."""
        linked, j = self.linked, self.j
        if j == 0:
            batch = linked.batches[i]
        else:
            batch = linked.mailbox.take(Activation(i, j))
            next_stream = linked.copy_streams[j][i]
            tracker = linked.skip_trackers[i]
            # Skips come straight from their stash, before the input: in backward, the
            # input's Wait then synchronizes the copy stream with their gradients.
            for prev_j, ns, name in linked.skip_layout.copy_policy(j):
                prev_stream = linked.copy_streams[prev_j][i]
                self.move(i, 'skip', lambda: tracker.copy(batch, prev_stream, next_stream,
                                                          ns, name))
            self.move(i, 'input', lambda: copy(batch, linked.copy_streams[j - 1][i],
                                               next_stream))
            wait(batch, linked.copy_streams[j][i], linked.streams[j])
        return batch

    def move(self, i: int, what: str, copy: Callable[[], Optional[Tensor]]) -> None:
        """Runs a copy into this partition, recorded inside a trace."""
        recorder = self.linked.recorder
        if recorder is None:
            copy()
            return
        with use_stream(self.linked.copy_streams[self.j][i]):
            recorder.copied(i, self.j, self.device, what, copy)

    def compute(self, i: int, compute: Callable[[], Batch]) -> Batch:
        """Runs ``F(i, j)``'s computation: labelled, timed, holding the generator if it may draw."""
        draws = self.draws_random()
        task = functools.partial(run_task, self.linked.recorder, 'forward', i, self.j,
                                 self.device, compute)
        with use_stream(self.linked.streams[self.j]), cpu_generator_held(draws is not False):
            if draws is not None:
                return task()
            output, drew = watch(task)
            self.traits.learn_draws(self.flags, drew)
            return output


"""The pipeline: runs every micro-batch through every partition by clock cycles.

Algorithm 1 of the paper (deterministic clock-cycle): at clock ``k`` the tasks
``F(i, j)`` with ``i + j == k`` are independent, so they run at the same time,
one per device. Before them, in the same cycle, the scheduler issues every
copy and every dependency they need (the *fence*), so kernels reach each
device in the same order on every run::

    clock    0       1       2       3       4          m = 3 micro-batches
    dev 0  F(0,0)  F(1,0)  F(2,0)                       n = 3 partitions
    dev 1          F(0,1)  F(1,1)  F(2,1)
    dev 2                  F(0,2)  F(1,2)  F(2,2)

With a worker thread per device, tasks that draw from the CPU generator take
turns in that same order, so random numbers are drawn as on one thread. On
either path, each holds the CPU generator while it runs, so that tasks of
another pipeline, in another thread, cannot draw between a first pass and
the state its recomputation replays (see :mod:`torchgpipe.rng`).
"""
import functools
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar, cast

import torch
from torch import Tensor, nn
import torch.autograd.profiler

from torchgpipe.checkpoint import Checkpointing
from torchgpipe.copy import Copy, Wait
from torchgpipe.dependency import fork, join
from torchgpipe.microbatch import Batch, TensorOrTensors
from torchgpipe.rng import cpu_generator_held, training_flags, watch
from torchgpipe.skip.layout import SkipLayout
from torchgpipe.skip.tracker import SkipTrackerThroughPortals
from torchgpipe.stream import AbstractStream, is_cuda, use_device, use_stream
from torchgpipe.partition import partition_function
from torchgpipe.tied import partition_parameters
from torchgpipe.record import Recorder, label
from torchgpipe.traits import PartitionTraits
from torchgpipe.worker import (ExcInfo, InQueue, OutQueue, Task, Turns, distinct_devices,
                               spawn_workers)

__all__: List[str] = []

T = TypeVar('T')


def clock_cycles(m: int, n: int) -> Iterable[List[Tuple[int, int]]]:
    """Generates the schedule of each clock cycle.

    Args:
        m (int): the number of micro-batches
        n (int): the number of partitions

    Yields:
        list of (int, int): for clock ``k``, every ``(i, j)`` (micro-batch
        ``i``, partition ``j``, both 0-based) with ``i + j == k``, in order
        of ``j``

    Example::

        >>> list(clock_cycles(2, 2))
        [[(0, 0)], [(1, 0), (0, 1)], [(1, 1)]]
    """
    for k in range(m + n - 1):
        yield [(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]


def depend(fork_from: Batch, join_to: Batch) -> None:
    """Makes the backward of ``join_to`` precede that of ``fork_from``.

    The phony can only ride on tensors that take part in autograd: a
    gradient-requiring one to fork from, a floating point one to join into.
    """
    i = fork_from.find(lambda x: x.requires_grad)
    j = join_to.find(lambda x: x.is_floating_point())
    if i is None or j is None:
        return
    fork_from[i], phony = fork(fork_from[i])
    join_to[j] = join(join_to[j], phony)


def copy(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream,
         ) -> Optional[Tensor]:
    """Moves the batch to ``next_stream``'s device, in place.

    Returns:
        torch.Tensor or None: a copied tensor (its node copies the gradients
        back), or ``None`` if nothing had to move
    """
    # Between CPU "devices" a copy is the identity: skip the autograd node.
    if not (is_cuda(prev_stream) or is_cuda(next_stream)) or not len(batch):
        return None
    batch[:] = Copy.apply(prev_stream, next_stream, *batch)  # type: ignore[no-untyped-call]
    return batch[0]


def wait(batch: Batch, prev_stream: AbstractStream, next_stream: AbstractStream) -> None:
    """Makes ``next_stream`` wait for ``prev_stream`` before it uses the batch."""
    if is_cuda(prev_stream) or is_cuda(next_stream):
        batch[:] = Wait.apply(prev_stream, next_stream, *batch)  # type: ignore[no-untyped-call]


class Pipeline:
    """Runs micro-batches through partitions, in place of the input batches.

    Args:
        batches: the micro-batches; each is replaced by its output
        partitions: the partitions, in order
        devices: the device of each partition
        copy_streams: for each partition, one copy stream per micro-batch
        streams: the compute stream of each partition
        skip_layout: where each skip tensor is stashed and popped
        checkpoint_stop: micro-batches ``0 .. checkpoint_stop - 1`` are checkpointed
        traits: what earlier runs showed about each partition; this run adds
            what it learns
        recorder: records every task, inside :func:`torchgpipe.trace`
    """

    def __init__(self, batches: List[Batch], partitions: Sequence[nn.Sequential],
                 devices: Sequence[torch.device],
                 copy_streams: Sequence[Sequence[AbstractStream]],
                 streams: Sequence[AbstractStream], skip_layout: SkipLayout,
                 checkpoint_stop: int, traits: Sequence[PartitionTraits],
                 recorder: Optional[Recorder] = None) -> None:
        self.batches = batches
        self.partitions = partitions
        self.devices = devices
        self.copy_streams = copy_streams
        self.streams = streams
        self.skip_layout = skip_layout
        self.checkpoint_stop = checkpoint_stop
        self.traits = traits
        self.recorder = recorder
        # Checkpoints return the gradients of their partition's parameters,
        # and of the tied parameters of earlier partitions it uses: those
        # that require grad, picked once here rather than in every task.
        self.parameters = [tuple(p for p in partition_parameters(partition) if p.requires_grad)
                           if checkpoint_stop else () for partition in partitions]
        # Each micro-batch has its own skip tensors.
        self.skip_trackers = [SkipTrackerThroughPortals(skip_layout) for _ in batches]

        # On one thread, tasks draw random numbers in issue order by nature.
        # With worker threads, a partition's tasks take turns with the CPU
        # generator if it draws from it (True), run freely if not (False),
        # and take turns and watch it, to find out, if that is not known
        # yet (None).
        self.turns: Optional[Turns] = None
        self.rng_keys: List[Tuple[bool, ...]] = []
        if len(distinct_devices(devices)) > 1:
            self.turns = Turns()
            self.rng_keys = [training_flags(p) for p in partitions]

    def draws_random(self, j: int) -> Optional[bool]:
        """Whether partition ``j`` draws from the CPU generator, if known."""
        if self.turns is None:
            # No task of this pipeline runs beside another: nothing is
            # learned, and every task may draw (and holds the generator).
            return True
        return self.traits[j].draws(self.rng_keys[j])

    def run(self) -> None:
        """Runs the pipeline; an exception of any task is raised here, as itself."""
        m = len(self.batches)
        n = len(self.partitions)
        if self.recorder is not None:
            self.recorder.begin_step(m, self.devices)
        # On Ctrl-C the workers skip the tasks left in their queues, whose
        # turns then never end: no task may wait for them.
        wake = None if self.turns is None else self.turns.stop
        with spawn_workers(self.devices, wake) as (in_queues, out_queues):
            for schedule in clock_cycles(m, n):
                self.fence(schedule)
                self.compute(schedule, in_queues, out_queues)

    def fence(self, schedule: List[Tuple[int, int]]) -> None:
        """Issues the dependencies and copies the tasks of a clock cycle need."""
        batches = self.batches
        copy_streams = self.copy_streams
        for i, j in schedule:
            # B(i, j) must run before B(i-1, j): batches[i-1] holds the
            # output of F(i-1, j), batches[i] the input of F(i, j).
            if i != 0:
                depend(batches[i - 1], batches[i])

            # Skip tensors popped by partition j come straight from the
            # partition that stashed them, on the copy streams. Issued
            # before the input's copy, so that in the backward pass the
            # input's Wait has synchronized the copy stream with the
            # gradients these portals send back.
            next_stream = copy_streams[j][i]
            tracker = self.skip_trackers[i]
            for prev_j, ns, name in self.skip_layout.copy_policy(j):
                prev_stream = copy_streams[prev_j][i]
                self.move(i, j, 'skip', lambda: tracker.copy(batches[i], prev_stream,
                                                             next_stream, ns, name))

            if j != 0:
                self.move(i, j, 'input',
                          lambda: copy(batches[i], copy_streams[j - 1][i], next_stream))

    def move(self, i: int, j: int, what: str, copy: Callable[[], Optional[Tensor]]) -> None:
        """Runs a copy into partition ``j``: recorded, inside a trace, both ways."""
        if self.recorder is None:
            copy()
            return
        # The copy runs on partition j's copy stream: time it there.
        with use_stream(self.copy_streams[j][i]):
            self.recorder.copied(i, j, self.devices[j], what, copy)

    def compute(self, schedule: List[Tuple[int, int]],
                in_queues: List[InQueue], out_queues: List[OutQueue]) -> None:
        """Runs the tasks of a clock cycle on the workers and collects their outputs."""
        batches = self.batches
        streams = self.streams
        copy_streams = self.copy_streams
        n = len(self.partitions)
        recorder = self.recorder
        # Inside a trace: the autograd nodes of each task's input, where the
        # walk through the task's backward stops.
        boundaries: Dict[int, List[Any]] = {}

        for i, j in schedule:
            batch = batches[i]
            # The input was copied on the copy stream: wait for it.
            if j != 0:
                wait(batch, copy_streams[j][i], streams[j])

            draws = self.draws_random(j)
            function = partition_function(self.partitions[j], j, self.skip_trackers[i])
            if i < self.checkpoint_stop:
                chk = Checkpointing(function, batch, self.parameters[j], self.traits[j],
                                    task=(i, j),
                                    exclusive_rng=draws is not False)
                compute, finalize = chk.checkpoint, chk.recompute
            else:
                compute, finalize = batch_call(batch, function), None
            if torch.autograd.profiler._is_profiler_enabled:
                compute = labelled((i, j), compute)
            if recorder is not None:
                boundaries[i] = [x.grad_fn for x in batch if x.grad_fn is not None]
                compute = recorder.timed('forward', i, j, self.devices[j], compute)
            if draws is not False:
                # The lock inside the turn: never held while waiting for it.
                learn = (functools.partial(self.traits[j].learn_draws, self.rng_keys[j])
                         if draws is None else None)
                compute = holding_cpu_generator(compute, learn)
                if self.turns is not None:
                    compute = self.turns.take(compute)
            in_queues[j].put(Task(streams[j], compute=compute, finalize=finalize))

        # Collect every result of the cycle, even after a failure, so no task
        # is left running; then the failure ends the pipeline.
        exc_info: Optional[ExcInfo] = None
        for i, j in schedule:
            ok, payload = out_queues[j].get()
            if exc_info is not None:
                continue
            if not ok:
                exc_info = cast(ExcInfo, payload)
                continue
            task, batch = cast(Tuple[Task, Batch], payload)

            # The copy stream must wait for the output before copying it.
            if j != n - 1:
                wait(batch, streams[j], copy_streams[j][i])

            # The recomputation is attached here, after the Wait above, so in
            # the backward pass it runs before the wait for the incoming
            # gradient's copy: F'(i, j) overlaps the copy of dx(i, j).
            with use_device(self.devices[j]):
                task.finalize(batch)
            if recorder is not None:
                recorder.watch_backward(i, j, self.devices[j], batch, boundaries[i])

            batches[i] = batch

        if exc_info is not None:
            raise exc_info[1].with_traceback(exc_info[2])


def batch_call(batch: Batch,
               function: Callable[[TensorOrTensors], TensorOrTensors]) -> Callable[[], Batch]:
    """Binds ``batch.call(function)`` for a worker."""
    return lambda: batch.call(function)


def holding_cpu_generator(compute: Callable[[], T],
                          learn: Optional[Callable[[bool], None]]) -> Callable[[], T]:
    """Wraps a task that may draw from the CPU generator to hold it while it runs.

    A checkpointed first pass saves the generator's state, then draws; the
    lock, held throughout, keeps every other pipeline's tasks from drawing
    in between, so that the recomputation replays exactly (see
    :mod:`torchgpipe.rng`). The task waits for nothing of another task.

    Args:
        compute: the task
        learn: for a partition not known yet to draw or not, told whether
            the task drew (:func:`~torchgpipe.rng.watch`)

    Returns:
        the task, holding the generator while it runs
    """
    def run() -> T:
        with cpu_generator_held(True):
            if learn is None:
                return compute()
            output, drew = watch(compute)
            learn(drew)
            return output
    return run


def labelled(task: Tuple[int, int], function: Callable[[], T]) -> Callable[[], T]:
    """Wraps forward task ``(i, j)`` so that it shows as ``torchgpipe jFi`` in a profile."""
    def run() -> T:
        with label('forward', task):
            return function()
    return run

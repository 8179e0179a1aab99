"""Workers: one thread per distinct device, running the tasks the executor issues.

The tasks of one clock cycle are independent (Section 3.2.1), so each
distinct device gets a thread fed through a queue; partitions sharing a
device share its thread, so its tasks run in issue order. When every
partition shares one device there is nothing to overlap: tasks run in the
calling thread.

Grad mode, autocast and the number of intra-op threads are thread-local in
PyTorch, so workers take them from the caller at each call, and its hold of
the CPU generator too (see :mod:`torchgpipe.foundation.rng`). CPU devices
with distinct indices (``'cpu:0'``, ``'cpu:1'``) get threads of their own.
"""
import functools
import sys
import threading
from collections import deque
from contextlib import contextmanager, nullcontext
from queue import Queue
from types import TracebackType
from typing import (Callable, Deque, Generator, Iterable, List, Optional, Protocol, Tuple,
                    Type, TypeVar, Union, cast)

import torch

from torchgpipe.foundation.autocast import (AutocastStates, restore_autocast_states,
                                            save_autocast_states)
from torchgpipe.foundation.microbatch import Batch
from torchgpipe.foundation.rng import cpu_generator_owned, holding_for_caller
from torchgpipe.foundation.stream import AbstractStream, use_device, use_stream
from torchgpipe.runtime.threads import WorkerGroup

__all__: List[str] = []

ExcInfo = Tuple[Type[BaseException], BaseException, TracebackType]

T = TypeVar('T')


class Stopped(Exception):
    """Ends a task waiting for something that will not come: the run it belongs to stopped."""


class IssueOrder:
    """Runs wrapped tasks one at a time in the order they were wrapped, whatever thread runs them.

    So tasks on different threads draw random numbers in the order one thread
    would. :meth:`stop` ends every wait with :class:`Stopped`: after a failure
    or Ctrl-C, a task skipped in its queue never ends its turn.

    Example::

        >>> order = IssueOrder()
        >>> first, second = order.wrap(lambda: 1), order.wrap(lambda: 2)
        >>> first(), second()
        (1, 2)
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._issued = 0
        self._turn = 0
        self._stopped = False

    def wrap(self, compute: Callable[[], T]) -> Callable[[], T]:
        """Wraps ``compute`` to run after every task wrapped before it has finished.

        Raises (the wrapper):
            Stopped: :meth:`stop` was called before the turn came
        """
        turn = self._issued
        self._issued += 1

        def compute_in_turn() -> T:
            with self._condition:
                while self._turn != turn:
                    if self._stopped:
                        raise Stopped()
                    self._condition.wait()
            try:
                return compute()
            finally:
                with self._condition:
                    self._turn += 1
                    self._condition.notify_all()

        return compute_in_turn

    def stop(self) -> None:
        """Ends every wait for a turn, now and later, with :class:`Stopped`."""
        with self._condition:
            self._stopped = True
            self._condition.notify_all()


class Task:
    """A computation for a worker, and a finalization for the thread that gets its result.

    Args:
        stream: the stream to compute on (``None``: the worker's current one)
        compute: produces the output batch (a training step's action: ``None``)
        finalize: post-processes the output batch, if given
    """

    __slots__ = ('stream', '_compute', '_finalize')

    def __init__(self, stream: Optional[AbstractStream], *,
                 compute: Callable[[], Optional[Batch]],
                 finalize: Optional[Callable[[Batch], None]]) -> None:
        self.stream = stream
        self._compute = compute
        self._finalize = finalize

    def compute(self) -> Optional[Batch]:
        if self.stream is None:
            return self._compute()
        with use_stream(self.stream):
            return self._compute()

    def finalize(self, batch: Batch) -> None:
        if self._finalize is None:
            return
        with use_stream(self.stream) if self.stream is not None else nullcontext():
            self._finalize(batch)


# What a worker reports for each task: (True, (task, output batch)) or
# (False, exc_info).
Result = Tuple[bool, Union[Tuple[Task, Optional[Batch]], ExcInfo]]


class InQueue(Protocol):
    """Where the executor puts the tasks of a partition (``None`` stops a worker)."""

    def put(self, task: Optional[Task]) -> None: ...


class OutQueue(Protocol):
    """Where the executor gets the results of a partition's tasks, in order."""

    def get(self) -> Result: ...


def run(task: Task) -> Result:
    """Computes a task, capturing its exception to re-raise in the caller's thread."""
    try:
        return True, (task, task.compute())
    except BaseException:
        return False, cast(ExcInfo, sys.exc_info())


def worker(in_queue: 'Queue[Optional[Task]]', out_queue: 'Queue[Result]', device: torch.device,
           grad_mode: bool, autocast_states: AutocastStates, stopping: threading.Event,
           held: bool, threads: int) -> None:
    """A worker thread's job for one call: computes tasks until it gets ``None``, or is
    stopped.

    If ``held``, the tasks draw under the caller's hold of the CPU generator.
    ``threads``, the caller's intra-op threads, is set again because a thread
    reads PyTorch's setting at its first operator only, and an idle worker
    may have started before the caller changed it.
    """
    torch.set_grad_enabled(grad_mode)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    with use_device(device), restore_autocast_states(autocast_states), \
            holding_for_caller(held):
        while True:
            task = in_queue.get()
            if task is None or stopping.is_set():
                break
            out_queue.put(run(task))
            # Do not keep the last task and its tensors alive while idle.
            del task


class InlineWorker:
    """Computes each task in the calling thread as soon as it is put."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.results: Deque[Result] = deque()

    def put(self, task: Optional[Task]) -> None:
        assert task is not None
        with use_device(self.device):
            self.results.append(run(task))

    def get(self) -> Result:
        return self.results.popleft()


def _normalize(device: torch.device) -> torch.device:
    # 'cuda' and 'cuda:<current>' are the same device, and so one worker.
    if device == torch.device('cuda'):
        return torch.device('cuda', torch.cuda.current_device())
    return device


def distinct_devices(devices: Iterable[torch.device]) -> List[torch.device]:
    """The distinct devices among ``devices``, in order: one worker each."""
    return list(dict.fromkeys(_normalize(d) for d in devices))


@contextmanager
def spawn_workers(devices: Iterable[torch.device], wake: Optional[Callable[[], None]] = None,
                  ) -> Generator[Tuple[List[InQueue], List[OutQueue]], None, None]:
    """Gives one worker thread to each distinct device, and takes them back on exit.

    On a normal exit the workers finish the tasks left in their queues, then
    wait idle for the next call; on an exception (a failed task re-raised, or
    Ctrl-C) each finishes at most the task it runs, and exits. Either way the
    context ends only once no worker can change tensors behind the caller's
    back. With one distinct device, tasks run in the calling thread as put.

    Args:
        devices: the device of each partition
        wake: ends every wait of a task for another (:meth:`IssueOrder.stop`,
            a mailbox's ``stop``), which skipped tasks would leave without end

    Yields:
        (in_queues, out_queues): each partition's worker queues, in the order
        of ``devices``; partitions on the same device share them
    """
    devices = [_normalize(d) for d in devices]
    distinct = distinct_devices(devices)
    if len(distinct) == 1:
        inline = InlineWorker(distinct[0])
        yield [inline] * len(devices), [inline] * len(devices)
        return

    queues = {d: (cast('Queue[Optional[Task]]', Queue()), cast('Queue[Result]', Queue()))
              for d in distinct}
    workers = WorkerGroup()
    grad_mode = torch.is_grad_enabled()
    autocast_states = save_autocast_states()
    held = cpu_generator_owned()
    threads = torch.get_num_threads()
    try:
        for device in distinct:
            workers.start(functools.partial(worker, *queues[device], device, grad_mode,
                                         autocast_states, workers.stopping, held, threads),
                       name=f'torchgpipe worker ({device})')
        yield ([queues[d][0] for d in devices], [queues[d][1] for d in devices])
    except BaseException:
        # A worker checks the flag before each task: those left are skipped.
        workers.stopping.set()
        raise
    finally:
        # A None after the last task ends each worker, also one waiting for
        # a task.
        for in_queue, _ in queues.values():
            in_queue.put(None)
        if workers.stopping.is_set():
            workers.stop(wake)
        else:
            workers.wait(wake)

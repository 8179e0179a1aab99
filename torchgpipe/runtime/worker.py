"""Workers: one thread per device, running the tasks both engines issue.

The tasks of one clock cycle are independent (Section 3.2.1), so the devices
can work on them at the same time. Each distinct device gets one thread, fed
through a queue; partitions sharing a device share its thread, so tasks on one
device run in the order they were issued. Between calls the threads park
(:class:`~torchgpipe.runtime.crew.Parking`), for a thread's first operators
are slow. A pipeline whose partitions all share one device has nothing to
overlap: its tasks run in the calling thread, which spares a thread switch
per task. The executor
(:func:`torchgpipe.engine.step.execute`) gives each worker one task: its
device's actions in clock order, which wait for each other's messages.

Tasks on different threads that draw from the CPU generator take
:class:`Turns` in issue order (see :mod:`torchgpipe.foundation.rng`). A task waiting for
something that will not come, because the run stopped, ends with
:class:`Stopped`.

Grad mode and autocast are thread-local in PyTorch; a new thread starts with
grad enabled and autocast off. The workers take both from the caller at each
call, with its number of intra-op threads, so
``torch.no_grad()`` and ``torch.autocast()`` around a GPipe call work. They
take its hold of the CPU generator too: a GPipe inside a partition of
another runs while its caller holds it (see :mod:`torchgpipe.foundation.rng`).

CPU devices with distinct indices (``'cpu:0'``, ``'cpu:1'``) count as distinct
devices: their partitions get threads of their own and may run concurrently.
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
from torchgpipe.runtime.crew import Crew

__all__: List[str] = []

ExcInfo = Tuple[Type[BaseException], BaseException, TracebackType]

T = TypeVar('T')


class Stopped(Exception):
    """Ends a task waiting for something that will not come: the run it belongs to stopped."""


class Turns:
    """Runs tasks one at a time, in the order they were issued, whatever thread runs them.

    Each task wrapped by :meth:`take` waits until the task wrapped before it
    has finished (succeeded or failed), so tasks on different threads draw
    random numbers in the order one thread would. :meth:`stop` ends every
    wait with :class:`Stopped`: after a failure or Ctrl-C, tasks left in the
    queues are skipped, and a turn after theirs never comes.

    Example::

        >>> turns = Turns()
        >>> first, second = turns.take(lambda: 1), turns.take(lambda: 2)
        >>> first(), second()
        (1, 2)
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._issued = 0
        self._turn = 0
        self._stopped = False

    def take(self, compute: Callable[[], T]) -> Callable[[], T]:
        """Wraps ``compute`` to run after every task wrapped before it.

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
    """A task: a computation for a worker, and a finalization for the thread that gets its result.

    ``compute`` runs in the worker thread. ``finalize``, as torchgpipe 0.0.7
    had it, runs where the result is collected (the executor's tasks need
    none: each action attaches what it builds itself).

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

    If ``held``, the caller holds the CPU generator while it waits for the
    tasks: they draw under its hold. ``threads`` is the caller's number of
    intra-op threads: a thread takes PyTorch's setting at its first
    operator only, and a parked worker may have started before the caller
    changed it.
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

    On a normal exit, the workers finish the tasks left in their queues
    first. On an exception (a failed task re-raised, or Ctrl-C), they skip
    them: each finishes at most the task it is running. Either way the
    context ends only once no worker is left to change tensors behind the
    caller's back. The threads are parked ones when there are (see
    :class:`~torchgpipe.runtime.crew.Parking`); after a normal exit they
    park again, after an exception they have exited. With a single distinct device, no thread
    works: the tasks run in the calling thread, as they are put.

    Args:
        devices: the device of each partition
        wake: ends every wait of a task for another (:meth:`Turns.stop`, a
            mailbox's ``stop``): on an exception, the tasks skipped would
            leave those waits without an end

    Yields:
        (in_queues, out_queues): the queues of each partition's worker, in
        the order of ``devices``; partitions on the same device share them
    """
    devices = [_normalize(d) for d in devices]
    distinct = distinct_devices(devices)
    if len(distinct) == 1:
        inline = InlineWorker(distinct[0])
        yield [inline] * len(devices), [inline] * len(devices)
        return

    queues = {d: (cast('Queue[Optional[Task]]', Queue()), cast('Queue[Result]', Queue()))
              for d in distinct}
    crew = Crew()
    grad_mode = torch.is_grad_enabled()
    autocast_states = save_autocast_states()
    held = cpu_generator_owned()
    threads = torch.get_num_threads()
    try:
        for device in distinct:
            crew.start(functools.partial(worker, *queues[device], device, grad_mode,
                                         autocast_states, crew.stopping, held, threads),
                       name=f'torchgpipe worker ({device})')
        yield ([queues[d][0] for d in devices], [queues[d][1] for d in devices])
    except BaseException:
        # Tasks left in the queues are skipped: a worker checks the flag
        # before each.
        crew.stopping.set()
        raise
    finally:
        # A None after the last task ends each worker, also one waiting for
        # a task.
        for in_queue, _ in queues.values():
            in_queue.put(None)
        if crew.stopping.is_set():
            crew.stop(wake)
        else:
            crew.wait(wake)

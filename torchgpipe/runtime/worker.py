"""Workers: a thread per distinct device (``'cpu:0'`` and ``'cpu:1'`` too), running its
works in issue order; with one device, the calling thread. They take the caller's
thread-local state: grad mode, autocast, intra-op threads, hold of the CPU generator.
"""
import functools
import sys
import threading
from collections import deque
from contextlib import contextmanager, nullcontext
from queue import Queue
from types import TracebackType
from typing import (Callable, ContextManager, Deque, Generator, Iterable, Iterator, List,
                    Mapping, Optional, Protocol, Tuple, Type, TypeVar, Union, cast)

import torch

from torchgpipe.foundation.autocast import (AutocastStates, restore_autocast_states,
                                            save_autocast_states)
from torchgpipe.foundation.microbatch import Batch
from torchgpipe.foundation.placement import indexed
from torchgpipe.foundation.rng import cpu_generator_owned, holding_for_caller
from torchgpipe.foundation.stream import AbstractStream, use_device, use_stream
from torchgpipe.runtime.threads import WorkerGroup

__all__: List[str] = []

ExcInfo = Tuple[Type[BaseException], BaseException, TracebackType]

T = TypeVar('T')


class Stopped(Exception):
    """Ends a task waiting for something that will not come: the run it belongs to stopped."""


class IssueOrder:
    """Runs wrapped tasks one at a time in the order they were wrapped, on any thread: they
    draw random numbers as on one. :meth:`stop` ends every wait with :class:`Stopped`."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._issued = 0
        self._turn = 0
        self._stopped = False

    def wrap(self, compute: Callable[[], T]) -> Callable[[], T]:
        """Wraps ``compute`` to run once every task wrapped before it has finished."""
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
        """Ends every wait for a turn, now and later (a skipped task never ends its turn)."""
        with self._condition:
            self._stopped = True
            self._condition.notify_all()


class Task:
    """0.0.7's task: a computation on ``stream``, and a finalization for the result's thread."""

    def __init__(self, stream: Optional[AbstractStream], *,
                 compute: Callable[[], Optional[Batch]],
                 finalize: Optional[Callable[[Batch], None]]) -> None:
        self.stream = stream
        self._compute = compute
        self._finalize = finalize

    def compute(self) -> Optional[Batch]:
        with use_stream(self.stream) if self.stream is not None else nullcontext():
            return self._compute()

    def finalize(self, batch: Batch) -> None:
        if self._finalize is not None:
            with use_stream(self.stream) if self.stream is not None else nullcontext():
                self._finalize(batch)


# A task's result: (True, (task, output batch)) or (False, exc_info).
Result = Tuple[bool, Union[Tuple[Task, Optional[Batch]], ExcInfo]]


class InQueue(Protocol):
    """Where a partition's tasks go (``None`` ends them)."""

    def put(self, task: Optional[Task]) -> None: ...


class OutQueue(Protocol):
    """Where a partition's results come from."""

    def get(self) -> Result: ...


def run(task: Task, report: Callable[[Result], None]) -> None:
    """Computes a task and reports its result, or its exception."""
    try:
        result: Result = True, (task, task.compute())
    except BaseException:
        result = False, cast(ExcInfo, sys.exc_info())
    report(result)


# A device's work, and its index among all the works.
Work = Tuple[int, Callable[[], None]]


def worker(works: Iterable[Work], device: torch.device,
           state: Callable[[], ContextManager[None]], stopping: threading.Event,
           failures: List[Tuple[int, ExcInfo]], wake: Optional[Callable[[], None]]) -> None:
    """Runs a device's works in order, in ``state``, until one fails or ``stopping`` is set:
    the one place a failure is caught, kept with its index while ``wake`` ends the waits."""
    index = -1
    try:
        with use_device(device), state():
            for index, work in works:
                if stopping.is_set():
                    break
                work()
    except Stopped:
        pass  # a work elsewhere failed, or Ctrl-C
    except BaseException:
        failures.append((index, cast(ExcInfo, sys.exc_info())))
        if wake is not None:
            wake()


@contextmanager
def _caller_state(grad_mode: bool, autocast_states: AutocastStates, held: bool,
                  threads: int) -> Generator[None, None, None]:
    torch.set_grad_enabled(grad_mode)
    # A thread reads the setting at its first operator only, maybe before the caller's.
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    with restore_autocast_states(autocast_states), holding_for_caller(held):
        yield


@contextmanager
def run_on_workers(works: Mapping[torch.device, Iterable[Work]],
                   wake: Optional[Callable[[], None]]) -> Generator[None, None, None]:
    """The one executor: runs each distinct device's works in order on its worker thread
    while the body runs (one device: in this thread, on entry), and raises the first
    failure, by index, as itself once every worker stopped. ``wake`` ends every wait of a
    work for another. On Ctrl-C each worker finishes at most its work and exits."""
    failures: List[Tuple[int, ExcInfo]] = []
    workers = WorkerGroup()
    if len(works) == 1:
        device, device_works = next(iter(works.items()))
        worker(device_works, device, nullcontext, workers.stopping, failures, wake)
        yield
    else:
        state = functools.partial(_caller_state, torch.is_grad_enabled(), save_autocast_states(),
                                  cpu_generator_owned(), torch.get_num_threads())
        try:
            for device, device_works in works.items():
                workers.start(functools.partial(worker, device_works, device, state,
                                                workers.stopping, failures, wake),
                              name=f'torchgpipe worker ({device})')
            yield
        except BaseException:
            workers.stop(wake)
            raise
        workers.wait(wake)
    if failures:
        _, (_, exc, tb) = min(failures, key=lambda failure: failure[0])
        raise exc.with_traceback(tb)


class InlineWorker:
    """Computes each task in the calling thread as it is put."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.results: Deque[Result] = deque()

    def put(self, task: Optional[Task]) -> None:
        assert task is not None
        with use_device(self.device):
            run(task, self.results.append)

    def get(self) -> Result:
        return self.results.popleft()


def distinct_devices(devices: Iterable[torch.device]) -> List[torch.device]:
    """The distinct devices, in order: one worker each (``'cuda'`` is the current one)."""
    return list(dict.fromkeys(indexed(d) for d in devices))


def _queued(in_queue: 'Queue[Optional[Task]]', out_queue: 'Queue[Result]') -> Iterator[Work]:
    for task in iter(in_queue.get, None):
        yield 0, functools.partial(run, task, out_queue.put)


@contextmanager
def spawn_workers(devices: Iterable[torch.device], wake: Optional[Callable[[], None]] = None,
                  ) -> Generator[Tuple[List[InQueue], List[OutQueue]], None, None]:
    """0.0.7's workers, on :func:`run_on_workers`: yields each device's in- and out-queues;
    on exit, the tasks put are finished (on an exception, those running)."""
    devices = [indexed(d) for d in devices]
    distinct = distinct_devices(devices)
    if len(distinct) == 1:
        inline = InlineWorker(distinct[0])
        yield [inline] * len(devices), [inline] * len(devices)
        return
    queues = {d: (cast('Queue[Optional[Task]]', Queue()), cast('Queue[Result]', Queue()))
              for d in distinct}
    with run_on_workers({d: _queued(*queues[d]) for d in distinct}, wake):
        try:
            yield [queues[d][0] for d in devices], [queues[d][1] for d in devices]
        finally:
            for in_queue, _ in queues.values():
                in_queue.put(None)

"""Workers: a thread per distinct device (``'cpu:0'`` and ``'cpu:1'`` too), running its
works in issue order; with one device, the calling thread. They take the caller's
thread-local state: grad mode, autocast, intra-op threads, hold of the CPU generator.
Idle threads are kept between calls: a new thread's first operators are slow. Those of an
interrupted call exit before the caller hears of it.
"""
import functools
import os
import sys
import threading
from collections import deque
from contextlib import contextmanager, nullcontext
from queue import Queue
from types import TracebackType
from typing import (Callable, ContextManager, Deque, Dict, Generator, Iterable, Iterator, List,
                    Mapping, Optional, Protocol, Tuple, Type, TypeVar, Union, cast)

import torch

from torchgpipe.foundation.microbatch import Batch
from torchgpipe.foundation.placement import indexed
from torchgpipe.foundation.rng import cpu_generator_owned, holding_for_caller
from torchgpipe.foundation.stream import AbstractStream, use_device, use_stream
from torchgpipe.runtime.replay import (AutocastStates, restore_autocast_states,
                                      save_autocast_states)

__all__: List[str] = []

ExcInfo = Tuple[Type[BaseException], BaseException, TracebackType]

T = TypeVar('T')


class WorkerThread:
    """A thread that runs the jobs put to it, until ``None``."""

    def __init__(self, name: str) -> None:
        self.jobs: 'Queue[Optional[Callable[[], None]]]' = Queue()
        #: Set once the thread has left its loop.
        self.exited = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)

    def _loop(self) -> None:
        try:
            while True:
                job = self.jobs.get()
                if job is None:
                    break
                job()
                # Not kept alive while idle.
                del job
        finally:
            self.exited.set()


class IdleWorkers:
    """Worker threads waiting for a job between calls, by name (a child process forgets them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: Dict[str, List[WorkerThread]] = {}

    def take(self, name: str) -> WorkerThread:
        """An idle worker named ``name``, or a new one (not started yet)."""
        with self._lock:
            idle = self._idle.get(name)
            if idle:
                return idle.pop()
        return WorkerThread(name)

    def keep(self, worker: WorkerThread) -> None:
        """Keeps ``worker``, its job ended, for a later :meth:`take`."""
        with self._lock:
            self._idle.setdefault(worker.thread.name, []).append(worker)

    def threads(self) -> List[threading.Thread]:
        with self._lock:
            return [worker.thread for workers in self._idle.values() for worker in workers]

    def forget(self) -> None:
        self._lock = threading.Lock()
        self._idle = {}


#: The process's idle workers.
IDLE_WORKERS = IdleWorkers()
if hasattr(os, 'register_at_fork'):
    os.register_at_fork(after_in_child=IDLE_WORKERS.forget)


class WorkerGroup:
    """The worker threads of one call, which the caller can stop, and wait for through Ctrl-C
    (on events: ``Thread.join`` after a ``KeyboardInterrupt`` may return early, as on 3.11.7).

    A job sets *begun*, then works only if *stopping* is not set; :meth:`stop` sets
    *stopping*, then waits for every job begun: none works after it returns.
    """

    def __init__(self) -> None:
        self.stopping = threading.Event()
        self._jobs: List[Tuple[threading.Event, threading.Event, WorkerThread]] = []
        self._running: List[WorkerThread] = []

    def start(self, target: Callable[[], None], name: str) -> None:
        """Runs ``target`` (raising nothing) in a worker thread ``name``, unless stopping."""
        begun, ended = threading.Event(), threading.Event()

        def job() -> None:
            try:
                begun.set()
                if not self.stopping.is_set():
                    target()
            finally:
                ended.set()

        worker = IDLE_WORKERS.take(name)
        # Known before its thread starts, for stop() to see its begun flag.
        self._jobs.append((begun, ended, worker))
        worker.jobs.put(job)
        if worker.thread.ident is None:
            worker.thread.start()
        self._running.append(worker)

    def wait(self, wake: Optional[Callable[[], None]] = None) -> None:
        """Waits for every job, then keeps the threads idle; on Ctrl-C, stops them first."""
        try:
            for _, ended, _ in self._jobs:
                ended.wait()
        except BaseException:
            self.stop(wake)
            raise
        for _, _, worker in self._jobs:
            IDLE_WORKERS.keep(worker)

    def stop(self, wake: Optional[Callable[[], None]] = None) -> None:
        """Stops the jobs (each finishes its piece of work) and waits for every thread to
        exit, then raises a ``KeyboardInterrupt`` that came meanwhile. ``wake``, which ends
        the jobs' waits for one another, is called on every try."""
        interrupted: Optional[KeyboardInterrupt] = None
        retired = False
        while True:
            try:
                self.stopping.set()
                if wake is not None:
                    wake()
                if not retired:
                    for _, _, worker in self._jobs:
                        worker.jobs.put(None)
                    retired = True
                for begun, _, worker in self._jobs:
                    if begun.is_set() or worker in self._running:
                        worker.exited.wait()
                        # Its loop is done: the join waits for threading to mark it ended.
                        worker.thread.join()
                break
            except KeyboardInterrupt as exc:
                interrupted = exc
        if interrupted is not None:
            raise interrupted


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

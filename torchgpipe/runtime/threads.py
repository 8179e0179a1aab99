"""The worker threads of a call, and those kept idle between calls: a new thread's first
operators are slow. Those of an interrupted call exit before the caller hears of it."""
import os
import threading
from queue import Queue
from typing import Callable, Dict, List, Optional, Tuple

__all__: List[str] = []


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

"""The worker threads of a call, and those kept idle between calls.

A thread's first operators are slow while the math libraries set up its
state, so a worker whose call ended normally waits in :data:`IDLE_WORKERS`
for the next call on its device. The threads of an interrupted call
(Ctrl-C) exit before the ``KeyboardInterrupt`` reaches the caller.
"""
import os
import threading
from queue import Queue
from typing import Callable, Dict, List, Optional, Tuple

__all__: List[str] = []


class WorkerThread:
    """A thread that runs the jobs put to it, one at a time, until it gets ``None``."""

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
                # Do not keep the job (its queues) alive while idle.
                del job
        finally:
            self.exited.set()


class IdleWorkers:
    """Worker threads blocked on their job queue between calls, by name (one per device).

    After ``os.fork`` the child, which has none of the parent's threads,
    forgets them.
    """

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
        """Keeps ``worker``, whose job has ended, for a later :meth:`take`."""
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
    """The worker threads of one call, which the caller can stop, and wait for even
    through Ctrl-C.

    The caller waits on events each job sets, never on ``Thread.join`` after
    a ``KeyboardInterrupt`` (on some Pythons, 3.11.7 among them, that marks
    the thread as ended while it still runs).

    Stopping is a handshake on two flags, each set before the other is read:
    a job sets *begun*, then works only if *stopping* is not set; :meth:`stop`
    sets *stopping*, then waits for every job that has begun. So no job works
    after :meth:`stop` returns, even if :meth:`start` was interrupted.
    """

    def __init__(self) -> None:
        #: Set by :meth:`stop`; workers check it before each piece of work.
        self.stopping = threading.Event()
        self._jobs: List[Tuple[threading.Event, threading.Event, WorkerThread]] = []
        #: The workers whose threads run (idle before, or started).
        self._running: List[WorkerThread] = []

    def start(self, target: Callable[[], None], name: str) -> None:
        """Runs ``target``, which raises nothing, in a worker thread named ``name`` unless
        the group is stopping."""
        begun, ended = threading.Event(), threading.Event()

        def job() -> None:
            try:
                begun.set()
                if not self.stopping.is_set():
                    target()
            finally:
                ended.set()

        worker = IDLE_WORKERS.take(name)
        # Known before its thread starts, so that stop() sees its begun flag.
        self._jobs.append((begun, ended, worker))
        worker.jobs.put(job)
        if worker.thread.ident is None:
            worker.thread.start()
        self._running.append(worker)

    def wait(self, wake: Optional[Callable[[], None]] = None) -> None:
        """Waits until every job has ended, then keeps the threads idle; after a Ctrl-C
        meanwhile, stops them first (``wake`` as for :meth:`stop`)."""
        try:
            for _, ended, _ in self._jobs:
                ended.wait()
        except BaseException:
            self.stop(wake)
            raise
        for _, _, worker in self._jobs:
            IDLE_WORKERS.keep(worker)

    def stop(self, wake: Optional[Callable[[], None]] = None) -> None:
        """Stops the jobs and waits until every thread that runs has exited; each
        finishes at most the piece of work it is doing. A ``KeyboardInterrupt``
        meanwhile is raised once they all have.

        Args:
            wake: ends every wait of the jobs for one another (for an
                :class:`~torchgpipe.runtime.worker.IssueOrder`, a message);
                called again on every try, so that a Ctrl-C cannot leave a
                thread waiting
        """
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
                        # Its loop is done: the join only waits for the
                        # thread to leave threading's list of live threads.
                        worker.thread.join()
                break
            except KeyboardInterrupt as exc:
                interrupted = exc
        if interrupted is not None:
            raise interrupted

"""Worker threads of one call: taken from the parked ones or started, waited for, stopped.

:func:`~torchgpipe.runtime.worker.spawn_workers` gives each distinct device
of a call a thread through a :class:`Crew`. Threads outlive the call that
used them only parked (:class:`Parking`), idle on their job queue; the
threads of a call that failed or was interrupted exit before the exception
reaches the caller.
"""
import os
import threading
from queue import Queue
from typing import Callable, Dict, List, Optional, Tuple

__all__: List[str] = []


class Hand:
    """A worker thread that runs the jobs put to it, one at a time, until it gets ``None``."""

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
                # Do not keep the job (its queues) alive while parked.
                del job
        finally:
            self.exited.set()


class Parking:
    """Worker threads kept idle between calls, to serve the next call on the same device.

    A thread's first operators cost far more than its later ones: the math
    libraries set up per-thread state (13 ms against 0.3 ms for the first
    ``Linear(512, 512)`` of a new thread, on the 2-core machine of the
    benchmarks). A worker started anew at every call paid it at every step.
    So a worker whose call ended normally parks here, blocked on its job
    queue, and a call takes a parked thread of its device before starting
    one. A worker whose call failed or was interrupted is not parked: it
    exits. After ``os.fork`` the child, which has none of the parent's
    threads, forgets them.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._idle: Dict[str, List[Hand]] = {}

    def take(self, name: str) -> Hand:
        """A parked worker named ``name``, or a new one (not started yet)."""
        with self._lock:
            idle = self._idle.get(name)
            if idle:
                return idle.pop()
        return Hand(name)

    def park(self, hand: Hand) -> None:
        """Keeps ``hand``, whose job has ended, for a later :meth:`take`."""
        with self._lock:
            self._idle.setdefault(hand.thread.name, []).append(hand)

    def parked(self) -> List[threading.Thread]:
        """The threads parked now."""
        with self._lock:
            return [hand.thread for hands in self._idle.values() for hand in hands]

    def forget(self) -> None:
        """Forgets every parked thread (in a forked child, where none of them runs)."""
        self._lock = threading.Lock()
        self._idle = {}


#: The process's parked workers.
PARKING = Parking()
if hasattr(os, 'register_at_fork'):
    os.register_at_fork(after_in_child=PARKING.forget)


class Crew:
    """Worker threads of one call, which the calling thread can stop, and wait for even
    through Ctrl-C.

    Each job says itself when it begins and when it ends, with events, and
    the caller waits for those: it never relies on ``Thread.join`` after a
    ``KeyboardInterrupt`` has hit it, which on some Python versions (3.11.7
    among them) marks the thread as ended while it still runs.

    Stopping is a handshake on two flags, each set before the other is
    read: a job sets *begun*, then runs its work only if *stopping* is not
    set; :meth:`stop` sets *stopping*, then waits for every job that has
    begun. So a job either is waited for, or does nothing: none works after
    :meth:`stop` returns, even if ``start()`` was interrupted.

    Threads come from :data:`PARKING`. :meth:`wait` parks them again once
    their jobs have ended; :meth:`stop` retires them, and waits until every
    one that runs has exited: a parked thread may not have woken up to its
    job yet, and does nothing but exit once it does.
    """

    def __init__(self) -> None:
        #: Set by :meth:`stop`; workers check it before each piece of work.
        self.stopping = threading.Event()
        self._jobs: List[Tuple[threading.Event, threading.Event, List[bool], Hand]] = []
        #: The hands whose threads run (parked before, or started).
        self._running: List[Hand] = []

    def start(self, target: Callable[[], None], name: str) -> None:
        """Runs ``target`` in a worker thread named ``name`` unless the crew is stopping."""
        begun, ended, clean = threading.Event(), threading.Event(), [False]

        def job() -> None:
            try:
                begun.set()
                if not self.stopping.is_set():
                    target()
                clean[0] = True
            finally:
                ended.set()

        hand = PARKING.take(name)
        # Known before its thread starts, so that stop() sees its begun flag.
        self._jobs.append((begun, ended, clean, hand))
        hand.jobs.put(job)
        if hand.thread.ident is None:
            hand.thread.start()
        self._running.append(hand)

    def wait(self, wake: Optional[Callable[[], None]] = None) -> None:
        """Waits until every job has ended, then parks the threads; after a Ctrl-C
        meanwhile, stops them first.

        Args:
            wake: as for :meth:`stop`
        """
        try:
            for _, ended, _, _ in self._jobs:
                ended.wait()
        except BaseException:
            self.stop(wake)
            raise
        for _, _, clean, hand in self._jobs:
            if clean[0]:
                PARKING.park(hand)
            else:  # its job raised past the worker's own handling: the thread ends
                hand.jobs.put(None)
                hand.exited.wait()
                hand.thread.join()

    def stop(self, wake: Optional[Callable[[], None]] = None) -> None:
        """Stops the jobs, and waits until every thread that runs has exited.

        Each finishes at most the piece of work it is doing. A
        ``KeyboardInterrupt`` meanwhile is raised once they all have.

        Args:
            wake: ends every wait of the jobs' work for one another (for
                a turn, a message), which would otherwise never end; called
                again on every try, so that a Ctrl-C that cut it short
                cannot leave a thread waiting
        """
        interrupted: Optional[KeyboardInterrupt] = None
        retired = False
        while True:
            try:
                self.stopping.set()
                if wake is not None:
                    wake()
                if not retired:
                    for _, _, _, hand in self._jobs:
                        hand.jobs.put(None)
                    retired = True
                for begun, _, _, hand in self._jobs:
                    if begun.is_set() or hand in self._running:
                        hand.exited.wait()
                        # Its loop is done: the join only waits for the
                        # thread to leave threading's list of live threads.
                        hand.thread.join()
                break
            except KeyboardInterrupt as exc:
                interrupted = exc
        if interrupted is not None:
            raise interrupted

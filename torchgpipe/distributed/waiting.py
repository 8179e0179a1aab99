"""Waiting for a point-to-point operation until a deadline, leaving the connections whole.

A step timeout must end a wait, yet leave this rank the words to exchange
with the others (why it stops, whom it waited for: see :meth:`Wire.blame
<torchgpipe.distributed.wire.Wire.blame>`). gloo cannot do both: a wait
given a timeout that passes closes every connection of the group (all its
pairs) on that rank. So under gloo the step's thread waits without a
timeout, and a :class:`Watch` keeps the step's deadline, in a thread that
every step of the process shares (:class:`Timers`)::

    step's thread  ── wait (no timeout) ─────────────────────────────┬─ a word, a message
    timers' thread ── sleeps ── deadline: tell the others whom this ──┴─ grace over: close
                                rank waits for                         the connections

At the deadline, the watch has this rank tell every other whom it waits
for; the wait goes on, for that rank's own word (the same channel brings
it). If none comes within the grace, the watch ends the wait the only way
gloo offers: it makes another wait time out, which closes the connections.
After the deadline, waits are bounded (:class:`Waiter`): a helper thread
waits, the step's thread waits for it until a deadline, and leaves the
operation to it if it does not end by then, so that it may be waited for
again. NCCL's ``wait(timeout)`` polls and breaks nothing: there the step's
thread waits itself.
"""
import heapq
import itertools
import os
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__: List[str] = []


class Pending:
    """An operation handed to a helper, until it ends."""

    def __init__(self, work: dist.Work) -> None:
        self.work = work
        self.ended = threading.Event()
        self.error: Optional[BaseException] = None

    def run(self) -> None:
        try:
            self.work.wait()
        except BaseException as exc:
            self.error = exc
        self.ended.set()


class Helper:
    """A daemon thread that waits for the operations handed to it, one after another."""

    def __init__(self) -> None:
        self.queue: 'queue.SimpleQueue[Optional[Pending]]' = queue.SimpleQueue()
        threading.Thread(target=self.loop, name='torchgpipe-wait', daemon=True).start()

    def loop(self) -> None:
        while True:
            pending = self.queue.get()
            if pending is None:
                return
            pending.run()

    def hand(self, work: dist.Work) -> Pending:
        pending = Pending(work)
        self.queue.put(pending)
        return pending

    def close(self) -> None:
        """Ends the thread once the operation it waits for, if any, has ended."""
        self.queue.put(None)


class Waiter:
    """Waits for point-to-point operations until a deadline, without ending them.

    Args:
        threaded: through helper threads (gloo); else in the calling thread
            (NCCL)
    """

    def __init__(self, threaded: bool) -> None:
        self.threaded = threaded
        self.helper: Optional[Helper] = None
        # The operations still running at a deadline, by ``id``.
        self.left: Dict[int, Pending] = {}

    def wait(self, work: dist.Work, until: float) -> bool:
        """Waits for ``work`` until ``until`` (by ``time.monotonic()``).

        Returns:
            whether it ended; if not, it runs on, and may be waited for again

        Raises:
            RuntimeError: it failed
        """
        # Not zero: a wait without time left would fail at once.
        left = max(until - time.monotonic(), 0.01)
        if not self.threaded:
            try:
                work.wait(timeout=timedelta(seconds=left))
            except RuntimeError:
                if time.monotonic() < until:
                    raise
                return False
            return True
        pending = self.left.pop(id(work), None)
        if pending is None:
            if self.helper is None:
                self.helper = Helper()
            pending = self.helper.hand(work)
        if not pending.ended.wait(left):
            self.left[id(work)] = pending
            # The helper stays with it: the next operation goes to another.
            assert self.helper is not None
            self.helper.close()
            self.helper = None
            return False
        if pending.error is not None:
            raise pending.error
        return True

    def close(self) -> None:
        """Lets the helper end (its thread ends once its operation has, if ever)."""
        if self.helper is not None:
            self.helper.close()
            self.helper = None


class Timers:
    """One daemon thread, per process, that calls functions at given times.

    Shared by every step: a step registers its deadline without starting a
    thread (which, on a loaded machine, waits to be scheduled), and wakes
    the thread only if its deadline comes before every other.
    """

    def __init__(self) -> None:
        self.condition = threading.Condition()
        self.heap: List[Tuple[float, int, Callable[[], None]]] = []
        self.count = itertools.count()
        self.pid = -1

    def at(self, when: float, fn: Callable[[], None]) -> None:
        """Calls ``fn`` at ``when`` (by ``time.monotonic()``), in the thread."""
        with self.condition:
            if self.pid != os.getpid():  # none yet, or forked since
                self.pid = os.getpid()
                self.heap.clear()
                threading.Thread(target=self.run, name='torchgpipe-timers', daemon=True).start()
            heapq.heappush(self.heap, (when, next(self.count), fn))
            if self.heap[0][2] is fn:
                self.condition.notify()

    def run(self) -> None:
        while True:
            with self.condition:
                while not self.heap or self.heap[0][0] > time.monotonic():
                    self.condition.wait(self.heap[0][0] - time.monotonic() if self.heap else None)
                _, _, fn = heapq.heappop(self.heap)
            try:
                fn()
            except Exception:  # the step's thread meets the failure itself
                pass


TIMERS = Timers()


class Watch:
    """Keeps the deadline of a step whose thread waits without a timeout.

    Args:
        deadline: when the step times out, by ``time.monotonic()``
        grace: how long the step's thread may wait on after the deadline
            for the word of the rank it waits for
        alarm: called at the deadline (in the timers' thread) with what the
            step's thread waits for then (see :meth:`block`), while it waits
        group: the process group whose connections end a wait
    """

    def __init__(self, deadline: float, grace: float, alarm: Callable[[Any], None],
                 group: Optional[dist.ProcessGroup]) -> None:
        self.deadline = deadline
        self.grace = grace
        self.alarm: Optional[Callable[[Any], None]] = alarm
        self.group = group
        self.lock = threading.Lock()
        #: What the step's thread waits for without a timeout, and from which rank.
        self.blocked: Optional[Any] = None
        self.rank = -1
        #: Whether the deadline has passed (then waits are bounded).
        self.expired = False
        #: Whether the watch closed the connections.
        self.closed = False
        TIMERS.at(deadline, self.expire)

    def block(self, rank: int, what: Any) -> bool:
        """Before a wait without a timeout for ``rank``; ``what``: for ``alarm``
        (``None``: close the connections at the deadline, without grace).

        Returns:
            ``False`` if the deadline has passed: then wait until a deadline instead
        """
        with self.lock:
            if self.expired or time.monotonic() >= self.deadline:
                return False
            self.blocked, self.rank = (what,), rank
            return True

    def unblock(self) -> None:
        with self.lock:
            self.blocked = None

    def end(self) -> None:
        """The step is over: the watch does nothing more, and holds nothing."""
        with self.lock:
            self.expired = True
            self.alarm = None
            self.group = None

    def expire(self) -> None:
        with self.lock:
            if self.expired:
                return
            self.expired = True
            if self.blocked is None:
                return
            what = self.blocked[0]
            if what is None:
                self.close()
                return
            assert self.alarm is not None
            self.alarm(what)
        TIMERS.at(time.monotonic() + self.grace, self.end_grace)

    def end_grace(self) -> None:
        with self.lock:
            if self.blocked is not None and self.alarm is not None:
                self.close()

    def close(self) -> None:
        """Closes the connections of the group, ending the waits of the step's thread.

        A wait given a timeout that passes closes them (see the module's
        docstring): a receive from the rank waited for is posted and given
        a millisecond. Should a message come instead, another is posted.
        """
        self.closed = True
        for _ in range(100):
            buffer = torch.empty(1, dtype=torch.uint8)
            try:
                work = dist.irecv(buffer, self.rank, group=self.group)
                assert work is not None
                work.wait(timeout=timedelta(milliseconds=1))
            except RuntimeError:
                return

"""Channels: words and tensors between the ranks of a pipeline, as torch.distributed sends them.

Tensors go at their exact size, one ``isend``/``irecv`` each (``batch_isend_irecv`` where
several go at once), the same operations on gloo and NCCL. Words (a step's start and end,
a failure) are JSON, on a gloo group of their own, heard by :class:`Watchers`::

    rank 0  ── tensor (tensor group) ── tensor ── word "done" (word group) ──► rank 1
    rank 1  waits for a tensor in its own thread, until its deadline; a thread hears the words

A gloo wait cannot be interrupted, and one that times out closes its connection: in the
tensor group alone, so the words still go. A failing rank ends the others' waits by closing
its connections (:meth:`Channels.abandon`).

The pipelines of a process over the same group share their channels (:func:`channels_for`):
torch.distributed keeps a process group, and its threads, until the process ends (and
destroying one lets the next new group take its name, and read its stale addresses), so a
process that builds pipeline after pipeline (the planner builds dozens) holds two groups,
not two per pipeline. Their steps run one at a time; a failed step retires the channels.
"""
import json
import math
import queue
import threading
import time
import weakref
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor

from torchgpipe.transport.codec import DTYPES, NAMES, Unreadable
from torchgpipe.transport.faults import Disconnected, TimedOut

__all__: List[str] = []

#: The largest word, in bytes: a word's receive buffer, fixed.
WORD_LIMIT = 1 << 16

#: The shape and type of each tensor of a message, as both ends describe it.
Metas = List[Any]


def metas_of(tensors: Sequence[Tensor]) -> Metas:
    return [[list(t.shape), NAMES[t.dtype]] for t in tensors]


class Watchers:
    """Threads that wait for the receives of words, each reporting to one queue when it
    ends. A thread left waiting for an operation that never ends (its peer is gone) stays
    with it; the others serve the next operations."""

    def __init__(self) -> None:
        # What ended: (tag, error or None), in the order they ended.
        self.ended: 'queue.SimpleQueue[Tuple[Any, Optional[BaseException]]]' = queue.SimpleQueue()
        self.idle: List['queue.SimpleQueue[Optional[Tuple[dist.Work, Any]]]'] = []
        self.lock = threading.Lock()
        weakref.finalize(self, end_threads, self.idle)  # idle threads end with the watchers

    def watch(self, work: dist.Work, tag: Any) -> None:
        """Waits for ``work`` in a thread, which then reports ``tag`` to ``ended``."""
        with self.lock:
            jobs = self.idle.pop() if self.idle else None
        if jobs is None:
            jobs = queue.SimpleQueue()
            threading.Thread(target=serve, args=(jobs, self.ended, self.idle, self.lock),
                             name='torchgpipe-wait', daemon=True).start()
        jobs.put((work, tag))


def serve(jobs: 'queue.SimpleQueue[Optional[Tuple[dist.Work, Any]]]',
          ended: 'queue.SimpleQueue[Tuple[Any, Optional[BaseException]]]',
          idle: List[Any], lock: threading.Lock) -> None:
    for work, tag in iter(jobs.get, None):
        error: Optional[BaseException] = None
        try:
            work.wait()
        except BaseException as exc:
            error = exc
        del work  # it holds no operation, which holds its tensor, while it idles
        ended.put((tag, error))
        with lock:
            idle.append(jobs)


def end_threads(idle: List[Any]) -> None:
    for jobs in idle:
        jobs.put(None)


class Received(NamedTuple):
    """Tensors posted to be received (or sent), with their operations."""

    tensors: List[Tensor]
    works: List[dist.Work]


class Channels:
    """Words and tensors to and from the other ranks (global ``ranks``) of pipelines,
    received on ``device``, tensors on ``backend`` and words on gloo, on process groups of
    their own: the operations a failed step leaves never meet the user's, and ending them
    (:meth:`abandon`) leaves the user's groups whole."""

    def __init__(self, device: torch.device, ranks: List[int], backend: str) -> None:
        self.device = device
        #: Held by the step using the channels (see :meth:`using`).
        self.busy = threading.Lock()
        #: Whether a failed step closed the connections (:meth:`abandon`).
        self.abandoned = False
        #: The default group they were made under (a new one after a restart of it).
        self.world = dist.group.WORLD
        self.group = dist.new_group(ranks, backend=backend, use_local_synchronization=True)
        # Apart from the tensors': a tensor wait that times out closes its connection.
        self.words = dist.new_group(ranks, backend='gloo', use_local_synchronization=True)
        self.others = [r for r in ranks if r != dist.get_rank()]
        self.tag, self.word_tag = 0, 1
        #: Whether waits are stream waits, which never block (NCCL).
        self.streamed = backend == 'nccl'
        self.watchers = Watchers()
        #: Sends in flight to each rank, and what they send (kept until they end).
        self.sending: Dict[int, Received] = {}
        #: Words posted to be received, by tag ``('word', rank, n)``, and the buffers
        #: of words read, for the next (a step's peak holds none anew).
        self.posted_words: Dict[Any, bytearray] = {}
        self.word_buffers: List[bytearray] = []
        #: Receives of each rank's next words, posted and not watched yet (between steps).
        self.ahead: Dict[int, List[Tuple[dist.Work, bytearray]]] = {}
        self.count = 0

    def send(self, rank: int, tensors: Sequence[Tensor], word: bool = False) -> Received:
        """Sends each tensor at its exact size (a ``word``'s bytes as words go), without
        waiting; returns these sends."""
        sent = [wired(t) for t in tensors if t.numel()]
        group, tag = (self.words, self.word_tag) if word else (self.group, self.tag)
        these = Received(sent, operations(dist.isend, sent, rank, group, tag))
        sending = self.sending.setdefault(rank, Received([], []))
        sending.tensors.extend(sent)
        sending.works.extend(these.works)
        return these

    def post(self, rank: int, metas: Metas) -> Received:
        """Posts the receives of tensors of ``metas`` from ``rank``."""
        tensors = [torch.empty(shape, dtype=DTYPES[dtype], device=self.device)
                   for shape, dtype in metas]
        return Received(tensors, operations(dist.irecv, [t for t in tensors if t.numel()],
                                            rank, self.group, self.tag))

    def send_word(self, rank: int, word: Any) -> Received:
        """Sends ``word`` (JSON data) to ``rank``, without waiting; returns its send."""
        data = json.dumps(word, separators=(',', ':')).encode()
        assert len(data) <= WORD_LIMIT, 'words are bounded: errors cut, the input a digest'
        framed = bytearray(len(data).to_bytes(8, 'little') + data)
        return self.send(rank, [torch.frombuffer(framed, dtype=torch.uint8)], word=True)

    def post_words(self, rank: int, n: int) -> None:
        """Posts the receives of ``rank``'s next ``n`` words, for :meth:`expect_word` to watch."""
        for _ in range(n):
            data = self.word_buffers.pop() if self.word_buffers else bytearray(8 + WORD_LIMIT)
            work, = operations(dist.irecv, [torch.frombuffer(data, dtype=torch.uint8)], rank,
                               self.words, self.word_tag)
            self.ahead.setdefault(rank, []).append((work, data))

    def expect_word(self, rank: int) -> None:
        """Watches the receive of the next word from ``rank``, posted ahead or now."""
        if not self.ahead.get(rank):
            self.post_words(rank, 1)
        work, data = self.ahead[rank].pop(0)
        self.count += 1
        self.posted_words[('word', rank, self.count)] = data
        self.watchers.watch(work, ('word', rank, self.count))

    def expects_word(self, rank: int) -> bool:
        """Whether a receive of a word from ``rank`` is posted and has not ended."""
        return any(tag[1] == rank for tag in self.posted_words)

    def wait(self, received: Received, until: Optional[float], words: bool = False) -> None:
        """Waits for ``received``'s operations in this thread, by ``until``
        (``time.monotonic()``, or ``None``): ``TimedOut`` past it (gloo closes that
        connection), ``Disconnected`` if it broke. For tensors on NCCL, the current stream
        waits (``words`` are on gloo)."""
        try:
            for work in received.works:
                if until is None or (self.streamed and not words):
                    work.wait()
                else:  # whole milliseconds, above 0, which would be gloo's default timeout
                    work.wait(timeout=timedelta(milliseconds=max(
                        math.ceil((until - time.monotonic()) * 1000), 1)))
        except RuntimeError as exc:
            if until is not None and time.monotonic() >= until:
                raise TimedOut(str(exc)) from None
            raise Disconnected(str(exc)) from exc

    def next_event(self, until: Optional[float]) -> Tuple[str, Any, Any]:
        """The next word received by ``until`` (``time.monotonic()``, or ``None``):
        ``('word', rank, word)`` or ``('lost', rank, error)``; ``TimedOut`` if none by
        then, ``Unreadable`` if a word is none this library sends."""
        try:
            tag, error = self.watchers.ended.get(
                timeout=None if until is None else max(until - time.monotonic(), 0.0))
        except queue.Empty:
            raise TimedOut('nothing by the deadline') from None
        data = self.posted_words.pop(tag)
        if error is not None:
            return 'lost', tag[1], error
        word = read_word(data, tag[1])
        self.word_buffers.append(data)
        return 'word', tag[1], word

    def sent(self) -> Dict[int, Received]:
        """The sends to each rank since the last call: each ends once its receive is posted."""
        sending, self.sending = self.sending, {}
        return sending

    @contextmanager
    def using(self) -> Iterator[None]:
        """Holds the channels for one step: ``RuntimeError`` if another step holds them (in
        another thread, or the step whose layer runs this one), whose messages this step's
        would take."""
        if not self.busy.acquire(blocking=False):
            raise RuntimeError('another pipeline over the same group is running a step in this '
                               'process: pipelines over the same group share their '
                               'connections, so run their steps one after another')
        try:
            yield
        finally:
            self.busy.release()

    def abandon(self) -> None:
        """After a failed step, closes the channels' connections (a gloo wait given a
        timeout that passes closes its own): the others' waits for this rank end, and so
        do the watchers' here, which no word may end (else destroying the groups would
        abort the process, a thread inside a wait). The next pipeline over these ranks
        opens new channels."""
        self.abandoned = True
        for rank in self.others if not self.streamed else ():
            for group in (self.group, self.words):
                try:
                    work, = operations(dist.irecv, [torch.empty(1)], rank, group, 1 << 30)
                    work.wait(timeout=timedelta(milliseconds=1))
                except (RuntimeError, Disconnected):
                    pass


#: The channels of each process group (``None``: the default one) and device, shared by the
#: pipelines over it.
SHARED: Dict[Tuple[Optional[dist.ProcessGroup], str], Channels] = {}
SHARED_LOCK = threading.Lock()


def whole(group: Optional[dist.ProcessGroup], device: torch.device) -> bool:
    """Whether this process has channels of pipelines over ``group`` on ``device`` that no
    failed step closed, of the process group torch.distributed runs now."""
    channels = SHARED.get((group, str(device)))
    return channels is not None and not channels.abandoned and channels.world is dist.group.WORLD


def channels_for(group: Optional[dist.ProcessGroup], device: torch.device, ranks: List[int],
                 backend: str, fresh: bool) -> Channels:
    """The channels of the pipelines over ``group`` (global ``ranks``): those of the
    pipelines built before, or new ones if ``fresh``, which every rank of the group agreed
    on (some rank had none :func:`whole`): making them is a collective call."""
    with SHARED_LOCK:
        key = (group, str(device))
        if fresh or key not in SHARED:
            SHARED[key] = Channels(device, ranks, backend)
        return SHARED[key]


def read_word(data: bytearray, rank: int) -> Any:
    """The word in a received buffer, its length then JSON; ``Unreadable`` if it is not
    a word this library writes."""
    length = int.from_bytes(data[:8], 'little')
    if not 0 < length <= WORD_LIMIT:
        raise Unreadable(f'a word of {length} bytes from rank {rank}')
    try:
        return json.loads(bytes(data[8:8 + length]).decode())
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise Unreadable(f'a word from rank {rank} is not JSON: {exc}') from exc


def host_bytes(tensor: Tensor) -> bytes:
    """A ``uint8`` tensor's bytes, on the host (through torch alone: no NumPy)."""
    data = bytearray(tensor.numel())
    if data:
        torch.frombuffer(data, dtype=torch.uint8).copy_(tensor)
    return bytes(data)


def wired(tensor: Tensor) -> Tensor:
    """``tensor``'s values as they are sent: itself if it can be, else a contiguous
    copy (the bytes of a conjugate or negative view are not its values)."""
    return tensor.detach().resolve_conj().resolve_neg().contiguous()


def operations(op: Any, tensors: List[Tensor], rank: int, group: Optional[dist.ProcessGroup],
               tag: int) -> List[dist.Work]:
    """Starts ``op`` (``isend`` or ``irecv``) of each tensor with ``rank``, as a batch if
    several; ``Disconnected`` if the connection is broken."""
    try:
        if len(tensors) > 1:
            return dist.batch_isend_irecv([dist.P2POp(op, t, rank, group, tag) for t in tensors])
        return [cast(dist.Work, op(t, rank, group=group, tag=tag)) for t in tensors]
    except RuntimeError as exc:
        raise Disconnected(str(exc)) from exc

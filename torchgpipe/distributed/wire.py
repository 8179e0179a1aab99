"""The wire: a training step's messages between partitions in different processes.

:class:`~torchgpipe.train.step.Step` sends and takes its messages through a
:class:`~torchgpipe.train.mailbox.Mailbox`. :class:`Wire` is the mailbox of
the partitions of one process, whose neighbours may live in other processes:
a message to another rank is described with its key in a header of data
alone (:mod:`torchgpipe.distributed.codec`), its tensors apart, and sent
with torch.distributed's point-to-point operations as one buffer
(:class:`Channels`); a message between two partitions of this process (two
virtual stages of one rank) stays in the mailbox.

Sends never wait (``isend``): a rank only waits for what it needs, so a
schedule that :meth:`~torchgpipe.schedules.Schedule.check` accepts runs
without deadlock. Between two ranks, messages arrive in the order they were
sent, whatever the backend (NCCL has no tags), which need not be the order
the receiving rank takes them in (with several partitions per rank, or a
schedule of one's own). So every message carries its key, and a rank
waiting for one key keeps the messages that come before it, by key, for
the actions that will take them::

    rank 0 sends    Activation(0, 1)  Activation(0, 3)  Gradient(0, 1)
    rank 1 takes    Activation(0, 1)  Gradient(0, 1)    Activation(0, 3)
                                      ▲ receives Activation(0, 3) first: kept
"""
import time
from datetime import timedelta
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor

from torchgpipe.distributed.blocks import Blocks
from torchgpipe.distributed.faults import (Disconnected, PeerFailed, TimedOut, disconnected,
                                           lost, waiting_for)
from torchgpipe.distributed.codec import Unreadable, decode, dump_header, encode, load_header
from torchgpipe.train.mailbox import (Activation, Gradient, Key, Mailbox, Skip, SkipGradient,
                                      SkipKey)

__all__: List[str] = []

#: The route of a skip, (the partition that stashes it, the one that pops it).
Route = Tuple[int, int]


class Mismatch(ValueError):
    """The ranks of a pipeline were called for different steps."""


#: The capacity a channel starts with, in bytes: enough for a message without tensors.
SMALL = 4096


class Wire(Mailbox):
    """The mailbox of this process's partitions, whose neighbours may be in other processes.

    Args:
        channels: the channels to the other ranks
        ranks: the global rank of each partition
        me: the global rank of this process
        routes: the route of each skip that crosses partitions, by key
    """

    def __init__(self, channels: 'Channels', ranks: Sequence[int], me: int,
                 routes: Dict[SkipKey, Route]) -> None:
        super().__init__()
        self.channels = channels
        self.ranks = ranks
        self.me = me
        self.routes = routes
        #: Every other rank of the pipeline, once.
        self.others = [r for r in dict.fromkeys(ranks) if r != me]
        #: The skips by index, which every rank numbers alike (in the order of
        #: the layers), while a skip's namespace differs from process to process.
        self.skips = list(routes)
        self.index = {key: k for k, key in enumerate(self.skips)}

    def ends(self, key: Key) -> Route:
        """The partitions a message goes from and to."""
        if isinstance(key, Activation):
            return key.j - 1, key.j
        if isinstance(key, Gradient):
            return key.j + 1, key.j
        a, b = self.routes[key.key]
        return (a, b) if isinstance(key, Skip) else (b, a)

    def encode(self, key: Key) -> Any:
        """A key as it travels: a skip's by the skip's index."""
        if isinstance(key, (Skip, SkipGradient)):
            return (type(key).__name__, key.i, self.index[key.key])
        return key

    def decode(self, wired: Any) -> Key:
        if isinstance(wired, tuple):
            kind, i, k = wired
            return (Skip if kind == 'Skip' else SkipGradient)(i, self.skips[k])
        return cast(Key, wired)

    def put(self, key: Key, message: Any) -> None:
        j = self.ends(key)[1]
        rank = self.ranks[j]
        if rank == self.me:
            super().put(key, message)
        else:
            with lost(rank, j, 'sending it a message'):
                self.channels.send(rank, 'message', (self.encode(key), message))

    def take(self, key: Key) -> Any:
        source = self.ends(key)[0]
        if self.ranks[source] == self.me or self.has(key):
            return super().take(key)
        while True:
            wired, message = self.receive(source, waiting_for(key))
            received = self.decode(wired)
            if received == key:
                return message
            # Sent before, for an action of this process still to come.
            super().put(received, message)

    def has(self, key: Key) -> bool:
        with self._condition:
            return key in self._messages

    def receive(self, j: int, doing: str) -> Any:
        """Waits for the next message from the rank of partition ``j``; ``doing``
        says what for, if it never comes.

        Raises:
            PeerFailed: that rank failed, or the connection to it broke
            StepTimeout: it sent nothing by the step's deadline
        """
        rank = self.ranks[j]
        with lost(rank, j, doing):
            kind, message = self.channels.receive(rank)
        if kind == 'failure':
            raise PeerFailed(f'rank {rank} (partition {j}) failed: {message}')
        return message

    def finish(self, result: Any, shares: Optional[Dict[int, Any]] = None,
               ) -> Tuple[Any, Dict[int, Any]]:
        """Ends the step on every rank: returns what the last partition's rank
        sends everyone (a training step's loss).

        Each rank tells every other that it is done (the last partition's,
        with ``result``), then waits for the word of every other rank, and
        for its own sends to arrive. The word may carry more:
        ``shares[rank]`` to each rank (the gradients of tied parameters, say).

        Returns:
            the last partition's ``result``, and what each other rank's word carried

        Raises:
            PeerFailed: another rank failed in this step
        """
        shares = shares or {}
        for rank in self.others:
            with lost(rank, self.ranks.index(rank), 'sending it the end of the step'):
                self.channels.send(rank, 'message', (None, (result, shares.get(rank))))
        received: Dict[int, Any] = {}
        for rank in self.others:
            _, (sent, received[rank]) = self.receive(self.ranks.index(rank),
                                                     'waiting for the end of the step')
            if rank == self.ranks[-1]:
                result = owned(sent)
        # Every rank has said it is done: a send failing now failed on the way.
        with lost(None, None, "waiting for this rank's messages to arrive"):
            self.channels.wait_sent()
        self.channels.blocks.trim()
        return result, received

    def agree(self, signature: Any) -> None:
        """Starts a step: every rank tells every other what step it runs (the
        sizes of its micro-batches, the schedule), before any of its messages.

        Raises:
            Mismatch: the ranks run different steps; every rank raises it,
                and the pipeline stays whole
            PeerFailed, StepTimeout: as :meth:`receive`
        """
        for rank in self.others:
            with lost(rank, self.ranks.index(rank), 'sending it the start of the step'):
                self.channels.send(rank, 'message', (None, signature))
        others = {rank: self.receive(self.ranks.index(rank), 'waiting for the start of the '
                                     'step')[1] for rank in self.others}
        if any(theirs != signature for theirs in others.values()):
            # Every rank has received this one's word: its buffers may go
            # back to the pool, for the next step's messages.
            with lost(None, None, "waiting for this rank's messages to arrive"):
                self.channels.wait_sent()
            steps = '; '.join(f'rank {rank}: {step}' for rank, step in
                              sorted({self.me: signature, **others}.items()))
            raise Mismatch(f'the ranks of the pipeline run different steps ({steps}); give '
                           'every rank the same mini-batch, chunks and schedule')

    def fail(self, error: BaseException) -> None:
        """Tells every other rank that this one failed, so none waits for it forever.

        The sends and receives in flight are never waited for: the step is
        over, and so is this pipeline (its ranks would not agree on which
        messages are left). The caller keeps ``channels`` alive, so that
        their buffers outlive them.
        """
        description = f'{type(error).__name__}: {error}'
        for rank in self.others:
            try:
                self.channels.send(rank, 'failure', description)
            except Disconnected:
                pass  # that rank is gone already


class Channels:
    """Messages to and from the other ranks of a group, each pair of ranks one ordered channel.

    A message is one buffer of bytes: the length of its header (the kind,
    the shape and type of each tensor, the message with its tensors taken
    out, in JSON: :mod:`~torchgpipe.distributed.codec`), the header, then
    the tensors' bytes, each at an offset aligned for its type (the received
    tensors are views of the buffer)::

        | length | header | pad | tensor 0 | pad | tensor 1 | ...

    A message is received when the step needs it. Not knowing its size, the
    receiving rank receives into a buffer of the channel's *capacity*, which
    both ends know: a message larger than it is preceded by a message that
    raises it. NCCL, unlike gloo, receives only messages of the buffer's
    exact size: for it every message is padded to the capacity. On the CPU, buffers are blocks of a
    pool (:class:`~torchgpipe.distributed.blocks.Blocks`), reused once the
    tensors viewing them are gone; on a GPU, the caching allocator reuses
    memory the same way.

    Args:
        device: where buffers are (received tensors, and what NCCL sends)
        group: the process group
        capacities: the capacity of each channel, by global rank, kept by the
            caller from step to step (both ends change it alike)
        blocks: the pool of CPU buffers, kept by the caller from step to step
        timeout: the step timeout, in seconds: every wait ends by then
            (``None``: the process group's timeout, for each wait)
    """

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup],
                 capacities: Dict[int, int], blocks: Blocks,
                 timeout: Optional[float] = None) -> None:
        self.device = device
        self.timeout = timeout
        #: When the step times out, by ``time.monotonic()``.
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.group = group
        self.capacities = capacities
        self.blocks = blocks
        self.exact = dist.get_backend(group) == 'nccl'
        #: Sends in flight, with what they send.
        self.sending: List[Tuple[Any, Tensor]] = []
        #: The buffer of the receive in flight, if any.
        self.receiving: Optional[Tensor] = None

    def capacity(self, rank: int) -> int:
        return self.capacities.setdefault(rank, SMALL)

    def send(self, rank: int, kind: str, message: Any) -> None:
        """Sends ``message`` to ``rank``, without waiting.

        Raises:
            Unsendable: the message holds a value a header cannot describe
        """
        tensors: List[Tensor] = []
        data = dump_header(kind, tensors, encode(message, tensors))
        offsets = []
        end = align(8 + len(data))
        for t in tensors:
            offsets.append(end)
            end = align(end + t.numel() * t.element_size())
        if end > self.capacity(rank):
            # It fits the buffer of the old capacity the receiver takes it in.
            self.post_send(rank, self.pack(dump_header('grow', [], end), rank))
            self.capacities[rank] = end
        buffer = self.pack(data, rank, end)
        for t, offset in zip(tensors, offsets):
            view(buffer, offset, t.shape, t.dtype).copy_(t.detach())
        self.post_send(rank, buffer)

    def pack(self, data: bytes, rank: int, size: int = 0) -> Tensor:
        """A buffer starting with ``data``'s length and ``data``, of ``size`` bytes at least."""
        size = self.capacity(rank) if self.exact else max(size, align(8 + len(data)))
        buffer = self.buffer(size)
        head = bytearray(len(data).to_bytes(8, 'little') + data)
        buffer[:len(head)].copy_(torch.frombuffer(head, dtype=torch.uint8))
        return buffer

    def buffer(self, size: int) -> Tensor:
        """An uninitialized buffer of ``size`` bytes on the device."""
        if self.device.type == 'cpu':
            return self.blocks.take(size)
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def post_send(self, rank: int, buffer: Tensor) -> None:
        with disconnected():
            work = dist.isend(buffer, rank, group=self.group)
        self.sending.append((work, buffer))

    def receive(self, rank: int) -> Tuple[str, Any]:
        """Waits for the next message from ``rank``; returns its kind and the message.

        Raises:
            Disconnected: the connection broke (TimedOut: the step timed out)
        """
        # Not received ahead of time, while the rank computes: on CPU ranks
        # the transfer then takes a core from the computation, and measured
        # 1F1B steps 7-10 % slower (docs/scaling_out.rst, "Measured").
        while True:
            buffer = self.buffer(self.capacity(rank))
            # Kept while the receive may still write it: after a timeout,
            # the abandoned channels keep it (see DistributedGPipe).
            self.receiving = buffer
            with disconnected():
                self.wait(dist.irecv(buffer, rank, group=self.group))
            self.receiving = None
            try:
                kind, tensors, body = self.parse(buffer)
            except Unreadable as exc:
                raise Unreadable(f'a message from rank {rank} is none this library writes '
                                 f'({exc}); only the ranks of the pipeline may reach its ports'
                                 ) from exc
            if kind != 'grow':
                break
            self.capacities[rank] = body
        try:
            return kind, decode(body, tensors, self.device)
        except Unreadable as exc:
            raise Unreadable(f'a message from rank {rank} holds what no rank sends ({exc})'
                             ) from exc

    def parse(self, buffer: Tensor) -> Tuple[str, List[Tensor], Any]:
        """A received message's kind, its tensors (views of ``buffer``) and its encoded body.

        Raises:
            Unreadable: the buffer holds no message of this library
        """
        length = int.from_bytes(read(buffer, 0, 8), 'little')
        if not 0 < length <= buffer.numel() - 8:
            raise Unreadable(f'a header of {length} bytes, in {buffer.numel()}')
        kind, metas, body = load_header(bytes(read(buffer, 8, 8 + length)))
        if kind not in ('message', 'failure', 'grow') or \
                kind == 'grow' and not (isinstance(body, int) and body > 0):
            raise Unreadable(f'a message of kind {kind!r}'[:200])
        tensors = []
        offset = align(8 + length)
        for shape, dtype in metas:
            numel = 1
            for size in shape:
                numel *= size
            end = offset + numel * dtype.itemsize
            if end > buffer.numel():
                raise Unreadable(f'a tensor to byte {end}, in {buffer.numel()}')
            tensors.append(view(buffer, offset, shape, dtype))
            offset = align(end)
        return kind, tensors, body

    def wait_sent(self) -> None:
        """Waits for every send to arrive."""
        for work, _ in self.sending:
            with disconnected():
                self.wait(work)
        self.sending.clear()

    def wait(self, work: Optional[dist.Work]) -> None:
        """Waits for a point-to-point operation to end, until the step's deadline.

        Raises:
            TimedOut: the deadline passed (gloo then closes the connection)
            RuntimeError: the operation failed
        """
        assert work is not None
        if self.deadline is None:
            work.wait()
            return
        left = self.deadline - time.monotonic()
        try:
            # Not zero: a wait without time left would fail at once.
            work.wait(timeout=timedelta(seconds=max(left, 0.001)))
        except RuntimeError as exc:
            if time.monotonic() < self.deadline:
                raise
            raise TimedOut(str(exc), cast(float, self.timeout)) from exc


def owned(message: Any) -> Any:
    """``message`` with each tensor copied, in tuples and lists too.

    A received tensor is a view of its message's buffer: one that outlives
    the step (a loss kept for logging) must not hold the buffer, which the
    pool gives to later messages.
    """
    if isinstance(message, Tensor):
        return message.clone()
    if type(message) in (tuple, list):
        return type(message)(owned(x) for x in message)
    return message


def align(offset: int) -> int:
    """``offset`` rounded up to a multiple of 64 bytes, which suits any type's alignment."""
    return -(-offset // 64) * 64


def read(buffer: Tensor, start: int, stop: int) -> bytearray:
    """A copy of ``buffer``'s bytes from ``start`` to ``stop``, on the host."""
    # Through torch alone: Tensor.numpy() would need numpy, which torch does not.
    data = bytearray(stop - start)
    torch.frombuffer(data, dtype=torch.uint8).copy_(buffer[start:stop])
    return data


def view(buffer: Tensor, offset: int, shape: Any, dtype: torch.dtype) -> Tensor:
    """The tensor of ``shape`` and ``dtype`` in ``buffer``'s bytes from ``offset``."""
    numel = 1
    for size in shape:
        numel *= size
    size = numel * torch.empty((), dtype=dtype).element_size()
    return buffer[offset:offset + size].view(dtype).view(shape)

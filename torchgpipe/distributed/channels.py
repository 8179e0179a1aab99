"""Channels: messages to and from the other ranks of a group, each a header and a payload.

The transport under :class:`~torchgpipe.distributed.wire.Wire`: a message
is two point-to-point operations of torch.distributed, its header
(:mod:`~torchgpipe.distributed.codec`) and its payload, the bytes of its
tensors; every wait ends by the step's deadline, leaving the connections
whole (:mod:`~torchgpipe.distributed.waiting`).
"""
import math
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor

from torchgpipe.distributed.blocks import Blocks
from torchgpipe.distributed.codec import (Unreadable, align, decode, dump_header, encode,
                                          load_header)
from torchgpipe.distributed.faults import TimedOut, disconnected
from torchgpipe.distributed.shared import Shared
from torchgpipe.distributed.waiting import Waiter, Watch

__all__: List[str] = []

#: The capacity a channel starts with, in bytes, for headers and for
#: payloads: enough for a message without tensors.
SMALL = 4096

#: The largest capacity a channel may grow to: a raise beyond it is no rank's.
LARGEST = 1 << 40

#: The capacities of a channel: of its headers, and of its payloads.
Capacity = Tuple[int, int]

#: A header, read (see Channels.parse): the message's kind, its tensors'
#: shapes, types and offsets in the payload, the payload's size, the body,
#: and where the payload is if not on its way (an arena's name and offset).
Header = Tuple[str, List[Tuple[List[int], torch.dtype, int]], int, Any, Any]


class Receiving(NamedTuple):
    """The two receives of a message from a rank, posted, with their buffers.

    The payload's is posted with the header's where its size is known
    ahead (the capacity), else once the header has come.
    """

    header: Any
    header_buffer: Tensor
    payload: Any = None
    payload_buffer: Optional[Tensor] = None
    #: The header, once it has come and been read (see Channels.parse).
    parsed: Optional[Header] = None


class Channels:
    """Messages to and from the other ranks of a group, each pair of ranks one ordered channel.

    A message is two buffers, sent one after the other::

        header:   | length | kind, each tensor's shape, type and offset, the message |
        payload:  | tensor 0 | pad | tensor 1 | ...                                   |

    The header is the message with its tensors taken out, in JSON
    (:mod:`~torchgpipe.distributed.codec`). The payload is the one tensor
    of a message that has one, sent as it is (no copy), or the tensors
    copied into one buffer, each at an offset aligned for its type; the
    received tensors are views of the payload's buffer. To a rank that
    reads this one's shared memory (:mod:`~torchgpipe.distributed.shared`),
    a message is its header alone: the payload is copied into an arena,
    whose name and offset the header gives, or, beyond the arena's limit,
    sent after the header; a message without tensors has none.

    The receiving rank does not know a message's sizes: it receives into
    buffers of the channel's *capacities*, which both ends know, and a
    message larger than them is preceded by one that raises them. Under
    gloo, which takes a message smaller than its buffer, a rank posts the
    two receives of the next message from a rank as soon as it has taken
    one (*ahead*), so that the next arrives while the rank computes. NCCL
    receives only messages of the buffer's exact size: a header is padded to
    the capacity, and a payload is received once its header gave its size.
    On the CPU, buffers are blocks of a pool
    (:class:`~torchgpipe.distributed.blocks.Blocks`), reused once the
    tensors viewing them are gone; on a GPU, the caching allocator reuses
    memory the same way.

    Args:
        device: where buffers are (received tensors, and what NCCL sends)
        group: the process group
        capacities: the capacities of the channel to and from each rank, by
            ``(global rank, to)``, kept by the caller from step to step
            (both ends change them alike)
        blocks: the pool of CPU buffers, kept by the caller from step to step
        shared: the arenas of shared memory, kept by the caller from step to step
        timeout: the step timeout, in seconds: every wait ends by then
            (``None``: the process group's timeout, for each wait)
    """

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup],
                 capacities: Dict[Tuple[int, bool], Capacity], blocks: Blocks,
                 shared: Shared, timeout: Optional[float] = None) -> None:
        self.device = device
        self.timeout = timeout
        #: When the step times out, by ``time.monotonic()``.
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.group = group
        self.capacities = capacities
        self.blocks = blocks
        self.exact = dist.get_backend(group) == 'nccl'
        self.shared = shared
        #: Whether payloads may go through shared memory (gloo's, from and to the CPU).
        self.sharing = not self.exact and device.type == 'cpu'
        #: Sends in flight, with what they send, and to whom.
        self.sending: List[Tuple[Any, Tensor, int]] = []
        #: The receives of the next message from each rank, posted ahead, or
        #: still running after a deadline (the next receive from that rank
        #: waits for them again). After a failed step, the abandoned channels
        #: keep them (see DistributedGPipe), as they may still write their buffers.
        self.pending: Dict[int, Receiving] = {}
        self.waiter = Waiter(threaded=not self.exact)
        #: Called at the deadline with the word of what this rank waits for then.
        self.alarm: Callable[[Any], None] = lambda word: None
        self.watch = None if self.deadline is None or self.exact else \
            Watch(self.deadline, cast(float, timeout), lambda word: self.alarm(word), group)

    def capacity(self, rank: int, to: bool) -> Capacity:
        """The capacities of the channel to ``rank`` (``to``) or from it."""
        return self.capacities.setdefault((rank, to), (SMALL, SMALL))

    def send(self, rank: int, kind: str, message: Any) -> None:
        """Sends ``message`` to ``rank``, without waiting.

        Raises:
            Unsendable: the message holds a value a header cannot describe
        """
        tensors: List[Tensor] = []
        body = encode(message, tensors)
        if rank in self.shared.readers:
            offsets, size = layout(tensors)
            placed = self.shared.place(rank, size) if size else None
            if placed is not None or not size:
                at = None
                if placed is not None:
                    name, start, room = placed
                    at = [name, start]
                    for t, offset in zip(tensors, offsets):
                        view(room, offset, t.shape, t.dtype).copy_(t.detach())
                self.post(rank, (self.fit(rank, dump_header(kind, tensors, offsets, size, body,
                                                            at), 0),))
                return
        payload, offsets = self.payload(tensors)
        header = dump_header(kind, tensors, offsets, payload.numel(), body)
        self.post(rank, (self.fit(rank, header, payload.numel()), payload))

    def fit(self, rank: int, header: bytes, payload: int) -> Tensor:
        """The buffer of ``header``, of a message whose payload has ``payload``
        bytes on the wire; the capacities to ``rank`` raised first if need be."""
        needs = (align(8 + len(header)), payload)
        capacity = self.capacity(rank, True)
        if needs[0] > capacity[0] or needs[1] > capacity[1]:
            # It fits the buffers of the old capacities the receiver takes it in.
            capacity = (max(needs[0], capacity[0]), max(needs[1], capacity[1]))
            if rank in self.shared.readers:
                self.post(rank, (self.header(dump_header('grow', [], [], 0, list(capacity)),
                                             rank),))
            else:
                self.post(rank, self.packed('grow', list(capacity), rank))
            self.capacities[rank, True] = capacity
        return self.header(header, rank)

    def payload(self, tensors: List[Tensor]) -> Tuple[Tensor, List[int]]:
        """The bytes of ``tensors`` in one buffer, and the offset of each.

        A lone contiguous tensor of this device is its own payload: sent as
        it is, without a copy (nothing of the step changes a tensor it sends
        in place, and the send is over before the step is).
        """
        if len(tensors) == 1:
            t = tensors[0].detach()
            if t.is_contiguous() and t.device == self.device and t.numel() > 0 and \
                    not t.is_conj() and not t.is_neg():
                return t.reshape(-1).view(torch.uint8), [0]
        offsets, end = layout(tensors)
        buffer = self.buffer(max(end, 1))  # a payload has a byte at least
        for t, offset in zip(tensors, offsets):
            view(buffer, offset, t.shape, t.dtype).copy_(t.detach())
        return buffer, offsets

    def packed(self, kind: str, body: Any, rank: int) -> Tuple[Tensor, Tensor]:
        """The header and the payload of a message without tensors."""
        return self.header(dump_header(kind, [], [], 1, body), rank), self.buffer(1)

    def header(self, data: bytes, rank: int) -> Tensor:
        """A header's buffer: ``data``'s length and ``data``, padded to the capacity for NCCL."""
        size = self.capacity(rank, True)[0] if self.exact else align(8 + len(data))
        buffer = self.buffer(size)
        head = bytearray(len(data).to_bytes(8, 'little') + data)
        buffer[:len(head)].copy_(torch.frombuffer(head, dtype=torch.uint8))
        return buffer

    def buffer(self, size: int) -> Tensor:
        """An uninitialized buffer of ``size`` bytes on the device."""
        if self.device.type == 'cpu':
            return self.blocks.take(size)
        return torch.empty(size, dtype=torch.uint8, device=self.device)

    def post(self, rank: int, message: Tuple[Tensor, ...]) -> None:
        """Sends a header and its payload (if any), in this order."""
        for buffer in message:
            with disconnected():
                work = dist.isend(buffer, rank, group=self.group)
            self.sending.append((work, buffer, rank))

    def receive(self, rank: int, until: Optional[float] = None, waiting: Any = None,
                ahead: bool = False) -> Tuple[str, Any]:
        """Waits for the next message from ``rank``, until ``until`` (by
        ``time.monotonic()``; default: the step's deadline, and the grace
        after it, if ``rank`` was still waited for then: see
        :class:`~torchgpipe.distributed.waiting.Watch`); returns its kind
        and the message. ``waiting``: the word to tell the others if the
        deadline passes during the wait. ``ahead``: whether ``rank`` sends
        another message in this step, whose receives are then posted.

        Raises:
            Disconnected: the connection broke (TimedOut: nothing came by
                then; the receive runs on, for the next from ``rank``)
        """
        while True:
            receiving = self.pending.pop(rank, None) or self.post_receive(rank)
            kind, tensors, body = self.take(rank, receiving, until, waiting)
            if kind != 'grow':
                break
            self.capacities[rank, False] = (body[0], body[1])
        if ahead and kind == 'message' and not self.exact:
            self.pending[rank] = self.post_receive(rank)
        try:
            return kind, decode(body, tensors, self.device)
        except Unreadable as exc:
            raise Unreadable(f'a message from rank {rank} holds what no rank sends ({exc})'
                             ) from exc

    def post_receive(self, rank: int) -> Receiving:
        """Posts the receives of the next message from ``rank``: its payload's too, if
        its size need not be exact and it comes on the wire."""
        header, payload = self.capacity(rank, False)
        header_buffer = self.buffer(header)
        with disconnected():
            work = dist.irecv(header_buffer, rank, group=self.group)
        if self.exact or rank in self.shared.sources:
            return Receiving(work, header_buffer)
        payload_buffer = self.buffer(payload)
        with disconnected():
            return Receiving(work, header_buffer,
                             dist.irecv(payload_buffer, rank, group=self.group), payload_buffer)

    def take(self, rank: int, receiving: Receiving, until: Optional[float], waiting: Any,
             ) -> Tuple[str, List[Tensor], Any]:
        """Waits for a message's header and payload; returns its kind, its tensors
        (views of the payload) and its encoded body.

        Raises:
            TimedOut: as :meth:`receive`; the receives are kept for the next
            Unreadable: the header is none this library writes
        """
        if receiving.parsed is None:
            try:
                with disconnected():
                    self.wait(receiving.header, until, rank, waiting)
            except TimedOut:
                self.pending[rank] = receiving
                raise
            try:
                receiving = receiving._replace(parsed=self.parse(receiving.header_buffer))
            except Unreadable as exc:
                # Its payload's receive may still write its buffer: kept.
                self.pending[rank] = receiving
                raise Unreadable(f'a message from rank {rank} is none this library writes '
                                 f'({exc}); only the ranks of the pipeline may reach its '
                                 'ports') from exc
        kind, metas, size, body, at = cast(Header, receiving.parsed)
        if at is not None or size == 0:
            payload = self.unwired(rank, receiving, size, at)
        else:
            payload = self.wired(rank, receiving, size, until, waiting)
        tensors = []
        for shape, dtype, offset in metas:
            if offset % dtype.itemsize or offset + math.prod(shape) * dtype.itemsize > min(
                    size, payload.numel()):
                raise Unreadable(f'a message from rank {rank} has a tensor beyond its payload '
                                 'or misaligned in it')
            tensors.append(view(payload, offset, shape, dtype))
        return kind, tensors, body

    def unwired(self, rank: int, receiving: Receiving, size: int, at: Any) -> Tensor:
        """The payload of a message from ``rank`` whose header came alone: none
        (``size`` 0), or copied out of an arena ``at`` (its name and offset).

        Raises:
            Unreadable: ``rank`` sends payloads on the wire, or no such arena
        """
        if receiving.payload is not None or rank not in self.shared.sources:
            if receiving.payload is not None:
                self.pending[rank] = receiving  # its receive may still write its buffer
            raise Unreadable(f'a message from rank {rank} without its payload, where '
                             'its channel carries every payload')
        # Read first: the arena bounds the size, which sizes the buffer.
        source = None if at is None else self.shared.read(rank, at[0], at[1], size)
        buffer = self.buffer(max(size, 1))
        if source is not None:
            buffer[:size].copy_(source)
        return buffer

    def wired(self, rank: int, receiving: Receiving, size: int, until: Optional[float],
              waiting: Any) -> Tensor:
        """Waits for the payload of a message from ``rank``, of ``size`` bytes,
        receiving it once its header has come, if not posted ahead.

        Raises:
            TimedOut: as :meth:`receive`; the receives are kept for the next
            Unreadable: it is beyond the channel's capacity
        """
        if size > self.capacity(rank, False)[1]:
            # A sender raises the capacity first: no rank of the pipeline sent it.
            raise Unreadable(f'a message from rank {rank} has a payload of {size} bytes, '
                             'beyond its channel\'s capacity')
        if receiving.payload is None:
            buffer = self.buffer(size)
            with disconnected():
                receiving = receiving._replace(
                    payload=dist.irecv(buffer, rank, group=self.group), payload_buffer=buffer)
        try:
            with disconnected():
                self.wait(receiving.payload, until, rank, waiting)
        except TimedOut:
            self.pending[rank] = receiving  # its header read: the payload is left
            raise
        return cast(Tensor, receiving.payload_buffer)

    def parse(self, buffer: Tensor) -> Header:
        """A received header's kind, its tensors' shapes, types and offsets, the
        payload's size, and the encoded body.

        Raises:
            Unreadable: the buffer holds no header of this library
        """
        length = int.from_bytes(read(buffer, 0, 8), 'little')
        if not 0 < length <= buffer.numel() - 8:
            raise Unreadable(f'a header of {length} bytes, in {buffer.numel()}')
        kind, metas, size, body, at = load_header(bytes(read(buffer, 8, 8 + length)))
        if kind not in ('message', 'failure', 'grow') or kind == 'grow' and not (
                isinstance(body, list) and len(body) == 2
                and all(type(x) is int and SMALL <= x <= LARGEST for x in body)):
            raise Unreadable(f'a message of kind {kind!r}'[:200])
        return kind, metas, size, body, at

    def wait_sent(self) -> None:
        """Waits for every send to arrive."""
        for work, _, rank in self.sending:
            with disconnected():
                self.wait(work, rank=rank)
        self.sending.clear()

    def wait(self, work: Optional[dist.Work], until: Optional[float] = None, rank: int = -1,
             waiting: Any = None) -> None:
        """Waits for a point-to-point operation with ``rank`` to end, until
        ``until`` (default: the step's deadline), leaving the connections
        whole until then (:mod:`~torchgpipe.distributed.waiting`).

        ``waiting``: with the default deadline, a receive's word to tell the
        others if the deadline passes; it then waits on for the grace.
        Without it, the deadline ends the wait at once.

        Raises:
            TimedOut: it did not end by then; it runs on, unless the
                connections are closed (:meth:`closed`)
            RuntimeError: the operation failed
        """
        assert work is not None
        if until is None and self.watch is not None and self.watch.block(rank, waiting):
            try:
                work.wait()
            except RuntimeError as exc:
                if self.watch.closed:
                    raise TimedOut(str(exc), cast(float, self.timeout)) from exc
                raise
            finally:
                self.watch.unblock()
            return
        until = self.deadline if until is None else until
        if until is None:
            work.wait()
        elif not self.waiter.wait(work, until):
            raise TimedOut('no message by the deadline', self.timeout or 0.0)

    def closed(self) -> bool:
        """Whether the step's deadline and its grace have passed during a
        wait, closing the connections."""
        return self.watch is not None and self.watch.closed

    def close(self) -> None:
        """Ends the watch of this step's deadline, and lets its waiting thread end."""
        self.waiter.close()
        if self.watch is not None:
            self.watch.end()


def layout(tensors: List[Tensor]) -> Tuple[List[int], int]:
    """Where each of ``tensors`` starts in a payload holding them all, and its size."""
    offsets = []
    end = 0
    for t in tensors:
        offsets.append(end)
        end = align(end + t.numel() * t.element_size())
    return offsets, end


def read(buffer: Tensor, start: int, stop: int) -> bytearray:
    """A copy of ``buffer``'s bytes from ``start`` to ``stop``, on the host."""
    # Through torch alone: Tensor.numpy() would need numpy, which torch does not.
    data = bytearray(stop - start)
    torch.frombuffer(data, dtype=torch.uint8).copy_(buffer[start:stop])
    return data


def view(buffer: Tensor, offset: int, shape: Any, dtype: torch.dtype) -> Tensor:
    """The tensor of ``shape`` and ``dtype`` in ``buffer``'s bytes from ``offset``."""
    size = math.prod(shape) * dtype.itemsize
    return buffer[offset:offset + size].view(dtype).view(shape)

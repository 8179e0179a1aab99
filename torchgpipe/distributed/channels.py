"""Channels: messages to and from the other ranks of a group, as buffers of bytes.

The transport under :class:`~torchgpipe.distributed.wire.Wire`: a message
is its header (:mod:`~torchgpipe.distributed.codec`) and its tensors' bytes
in one buffer, sent and received with torch.distributed's point-to-point
operations; every wait ends by the step's deadline, leaving the connections
whole (:mod:`~torchgpipe.distributed.waiting`).
"""
import time
from typing import Any, Callable, Dict, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor

from torchgpipe.distributed.blocks import Blocks
from torchgpipe.distributed.codec import Unreadable, decode, dump_header, encode, load_header
from torchgpipe.distributed.faults import TimedOut, disconnected
from torchgpipe.distributed.waiting import Waiter, Watch

__all__: List[str] = []

#: The capacity a channel starts with, in bytes: enough for a message without tensors.
SMALL = 4096


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
        #: Sends in flight, with what they send, and to whom.
        self.sending: List[Tuple[Any, Tensor, int]] = []
        #: Receives still running after a deadline, by rank, with their
        #: buffers, which the next receive from that rank waits for again.
        #: After a failed step, the abandoned channels keep them (see
        #: DistributedGPipe), as they may still write their buffers.
        self.pending: Dict[int, Tuple[Any, Tensor]] = {}
        self.waiter = Waiter(threaded=not self.exact)
        #: Called at the deadline with the word of what this rank waits for then.
        self.alarm: Callable[[Any], None] = lambda word: None
        self.watch = None if self.deadline is None or self.exact else \
            Watch(self.deadline, cast(float, timeout), lambda word: self.alarm(word), group)

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
        self.sending.append((work, buffer, rank))

    def receive(self, rank: int, until: Optional[float] = None, waiting: Any = None,
                ) -> Tuple[str, Any]:
        """Waits for the next message from ``rank``, until ``until`` (by
        ``time.monotonic()``; default: the step's deadline, and the grace
        after it, if ``rank`` was still waited for then: see
        :class:`~torchgpipe.distributed.waiting.Watch`); returns its kind
        and the message. ``waiting``: the word to tell the others if the
        deadline passes during the wait.

        Raises:
            Disconnected: the connection broke (TimedOut: nothing came by
                then; the receive runs on, for the next from ``rank``)
        """
        # Not received ahead of time, while the rank computes: on CPU ranks
        # the transfer then takes a core from the computation, and measured
        # 1F1B steps 7-10 % slower (docs/scaling_out.rst, "Measured").
        while True:
            if rank in self.pending:
                work, buffer = self.pending.pop(rank)
            else:
                buffer = self.buffer(self.capacity(rank))
                with disconnected():
                    work = dist.irecv(buffer, rank, group=self.group)
            try:
                with disconnected():
                    self.wait(work, until, rank, waiting)
            except TimedOut:
                self.pending[rank] = (work, buffer)
                raise
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

"""The wire: a training step's messages between partitions in different processes.

:class:`~torchgpipe.train.step.Step` sends and takes its messages through a
:class:`~torchgpipe.train.mailbox.Mailbox`. :class:`Wire` is the mailbox of a
partition whose neighbours live in other processes: a message to another
rank is pickled, its tensors apart, and sent with torch.distributed's
point-to-point operations as one buffer (:class:`Channels`); a message from
another rank is taken when it has come.

Sends never wait (``isend``): a rank only waits for what it needs, so a
schedule that :func:`~torchgpipe.train.schedule.clock_order` accepts runs without
deadlock. Between two ranks, messages are received in the order they were
sent, whatever the backend (NCCL has no tags). That order is made one by
sending the skips of a micro-batch (:class:`~torchgpipe.train.mailbox.Skip` forward,
:class:`~torchgpipe.train.mailbox.SkipGradient` backward) right after the main
message of the same action (:class:`~torchgpipe.train.mailbox.Activation` or
:class:`~torchgpipe.train.mailbox.Gradient`), sorted by the skip's index, and
receiving them, in that order, right after it.
"""
import io
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from torchgpipe.distributed.blocks import Blocks
from torchgpipe.copy import Ready
from torchgpipe.train.mailbox import (Activation, Key, Mailbox, Skip, SkipGradient,
                                SkipKey)

__all__: List[str] = []

#: The route of a skip, (the partition that stashes it, the one that pops it).
Route = Tuple[int, int]


#: The capacity a channel starts with, in bytes: enough for a message without tensors.
SMALL = 4096


class PeerFailed(RuntimeError):
    """Another rank of the pipeline failed during the step, or stopped answering."""


class Wire(Mailbox):
    """The mailbox of partition ``here``, whose neighbours are in other processes.

    Args:
        channels: the channels to the other ranks
        ranks: the global rank of each partition
        here: the index of the partition of this process
        routes: the route of each skip that crosses partitions, by key
    """

    def __init__(self, channels: 'Channels', ranks: Sequence[int], here: int,
                 routes: Dict[SkipKey, Route]) -> None:
        super().__init__()
        self.channels = channels
        self.ranks = ranks
        self.here = here
        self.routes = routes
        #: The index of each skip, which orders the skips of one action.
        self.index = {key: k for k, key in enumerate(routes)}
        #: The skips popped and stashed here, by index.
        self.popped = [key for key in routes if routes[key][1] == here]
        self.stashed = [key for key in routes if routes[key][0] == here]
        #: Skips to send after the main message of their micro-batch.
        self.held: List[Tuple[int, Key, Any]] = []

    def put(self, key: Key, message: Any) -> None:
        if isinstance(key, (Skip, SkipGradient)):
            self.held.append((self.index[key.key], key, message))
            return
        # Both main messages are keyed by the partition they go to.
        self.send(key.j, 'message', message)
        # The skips of this action follow its main message.
        self.held.sort(key=lambda h: h[0])
        for _, skip, smessage in self.held:
            assert isinstance(skip, (Skip, SkipGradient))
            a, b = self.routes[skip.key]
            self.send(b if isinstance(skip, Skip) else a, 'message', smessage)
        self.held.clear()

    def take(self, key: Key) -> Any:
        if isinstance(key, (Skip, SkipGradient)):
            return super().take(key)  # received with the main message
        forward = isinstance(key, Activation)
        message = self.receive(key.j - 1 if forward else key.j + 1)
        for skey in self.popped if forward else self.stashed:
            a, b = self.routes[skey]
            super().put(Skip(key.i, skey) if forward else SkipGradient(key.i, skey),
                        self.receive(a if forward else b))
        return message

    def send(self, j: int, kind: str, message: Any) -> None:
        """Sends ``message`` to partition ``j``, without waiting."""
        self.channels.send(self.ranks[j], kind, message)

    def receive(self, j: int) -> Any:
        """Waits for the next message from partition ``j``.

        Raises:
            PeerFailed: partition ``j``'s rank failed, or the connection to it
                broke or timed out
        """
        try:
            kind, message = self.channels.receive(self.ranks[j])
        except RuntimeError as exc:
            raise PeerFailed(f'lost rank {self.ranks[j]} (partition {j}) while waiting for '
                             f'its message: {exc}') from exc
        if kind == 'failure':
            raise PeerFailed(f'rank {self.ranks[j]} (partition {j}) failed: {message}')
        return message

    def finish(self, loss: Optional[Tensor]) -> Tensor:
        """Ends the step on every rank: returns the loss the last partition sends everyone.

        Each rank tells every other that it is done (the last one, with the
        loss), then waits for the word of every other rank, and for its own
        sends to arrive.

        Raises:
            PeerFailed: another rank failed in this step
        """
        for j in range(len(self.ranks)):
            if j != self.here:
                self.send(j, 'message', loss)
        for j in range(len(self.ranks)):
            if j != self.here:
                received = self.receive(j)
                if j == len(self.ranks) - 1:
                    # A copy: the received loss is a view of a message's
                    # buffer, which a loss kept for logging would hold.
                    loss = received.clone()
        self.channels.wait_sent()
        self.channels.blocks.trim()
        assert loss is not None
        return loss

    def fail(self, error: BaseException) -> None:
        """Tells every other rank that this one failed, so none waits for it forever.

        The sends and receives in flight are never waited for: the step is
        over, and so is this pipeline (its ranks would not agree on which
        messages are left). The caller keeps ``channels`` alive, so that
        their buffers outlive them.
        """
        description = f'{type(error).__name__}: {error}'
        for j in range(len(self.ranks)):
            if j != self.here:
                try:
                    self.send(j, 'failure', description)
                except RuntimeError:
                    pass  # that rank is gone already


class Channels:
    """Messages to and from the other ranks of a group, each pair of ranks one ordered channel.

    A message is one buffer of bytes: the length of a pickle (the kind, the
    shape and type of each tensor, the message with its tensors taken out),
    the pickle, then the tensors' bytes, each at an offset aligned for its
    type (the received tensors are views of the buffer)::

        | length | pickle | pad | tensor 0 | pad | tensor 1 | ...

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
    """

    def __init__(self, device: torch.device, group: Optional[dist.ProcessGroup],
                 capacities: Dict[int, int], blocks: Blocks) -> None:
        self.device = device
        self.group = group
        self.capacities = capacities
        self.blocks = blocks
        self.exact = dist.get_backend(group) == 'nccl'
        #: Sends in flight, with what they send.
        self.sending: List[Tuple[Any, Tensor]] = []

    def capacity(self, rank: int) -> int:
        return self.capacities.setdefault(rank, SMALL)

    def send(self, rank: int, kind: str, message: Any) -> None:
        """Sends ``message`` to ``rank``, without waiting."""
        tensors: List[Tensor] = []
        body = io.BytesIO()
        pickler = pickle.Pickler(body, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = lambda obj: persist(obj, tensors)  # type: ignore[method-assign]
        pickler.dump(message)
        data = pickle.dumps((kind, [(t.shape, t.dtype) for t in tensors], body.getvalue()))
        offsets = []
        end = align(8 + len(data))
        for t in tensors:
            offsets.append(end)
            end = align(end + t.numel() * t.element_size())
        if end > self.capacity(rank):
            # It fits the buffer of the old capacity the receiver takes it in.
            self.post_send(rank, self.pack(pickle.dumps(('grow', [], pickle.dumps(end))), rank))
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
        work = dist.isend(buffer, rank, group=self.group)
        self.sending.append((work, buffer))

    def receive(self, rank: int) -> Tuple[str, Any]:
        """Waits for the next message from ``rank``; returns its kind and the message.

        Raises:
            RuntimeError: the connection broke or timed out
        """
        # Not received ahead of time, while the rank computes: on CPU ranks
        # the transfer then takes a core from the computation, and measured
        # 1F1B steps 7-10 % slower (docs/scaling_out.rst, "Measured").
        while True:
            buffer = self.buffer(self.capacity(rank))
            dist.recv(buffer, rank, group=self.group)
            length = int.from_bytes(read(buffer, 0, 8), 'little')
            kind, metas, body = pickle.loads(read(buffer, 8, 8 + length))
            if kind != 'grow':
                break
            self.capacities[rank] = pickle.loads(body)
        tensors = []
        offset = align(8 + length)
        for shape, dtype in metas:
            tensors.append(view(buffer, offset, shape, dtype))
            offset = align(offset + tensors[-1].numel() * tensors[-1].element_size())
        unpickler = pickle.Unpickler(io.BytesIO(body))
        unpickler.persistent_load = lambda pid: restore(  # type: ignore[method-assign]
            pid, tensors, self.device)
        return kind, unpickler.load()

    def wait_sent(self) -> None:
        """Waits for every send to arrive."""
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()


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


def persist(obj: Any, tensors: List[Tensor]) -> Optional[Tuple[str, int]]:
    """What a message holds in place of a tensor (sent apart) or a :class:`Ready`."""
    if isinstance(obj, Tensor):
        tensors.append(obj)
        return ('tensor', len(tensors) - 1)
    if isinstance(obj, Ready):
        return ('ready', 0)
    return None


def restore(pid: Tuple[str, int], tensors: List[Tensor], device: torch.device) -> Any:
    kind, k = pid
    if kind == 'tensor':
        return tensors[k]
    # Received tensors are ready on this device's current stream.
    return Ready(device)

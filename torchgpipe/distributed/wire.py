"""The wire: a training step's messages between partitions in different processes.

:class:`~torchgpipe.stepper.Step` sends and takes its messages through a
:class:`~torchgpipe.mailbox.Mailbox`. :class:`Wire` is the mailbox of a
partition whose neighbours live in other processes: a message to another
rank is pickled, its tensors apart, and sent with torch.distributed's
point-to-point operations; a message from another rank is received when the
partition takes it.

Every message is three or more sends in a row to one peer::

    size (int64) ─► header (pickled: kind, shapes and types, body) ─► tensor ─► ...

Sends never wait (``isend``): a rank only waits for what it needs, so a
schedule that :func:`~torchgpipe.schedule.clock_order` accepts runs without
deadlock. Between two ranks, messages are received in the order they were
sent, whatever the backend (NCCL has no tags). That order is made one by
sending the skips of a micro-batch (``'K'`` forward, ``'S'`` backward) right
after the main message of the same action, ``'F'`` or ``'B'``, sorted by the
skip's index, and receiving them, in that order, right after it.
"""
import io
import pickle
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from torchgpipe.mailbox import Key, Mailbox, Ready

__all__: List[str] = []

#: The route of a skip, (the partition that stashes it, the one that pops it).
Route = Tuple[int, int]


class PeerFailed(RuntimeError):
    """Another rank of the pipeline failed during the step, or stopped answering."""


class Wire(Mailbox):
    """The mailbox of partition ``here``, whose neighbours are in other processes.

    Args:
        ranks: the global rank of each partition
        here: the index of the partition of this process
        routes: the route of each skip that crosses partitions, by key
        device: where received tensors go
        group: the process group of ``ranks``
    """

    def __init__(self, ranks: Sequence[int], here: int, routes: Dict[Key, Route],
                 device: torch.device, group: Optional[dist.ProcessGroup]) -> None:
        super().__init__()
        self.ranks = ranks
        self.here = here
        self.routes = routes
        self.device = device
        self.group = group
        #: The index of each skip, which orders the skips of one action.
        self.index = {key: k for k, key in enumerate(routes)}
        #: The skips popped and stashed here, by index.
        self.popped = [key for key in routes if routes[key][1] == here]
        self.stashed = [key for key in routes if routes[key][0] == here]
        #: Skips to send after the main message of their micro-batch.
        self.held: List[Tuple[int, Tuple[Any, ...], Any]] = []
        #: Sends in flight, with what they send.
        self.sending: List[Tuple[Any, Tensor]] = []

    def put(self, key: Tuple[Any, ...], message: Any) -> None:
        kind, i, x = key
        if kind in 'KS':
            self.held.append((self.index[x], key, message))
            return
        self.send(x, 'message', message)
        # The skips of this action follow its main message.
        self.held.sort(key=lambda h: h[0])
        for _, (skind, _, skey), smessage in self.held:
            a, b = self.routes[skey]
            self.send(b if skind == 'K' else a, 'message', smessage)
        self.held.clear()

    def take(self, key: Tuple[Any, ...]) -> Any:
        kind, i, x = key
        if kind in 'KS':
            return super().take(key)  # received with the main message
        message = self.receive(x - 1 if kind == 'F' else x + 1)
        skips = self.popped if kind == 'F' else self.stashed
        for skey in skips:
            a, b = self.routes[skey]
            other = a if kind == 'F' else b
            super().put(('K' if kind == 'F' else 'S', i, skey), self.receive(other))
        return message

    def send(self, j: int, kind: str, message: Any) -> None:
        """Sends ``message`` to partition ``j``, without waiting."""
        tensors: List[Tensor] = []
        body = io.BytesIO()
        pickler = pickle.Pickler(body, protocol=pickle.HIGHEST_PROTOCOL)
        pickler.persistent_id = lambda obj: persist(obj, tensors)  # type: ignore[method-assign]
        pickler.dump(message)
        header = pickle.dumps((kind, [(t.shape, t.dtype) for t in tensors], body.getvalue()))
        data = torch.frombuffer(bytearray(header), dtype=torch.uint8)
        size = torch.tensor([len(header)], dtype=torch.int64)
        for t in [size, data] + tensors:
            if t.numel():
                t = t.detach().to(self.device).contiguous()
                work = dist.isend(t, self.ranks[j], group=self.group)
                self.sending.append((work, t))

    def receive(self, j: int) -> Any:
        """Waits for the next message from partition ``j``.

        Raises:
            PeerFailed: partition ``j``'s rank failed, or the connection to it
                broke or timed out
        """
        size = self.receive_tensor(j, torch.Size([1]), torch.int64)
        header = self.receive_tensor(j, torch.Size([int(size.item())]), torch.uint8)
        kind, metas, body = pickle.loads(header.cpu().numpy().tobytes())
        tensors = [self.receive_tensor(j, shape, dtype) for shape, dtype in metas]
        unpickler = pickle.Unpickler(io.BytesIO(body))
        unpickler.persistent_load = lambda pid: restore(  # type: ignore[method-assign]
            pid, tensors, self.device)
        message = unpickler.load()
        if kind == 'failure':
            raise PeerFailed(f'rank {self.ranks[j]} (partition {j}) failed: {message}')
        return message

    def receive_tensor(self, j: int, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        t = torch.empty(shape, dtype=dtype, device=self.device)
        if t.numel():
            try:
                work = dist.irecv(t, self.ranks[j], group=self.group)
                assert work is not None  # None only for ranks outside the group
                work.wait()
            except RuntimeError as exc:
                raise PeerFailed(f'lost rank {self.ranks[j]} (partition {j}) while waiting for '
                                 f'its message: {exc}') from exc
        return t

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
                    loss = received
        for work, _ in self.sending:
            work.wait()
        self.sending.clear()
        assert loss is not None
        return loss

    def fail(self, error: BaseException) -> None:
        """Tells every other rank that this one failed, so none waits for it forever.

        The sends already in flight are kept, never waited for: the step is
        over, and so is this pipeline (its ranks would not agree on which
        messages are left).
        """
        description = f'{type(error).__name__}: {error}'
        for j in range(len(self.ranks)):
            if j != self.here:
                try:
                    self.send(j, 'failure', description)
                except RuntimeError:
                    pass  # that rank is gone already


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

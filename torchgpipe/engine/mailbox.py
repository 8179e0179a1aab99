"""What the workers of a training step send each other, and how they wait for it.

Each partition's graph stands alone in a training step (:mod:`torchgpipe.engine.step`):
a worker sends the next partition its output, detached, and the previous
one the gradient of its input, through a :class:`Mailbox`. Messages are
filed under typed keys, one class per kind of message::

    partition j-1                                          partition j
    (j-1)Fi  ── Activation(i, j): ForwardMessage ─────────► jFi
    (j-1)Bi  ◄─ Gradient(i, j-1): Reply ────────────────── jBi
    a stash  ── Skip(i, key): ForwardMessage ─────────────► its pop (any later partition)
    B        ◄─ SkipGradient(i, key): Reply ────────────── B

(Actions written as schedules write them: ``jFi`` is the forward pass of
micro-batch ``i`` on partition ``j``.)

A :class:`~torchgpipe.foundation.copy.Ready` marks when, on CUDA, what is sent is
computed, and moves it as the forward path's copies do; :func:`leaf` makes
the receiving side's input. Skip connections that cross partitions
are cut the same way, by :class:`StepSkips`.
"""
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, NamedTuple, Optional, Tuple, Union

import torch
from torch import Tensor

from torchgpipe.foundation.copy import Ready
from torchgpipe.foundation.microbatch import Batch
from torchgpipe.foundation.stream import AbstractStream
from torchgpipe.runtime.worker import Stopped
from torchgpipe.skip.layout import SkipLayout
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.tracker import SkipTrackerAcross

__all__: List[str] = []

#: A skip's name: its namespace and its name in it.
SkipKey = Tuple[Namespace, str]


@dataclass(frozen=True, slots=True)
class Activation:
    """The key of micro-batch ``i``'s output of partition ``j - 1``: partition ``j``'s input."""

    i: int
    j: int


@dataclass(frozen=True, slots=True)
class Gradient:
    """The key of the gradient of micro-batch ``i``'s output of partition ``j``."""

    i: int
    j: int


@dataclass(frozen=True, slots=True)
class Skip:
    """The key of micro-batch ``i``'s skip tensor ``key``, sent to the partition popping it."""

    i: int
    key: SkipKey


@dataclass(frozen=True, slots=True)
class SkipGradient:
    """The key of the gradient of micro-batch ``i``'s skip ``key``, sent back to its stash."""

    i: int
    key: SkipKey


Key = Union[Activation, Gradient, Skip, SkipGradient]


class ForwardMessage(NamedTuple):
    """What goes forward: tensors (or one), whether each will require grad, and when ready."""

    tensors: Any
    requires_grad: Any
    ready: Ready


class Reply(NamedTuple):
    """What goes backward: the gradients (or one, ``None`` where there is none), and when ready."""

    grads: Any
    ready: Ready


class Mailbox:
    """Messages between the workers, by key; :meth:`take` waits for a message.

    A stopped mailbox ends every wait with :class:`~torchgpipe.runtime.worker.Stopped`.
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._messages: Dict[Key, Any] = {}
        self._stopped = False

    def put(self, key: Key, message: Any) -> None:
        with self._condition:
            self._messages[key] = message
            self._condition.notify_all()

    def take(self, key: Key) -> Any:
        """Waits for the message under ``key`` and takes it.

        Raises:
            Stopped: :meth:`stop` was called before the message came
        """
        with self._condition:
            while key not in self._messages:
                if self._stopped:
                    raise Stopped()
                self._condition.wait()
            return self._messages.pop(key)

    def stop(self) -> None:
        """Ends every wait for a message, now and later, with a ``Stopped``.

        A worker then starts no further action.
        """
        with self._condition:
            self._stopped = True
            self._condition.notify_all()

    @property
    def stopped(self) -> bool:
        """Whether :meth:`stop` was called: a worker starts no further action."""
        return self._stopped


def leaf(x: Optional[Tensor], device: torch.device, requires_grad: bool, ready: Ready,
         stream: Optional[AbstractStream]) -> Optional[Tensor]:
    """Cuts the graph at a partition's input: a copy on ``device`` without history,
    made on its copy ``stream``."""
    if x is None:
        return None
    return ready.receive(x, device, stream).requires_grad_(requires_grad and
                                                           x.is_floating_point())


class StepSkips(SkipTrackerAcross):
    """The skip tensors of one micro-batch on one partition, cut at partition boundaries.

    A skip stashed and popped in the same partition stays in the tracker's
    dictionary. One that crosses partitions is sent to the popping
    partition, as the message :class:`Skip` of micro-batch ``i``, and
    remembered in :attr:`sent`; its pop takes the message and makes a
    detached leaf of it, remembered in :attr:`received`. When the partition
    recomputes (``replay``), stashes are remembered again, with their new
    graph, and pops give the leaves of the first pass.
    """

    def __init__(self, layout: SkipLayout, j: int, device: torch.device, mailbox: Mailbox,
                 i: int, train: bool = True, stream: Optional[AbstractStream] = None) -> None:
        super().__init__(layout)
        self.j = j
        #: The partition's copy stream for micro-batch ``i``, both ways.
        self.stream = stream
        #: Of a training step; else of an evaluation, which has no gradients.
        self.train = train
        self.device = device
        self.mailbox = mailbox
        self.i = i
        self.replay = False
        #: The skips stashed here and popped by a later partition; the backward
        #: pass starts from them too.
        self.sent: Dict[SkipKey, Optional[Tensor]] = {}
        #: The leaves of the skips popped here from an earlier partition.
        self.received: Dict[SkipKey, Optional[Tensor]] = {}

    def send(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        self.sent[(ns, name)] = tensor
        if not self.replay:
            # Whether it will require grad, also when stashed without grad
            # (a checkpointed first pass): then the recomputation gives it one.
            requires_grad = tensor is not None and (tensor.requires_grad or (
                self.train and not torch.is_grad_enabled() and tensor.is_floating_point()))
            self.mailbox.put(Skip(self.i, (ns, name)),
                             ForwardMessage(tensor, requires_grad, Ready(self.device, self.stream)))

    def receive(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        if self.replay:
            return self.received[(ns, name)]
        tensor, requires_grad, ready = self.mailbox.take(Skip(self.i, (ns, name)))
        popped = leaf(tensor, self.device, requires_grad, ready, self.stream)
        self.received[(ns, name)] = popped
        return popped

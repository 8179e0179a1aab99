"""What the workers of a training step send each other, and how they wait for it.

Messages are filed under typed keys::

    partition j-1                                          partition j
    (j-1)Fi  ── Activation(i, j): ForwardMessage ─────────► jFi
    (j-1)Bi  ◄─ Gradient(i, j-1): Reply ────────────────── jBi
    a stash  ── Skip(i, key): ForwardMessage ─────────────► its pop (any later partition)
    B        ◄─ SkipGradient(i, key): Reply ────────────── B
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
    """What goes forward: tensors (or one), whether each will require grad, when ready."""

    tensors: Any
    requires_grad: Any
    ready: Ready


class Reply(NamedTuple):
    """What goes backward: the gradients (or one, or ``None``), when ready."""

    grads: Any
    ready: Ready


class Mailbox:
    """Messages between the workers, by key; :meth:`take` waits for one."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._messages: Dict[Key, Any] = {}
        #: Whether :meth:`stop` was called (start no further action).
        self.stopped = False

    def put(self, key: Key, message: Any) -> None:
        with self._condition:
            self._messages[key] = message
            self._condition.notify_all()

    def take(self, key: Key) -> Any:
        """Takes the message under ``key``, once it came; ``Stopped`` after :meth:`stop`."""
        with self._condition:
            while key not in self._messages:
                if self.stopped:
                    raise Stopped()
                self._condition.wait()
            return self._messages.pop(key)

    def stop(self) -> None:
        """Ends every wait, now and later, with ``Stopped``."""
        with self._condition:
            self.stopped = True
            self._condition.notify_all()


def leaf(x: Optional[Tensor], device: torch.device, requires_grad: bool, ready: Ready,
         stream: Optional[AbstractStream]) -> Optional[Tensor]:
    """Cuts the graph at a partition's input: ``x`` on ``device``, without history."""
    if x is None:
        return None
    return ready.receive(x, device, stream).requires_grad_(requires_grad and
                                                           x.is_floating_point())


class StepSkips(SkipTrackerAcross):
    """The skips of one micro-batch on one partition; those that cross partitions are sent
    (:attr:`sent`) and received as leaves (:attr:`received`). A recomputation
    (``replay``) remembers stashes again, with their new graph, and pops the same leaves."""

    def __init__(self, layout: SkipLayout, device: torch.device, mailbox: Mailbox, i: int,
                 train: bool = True, stream: Optional[AbstractStream] = None) -> None:
        super().__init__(layout)
        self.stream = stream
        self.train = train
        self.device = device
        self.mailbox = mailbox
        self.i = i
        self.replay = False
        #: The skips stashed here and popped later; the backward pass starts from them too.
        self.sent: Dict[SkipKey, Optional[Tensor]] = {}
        #: The leaves of the skips popped here from an earlier partition.
        self.received: Dict[SkipKey, Optional[Tensor]] = {}

    def send(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        self.sent[(ns, name)] = tensor
        if not self.replay:
            # A checkpointed first pass stashes without grad; the recomputation gives it one.
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

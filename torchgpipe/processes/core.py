"""This rank's share of a pipeline across processes: its partitions on the one-process
executor, the other ranks' messages on a :class:`~torchgpipe.transport.wire.Wire`."""
import json
from collections import OrderedDict
from contextlib import contextmanager
from hashlib import sha1
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchgpipe.engine.core import Core, Finish
from torchgpipe.engine.generators import BUILT_INS, resolve
from torchgpipe.engine.mailbox import Mailbox
from torchgpipe.engine.schedule import Schedule, ScheduleLike
from torchgpipe.processes.tied import TiedGradients
from torchgpipe.skip.layout import SkipLayout
from torchgpipe.transport.channels import Channels, metas_of
from torchgpipe.transport.codec import Unsendable, encode
from torchgpipe.transport.faults import Mismatch
from torchgpipe.transport.wire import Sequences, Wire

__all__ = ['RankCore']


class RankCore(Core):
    """This rank's partitions, by index, of a pipeline over ``group`` (partition ``j`` on its
    rank ``rank_of[j]``, global rank ``ranks[rank_of[j]]``). Each step agrees on what runs
    and sums tied gradients; a failed one is told to every rank and refuses further steps."""

    target_elsewhere = True

    def __init__(self, partitions: Dict[int, nn.Sequential], device: torch.device,
                 rank_of: List[int], ranks: List[int], group: Optional[dist.ProcessGroup],
                 tied: TiedGradients, timeout: Optional[float], skip_layout: SkipLayout,
                 chunks: int, checkpoint: str, planned_threads: Optional[int]) -> None:
        super().__init__(partitions, [device] * len(rank_of), skip_layout, chunks, checkpoint,
                         planned_threads)
        self.rank_of = rank_of
        self.ranks = ranks
        self.tied_gradients = tied
        self.timeout = timeout
        #: The skips that cross from one partition to another, by name.
        self.routes = {key: route for key, route in skip_layout.by_ns_name.items()
                       if route[0] != route[1]}
        self.channels = Channels(device, ranks, dist.get_backend(group))
        #: The message sequences of the signatures run before (see Wire).
        self.known: 'OrderedDict[str, Sequences]' = OrderedDict()
        #: Why the pipeline cannot run any more, after a failed step.
        self.broken: Optional[str] = None

    def check_whole(self) -> None:
        """Raises ``RuntimeError`` after a failed step: every step checks it first."""
        if self.broken is not None:
            raise RuntimeError(f'an earlier step failed ({self.broken}): the ranks of '
                               'this pipeline no longer agree on the messages between them; '
                               'restart the job, from a checkpoint')

    def tied(self) -> List[nn.Parameter]:
        """The parameters shared with other ranks, their gradients summed as a step ends."""
        return self.tied_gradients.parameters()

    def schedule_for(self, schedule: ScheduleLike, m: int) -> Schedule:
        """``schedule`` for ``m`` micro-batches, checked to fit the ranks."""
        return resolve(schedule, m, len(self.rank_of), [f'rank {r}' for r in self.rank_of],
                       "lay the partitions over the ranks as it does: placement='v' for "
                       + ', '.join(repr(name) for name, facts in BUILT_INS.items()
                                   if facts.shapes[0][1] == 'v') + ", 'loop' for the others")

    @contextmanager
    def agreed(self, said: Dict[str, Any], lacking: List[str], problem: Optional[Exception],
               train: bool) -> Iterator[Tuple[List[int], Optional[Mailbox], Finish]]:
        """See :meth:`Core.agreed <torchgpipe.engine.core.Core.agreed>`. The ranks raise
        together, before any message, if one refuses; the mailbox is the wire; the step
        finishes as every rank gets the last partition's result (and the gradients of tied
        parameters). A failure in the body is told to every rank, and breaks the pipeline."""
        wire = Wire(self.channels, [self.ranks[r] for r in self.rank_of], dist.get_rank(),
                    self.routes, self.known, self.timeout, self.state.recorder)
        received: Dict[int, Any] = {}

        def finish(result: Any) -> Any:
            result, shares = wire.finish(
                result, self.tied_gradients.shares(wire.others) if train else None)
            received.update(shares)
            return result
        try:
            if train:
                self.tied_gradients.start()
            yield wire.agree({**said, 'input': described(said['input'])}, lacking,
                             problem), wire, finish
        except BaseException as exc:
            self.tied_gradients.abandon()
            if isinstance(exc, Mismatch):
                if problem is not None:
                    # This rank's own error, not in the Mismatch's context.
                    raise problem from problem.__cause__
                raise
            self.broken = f'{type(exc).__name__} on rank {dist.get_rank()}'
            # Ranks waiting for this one raise PeerFailed, and tell those waiting for them.
            wire.fail(exc)
            self.channels.abandon()
            raise
        if train:
            # Past every rank's step end: unequal tied copies refused here leave it whole.
            self.tied_gradients.sum(received)


def described(value: Any) -> Optional[str]:
    """A digest of ``value``'s structure and tensor metadata: what shapes a step's messages."""
    if value is None:
        return None
    tensors: List[Tensor] = []
    try:
        body = encode(value, tensors)
    except Unsendable:
        body = repr(type(value))
    facts = [body, metas_of(tensors), [t.requires_grad for t in tensors]]
    return sha1(json.dumps(facts).encode()).hexdigest()

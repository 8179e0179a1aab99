"""This rank's share of a pipeline across processes: its partitions on the one-process
executor, the other ranks' messages on a :class:`~torchgpipe.transport.wire.Wire`; which
rank holds each partition, and every rank agreeing on it."""
import json
import time
from collections import OrderedDict
from contextlib import contextmanager
from hashlib import sha1
from typing import Any, ContextManager, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchgpipe.engine.core import Core, Finish
from torchgpipe.engine.generators import BUILT_INS, built_in, resolve, worker_of
from torchgpipe.engine.mailbox import Mailbox
from torchgpipe.engine.schedule import Schedule, ScheduleLike
from torchgpipe.engine.step import Reducer
from torchgpipe.foundation.validation import describe
from torchgpipe.processes.fsdp import driving
from torchgpipe.processes.tied import TiedGradients
from torchgpipe.skip.layout import SkipLayout
from torchgpipe.transport.channels import channels_for, metas_of, whole
from torchgpipe.transport.codec import Unsendable, encode
from torchgpipe.transport.faults import Mismatch, PeerFailed, by_rank, leave_word, word_left
from torchgpipe.transport.wire import Sequences, Wire

__all__ = ['RankCore']


class RankCore(Core):
    """This rank's partitions, by index, of a pipeline over ``group`` (partition ``j`` on its
    rank ``rank_of[j]``, global rank ``ranks[rank_of[j]]``), on the group's channels
    (``fresh`` ones if the ranks agreed on it). Each step agrees on what runs and sums tied
    gradients; a failed one is told to every rank and refuses further steps."""

    target_elsewhere = True
    materialize = ("materialize this rank's layers first: pipe.to_empty(), then initialize "
                   'them (reset_parameters(), or load a state dict or a DCP checkpoint)')

    def __init__(self, partitions: Dict[int, nn.Sequential], device: torch.device,
                 rank_of: List[int], ranks: List[int], group: Optional[dist.ProcessGroup],
                 tied: TiedGradients, timeout: Optional[float], fresh: bool,
                 skip_layout: SkipLayout, chunks: int, checkpoint: str,
                 planned_threads: Optional[int]) -> None:
        super().__init__(partitions, [device] * len(rank_of), skip_layout, chunks, checkpoint,
                         planned_threads)
        self.rank_of = rank_of
        self.ranks = ranks
        self.tied_gradients = tied
        self.timeout = timeout
        #: The skips that cross from one partition to another, by name.
        self.routes = {key: route for key, route in skip_layout.by_ns_name.items()
                       if route[0] != route[1]}
        self.channels = channels_for(group, device, ranks, dist.get_backend(group), fresh)
        #: The message sequences of the signatures run before (see Wire).
        self.known: 'OrderedDict[str, Sequences]' = OrderedDict()
        #: Why the pipeline cannot run any more, after a failed step.
        self.broken: Optional[str] = None
        #: When this rank last knew every rank well (built, or its last step ended).
        self.well_since = time.time()

    def check_whole(self) -> None:
        """Raises ``RuntimeError`` after a failed step (of this pipeline, or another over the
        same group): every step checks it first."""
        broken = self.broken or (self.channels.abandoned and 'a step of a pipeline over the '
                                 'same group, whose connections this one shares')
        if broken:
            raise RuntimeError(f'an earlier step failed ({broken}): the ranks of '
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

    def reducing(self) -> ContextManager[Optional[Reducer]]:
        """See :meth:`Core.reducing <torchgpipe.engine.core.Core.reducing>`: the
        ``fully_shard`` units of this rank's partitions reduce their gradients once, after
        each partition's last backward pass (:mod:`~torchgpipe.processes.fsdp`)."""
        return driving(self.partitions)

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
        with self.channels.using():  # before any message: another step's would mix in
            try:
                if train:
                    self.tied_gradients.start()
                words = {**said, 'input': described(said['input'])}
                if 'schedule' in said:
                    words['schedule'] = schedule_label(said['schedule'])
                yield wire.agree(words, lacking, problem), wire, finish
            except BaseException as exc:
                self.tied_gradients.abandon()
                if isinstance(exc, Mismatch):
                    if problem is not None:
                        # This rank's own error, not in the Mismatch's context.
                        raise problem from problem.__cause__
                    raise
                self.broken = f'{type(exc).__name__} on rank {dist.get_rank()}'
                # A rank of another pipeline failed first, if it left word (it waited for
                # that one in a collective of their data-parallel group): it is named.
                first = None if isinstance(exc, PeerFailed) else \
                    word_left(dist.get_rank(), self.well_since)
                if first is None and not isinstance(exc, PeerFailed):
                    leave_word(dist.get_rank(), min(self.partitions), exc)
                # Ranks waiting for this one raise PeerFailed, and tell those waiting for them.
                wire.fail(first or exc)
                self.channels.abandon()
                if first is not None:
                    raise first from exc
                raise
            if train:
                # Past every rank's step end: unequal tied copies refused here leave it whole.
                self.tied_gradients.sum(received)
            self.well_since = time.time()


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


def schedule_label(schedule: ScheduleLike) -> str:
    """A built-in schedule's name, or a schedule's name and digest, as the ranks compare it."""
    name = built_in(schedule)
    if name is not None:
        return name
    given = Schedule.parse(schedule)
    return f'{given.name} ({sha1(str(given).encode()).hexdigest()[:8]})'


def ranks_of_partitions(balance: List[int], size: int, placement: str) -> List[int]:
    """The rank of each partition over ``size`` ranks, laid out as ``placement`` says;
    ``ValueError`` for an unknown placement or partitions that do not divide evenly."""
    if placement not in ('loop', 'v'):
        raise ValueError(describe("placement must be 'loop' or 'v'", f'placement: {placement!r}',
                                  "use placement='loop' (partition j on rank j % size), or "
                                  "'v' (rank r keeps partitions r and 2 size - 1 - r)"))
    n = len(balance)
    if placement == 'v' and n != 2 * size:
        raise ValueError(describe("placement='v' needs two partitions per rank of the group",
                                  f'balance: {balance}, ranks: {size}',
                                  f'give {2 * size} numbers of layers'))
    if n % size:
        raise ValueError(describe('balance must give each rank of the group as many '
                                  'partitions', f'balance: {balance}, ranks: {size}',
                                  f'give {size} numbers of layers (or a multiple of {size}), '
                                  f'or run {n} processes'))
    return [worker_of(j, n, size, placement) for j in range(n)]


def agree_on_layout(module: nn.Sequential, arguments: Dict[str, Any],
                    problem: Optional[Exception], group: Optional[dist.ProcessGroup],
                    ranks: List[int], device: Optional[torch.device]) -> bool:
    """Checks in one exchange that every rank of ``group`` can build the pipeline and cuts
    the layers alike (``device`` is ``None`` if this rank's is unusable). Raises ``problem``
    on its rank once the others know, :exc:`~torchgpipe.distributed.Mismatch` on the
    others, or on all if ``arguments`` or layers differ. Returns whether the pipeline needs
    new channels: whether some rank has none :func:`~torchgpipe.transport.channels.whole`."""
    if device is None:  # the device of the backend's collectives
        device = torch.device('cuda', torch.cuda.current_device()) \
            if dist.get_backend(group) == 'nccl' else torch.device('cpu')
    layers = [] if problem is not None else [
        [type(layer).__name__,
         *(f'{name} {tuple(p.shape)} {p.dtype}' for name, p in layer.named_parameters())]
        for layer in module]
    error = None if problem is None else f'{type(problem).__name__}: {problem}'
    # As JSON, never pickled: a rank reads another's data, not its code.
    mine = [{} if problem is not None else arguments, layers, error,
            problem is not None or not whole(group, device)]
    everyone = [json.loads(data) for data in all_gather_bytes(json.dumps(mine).encode(), group,
                                                               device)]
    if problem is not None:
        raise problem
    for rank, (_, _, theirs, _) in zip(ranks, everyone):
        if theirs is not None:
            raise Mismatch(f'rank {rank} cannot build the pipeline: {theirs}')
    said = [{**theirs, 'layers': len(described)} for theirs, described, _, _ in everyone]
    if len({values['layers'] for values in said}) == 1:
        for k in range(len(layers)):
            if any(theirs[k] != everyone[0][1][k] for _, theirs, _, _ in everyone):
                for values, (_, theirs, _, _) in zip(said, everyone):
                    values[f'layer {k}'] = theirs[k]
                break
    keys = [key for key in said[0] if any(values[key] != said[0][key] for values in said)]
    if keys:
        raise Mismatch('the ranks of the pipeline lay out its layers differently '
                       f'({by_rank({r: {k: v[k] for k in keys} for r, v in zip(ranks, said)})}); '
                       'build the pipeline alike on every rank: the same module, and one '
                       'balance, placement, checkpoint and deferred_batch_norm for all (such '
                       'as plan.kwargs of torchgpipe.plan(..., group=...), the same on every '
                       'rank)')
    return any(fresh for *_, fresh in everyone)


def all_gather_bytes(data: bytes, group: Optional[dist.ProcessGroup],
                     device: torch.device) -> List[bytes]:
    """What each rank of ``group`` gave, in rank order (on ``device``: CUDA for NCCL);
    unlike :func:`torch.distributed.all_gather_object`, without NumPy."""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    buffer = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        buffer[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    buffers = [torch.empty_like(buffer) for _ in sizes]
    dist.all_gather(buffers, buffer, group=group)
    return [bytes(b[:int(s)].cpu().tolist()) for b, s in zip(buffers, sizes)]

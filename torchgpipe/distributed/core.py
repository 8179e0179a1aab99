"""This rank's share of a pipeline across processes: its partitions on the one-process
executor, the other ranks' messages on a :class:`~torchgpipe.distributed.wire.Wire`."""
import json
from collections import OrderedDict
from contextlib import contextmanager
from hashlib import sha1
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchgpipe.distributed.channels import Channels, metas_of
from torchgpipe.distributed.codec import Unsendable, encode
from torchgpipe.distributed.tied import TiedGradients
from torchgpipe.distributed.faults import Mismatch
from torchgpipe.distributed.wire import Sequences, Wire
from torchgpipe.engine.core import Core, Done
from torchgpipe.engine.evaluation import (check_evaluation, evaluation_weights, forward_only,
                                          join)
from torchgpipe.engine.generators import BUILT_INS, built_in, check_schedule, resolve
from torchgpipe.engine.inputs import split_given, weighted
from torchgpipe.engine.schedule import Schedule, ScheduleLike
from torchgpipe.engine.step import LossFunction, Step
from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.validation import check_step
from torchgpipe.runtime.batchnorm import deferred_step
from torchgpipe.skip.layout import SkipLayout

__all__ = ['RankCore']

#: The micro-batches of the input and target, and their sizes (see split_given), or ``None``.
Given = Tuple[Optional[List[microbatch.Batch]], Optional[List[TensorOrTensors]],
              Optional[List[int]]]
#: A step's schedule, its micro-batches' loss weights and its checkpoint stop.
Prepared = Tuple[Schedule, List[float], int]


class RankCore(Core):
    """This rank's partitions, by index, of a pipeline over ``group`` (partition ``j`` on its
    rank ``rank_of[j]``, global rank ``ranks[rank_of[j]]``). Each step agrees on what runs
    and sums tied gradients; a failed one is told to every rank and refuses further steps."""

    def __init__(self, partitions: Dict[int, nn.Sequential], device: torch.device,
                 rank_of: List[int], ranks: List[int], group: Optional[dist.ProcessGroup],
                 tied: TiedGradients,
                 skip_layout: SkipLayout, chunks: int, checkpoint: str,
                 timeout: Optional[float]) -> None:
        super().__init__(partitions, [device] * len(rank_of), skip_layout, chunks, checkpoint)
        self.device = device
        self.rank_of = rank_of
        self.ranks = ranks
        self.group = group
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

    def train(self, input: Optional[TensorOrTensors], target: Optional[TensorOrTensors],
              loss_fn: LossFunction, schedule: ScheduleLike, reduction: str, training: bool,
              done: Optional[Done] = None) -> Tensor:
        """See :meth:`DistributedGPipe.train_step
        <torchgpipe.distributed.DistributedGPipe.train_step>`."""
        self.check_whole()
        workers = [f'rank {r}' for r in self.rank_of]

        def arguments() -> Tuple[Given, Dict[str, Any]]:
            check_schedule(schedule)
            check_step(reduction, loss_fn)
            return (split_given(input, target, self.chunks, self.device),
                    {'schedule': schedule_label(schedule)})

        def prepare(sizes: List[int]) -> Prepared:
            m = len(sizes)
            return (resolve(schedule, m, len(workers), workers,
                            "lay the partitions over the ranks as it does: placement='v' for "
                            + ', '.join(repr(name) for name, facts in BUILT_INS.items()
                                        if facts.shapes[0][1] == 'v') + ", 'loop' for the others"),
                    weighted(sizes, reduction), self.stop(m, training))
        with self.wired(arguments, loss_fn, prepare, done=done) as (step, wire):
            with deferred_step(self.deferred_batch_norms, len(step.shared.batches)):
                loss = step.run()
            loss, received = wire.finish(loss, self.tied_gradients.shares(wire.others))
        # Past every rank's step end: unequal tied copies refused here leave the pipeline whole.
        self.tied_gradients.sum(received)
        return cast(Tensor, loss)

    def evaluate(self, input: Optional[TensorOrTensors], target: Optional[TensorOrTensors],
                 loss_fn: Optional[LossFunction], reduction: str,
                 output_fn: Optional[Callable[[TensorOrTensors], Any]],
                 everywhere: bool = False) -> Any:
        """See :meth:`DistributedGPipe.eval_step
        <torchgpipe.distributed.DistributedGPipe.eval_step>`."""
        self.check_whole()

        def arguments() -> Tuple[Given, Dict[str, Any]]:
            check_evaluation(target, loss_fn, reduction, output_fn, target_elsewhere=True)
            return (split_given(input, target, self.chunks, self.device),
                    {'loss': loss_fn is not None, 'everywhere': everywhere})

        def prepare(sizes: List[int]) -> Prepared:
            return (forward_only(len(sizes), len(self.rank_of)),
                    evaluation_weights(sizes, reduction, loss_fn is not None), 0)
        with self.wired(arguments, loss_fn, prepare, train=False) as (step, wire):
            loss = step.run()
            output = None if loss_fn is not None else join(step.outputs())
            if output is not None and output_fn is not None:
                output = output_fn(output)
            sent = loss if loss_fn is not None else output if everywhere else None
            result, _ = wire.finish(sent, None)
        return output if loss_fn is None and not everywhere else result

    @contextmanager
    def wired(self, arguments: Callable[[], Tuple[Given, Dict[str, Any]]],
              loss_fn: Optional[LossFunction], prepare: Callable[[List[int]], Prepared], *,
              done: Optional[Done] = None, train: bool = True) -> Iterator[Tuple[Step, Wire]]:
        """A step of this rank's data, its mailbox the wire (an evaluation unless ``train``).

        On entry every rank agrees on the step (``arguments()`` checks this rank's arguments,
        ``prepare(sizes)`` makes its schedule), raising together before any message; a
        failure in the body is told to every rank and breaks the pipeline."""
        given: Given = (None, None, None)
        signature: Dict[str, Any] = {}
        prepared: Optional[Prepared] = None
        problem: Optional[Exception] = None
        # What one rank refuses, all refuse in the agreement. A rank given no data
        # prepares once it has the sizes.
        try:
            self.check_modes()
            given, signature = arguments()
            prepared = None if given[2] is None else prepare(given[2])
            if 0 in self.partitions and given[0] is not None:
                microbatch.move(given[0], self.device)
        except Exception as exc:
            problem = exc
        batches, targets, sizes = given
        lacking = ['input'] if 0 in self.partitions and batches is None else []
        if len(self.rank_of) - 1 in self.partitions and loss_fn is not None and targets is None:
            lacking.append('target')
        wire = Wire(self.channels, [self.ranks[r] for r in self.rank_of], dist.get_rank(),
                    self.routes, self.known, self.timeout, self.state.recorder)
        try:
            if train:
                self.tied_gradients.start()
            sizes = wire.agree({'step': 'train_step' if train else 'eval_step',
                                'micro-batches': sizes, 'input': described(batches),
                                **signature}, lacking, problem)
            plan, weights, stop = prepared or prepare(sizes)
            m = len(sizes)
            step = self.step(batches or [None] * m, targets or [None] * m, loss_fn, weights,
                             plan, stop, mailbox=wire, done=done, train=train)
            yield step, wire
        except Mismatch:
            self.tied_gradients.abandon()
            if problem is not None:
                # This rank's own error, not in the Mismatch's context.
                raise problem from problem.__cause__
            raise
        except BaseException as exc:
            self.tied_gradients.abandon()
            self.broken = f'{type(exc).__name__} on rank {dist.get_rank()}'
            # Ranks waiting for this one raise PeerFailed, and tell those waiting for them.
            wire.fail(exc)
            self.channels.abandon()
            raise


def schedule_label(schedule: ScheduleLike) -> str:
    """A built-in schedule's name, or a schedule's name and digest: what the ranks agree
    on before a rank given no data knows the micro-batches."""
    name = built_in(schedule)
    if name is not None:
        return name
    given = Schedule.parse(schedule)
    return f'{given.name} ({sha1(str(given).encode()).hexdigest()[:8]})'


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

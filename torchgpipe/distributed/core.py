"""The core of a pipeline across processes: this rank's partitions, and the wire to the others.

:class:`RankCore` is the :class:`~torchgpipe.engine.core.Core` that a
:class:`~torchgpipe.distributed.DistributedGPipe` holds. Its steps run on
the same executor as one process's, the partitions of other ranks absent
and their messages on a :class:`~torchgpipe.distributed.wire.Wire`; around
each step, it makes every rank agree on what runs, sums the gradients of
parameters tied across ranks, and, when a step fails, tells every rank and
refuses further steps.
"""
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

#: What a rank makes of its input and target (see split_given): the
#: micro-batches of each, and their sizes, each ``None`` if not given.
Given = Tuple[Optional[List[microbatch.Batch]], Optional[List[TensorOrTensors]],
              Optional[List[int]]]
#: What a step of micro-batches of given sizes runs: its schedule, the weight
#: of each micro-batch's loss, and its checkpoint stop.
Prepared = Tuple[Schedule, List[float], int]


class RankCore(Core):
    """This rank's share of a pipeline across the processes of a group.

    Args:
        partitions: the partitions of this rank, by index
        device: this rank's device
        rank_of: the rank in ``group`` of every partition
        ranks: the global rank of every rank of ``group``
        group: the processes of the pipeline
        tied: the parameters this rank shares with layers of other ranks
        skip_layout, chunks, checkpoint: as for :class:`~torchgpipe.engine.core.Core`
        timeout: the step timeout, in seconds, or ``None``
    """

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
        #: The sequences of messages of the signatures run before (see Wire).
        self.known: 'OrderedDict[str, Sequences]' = OrderedDict()
        #: Why the pipeline cannot run any more, after a failed step.
        self.broken: Optional[str] = None

    def check_whole(self) -> None:
        """Refuses a step after one that failed: every step checks it first.

        Raises:
            RuntimeError: an earlier step failed
        """
        if self.broken is not None:
            raise RuntimeError(f'an earlier step failed ({self.broken}): the ranks of '
                               'this pipeline no longer agree on the messages between them; '
                               'restart the job, from a checkpoint')

    def tied(self) -> List[nn.Parameter]:
        """The parameters shared with other ranks, whose gradients are summed as a step ends."""
        return self.tied_gradients.parameters()

    def train(self, input: Optional[TensorOrTensors], target: Optional[TensorOrTensors],
              loss_fn: LossFunction, schedule: ScheduleLike, reduction: str, training: bool,
              done: Optional[Done] = None) -> Tensor:
        """A training step over the ranks, its arguments checked: see
        :meth:`DistributedGPipe.train_step
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
        # Every rank is past the end of the step: copies of a tied parameter
        # refused here leave no rank waiting, and the pipeline whole.
        self.tied_gradients.sum(received)
        return cast(Tensor, loss)

    def evaluate(self, input: Optional[TensorOrTensors], target: Optional[TensorOrTensors],
                 loss_fn: Optional[LossFunction], reduction: str,
                 output_fn: Optional[Callable[[TensorOrTensors], Any]],
                 everywhere: bool = False) -> Any:
        """An evaluation step over the ranks, its arguments checked and the layers in
        evaluation mode: see :meth:`DistributedGPipe.eval_step
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
        """A step (a training step's, or an evaluation's) of this rank's data, its mailbox
        the wire.

        On entry every rank agrees on the step (ranks that disagree all raise
        here, before any message), and a rank given no data learns the sizes
        of the micro-batches; the body runs the step and finishes the wire. A
        failure in the body is told to every rank, and breaks the pipeline.

        Args:
            arguments: checks this rank's arguments; returns what
                :func:`~torchgpipe.engine.inputs.split_given` made of its
                input and target, and more of the step, which every rank
                must run alike
            prepare: the schedule, the weights of the losses and the checkpoint
                stop (see :class:`~torchgpipe.engine.step.Step`) of micro-batches
                of these sizes
            train: a training step, whose end carries the gradients of tied
                parameters; else an evaluation
        """
        given: Given = (None, None, None)
        signature: Dict[str, Any] = {}
        prepared: Optional[Prepared] = None
        problem: Optional[Exception] = None
        # What this rank refuses (a layer that cannot run in its mode, data
        # that does not split or fit the schedule), every rank refuses in the
        # agreement, before any message. A rank given no data prepares once it
        # has the sizes, which the others have checked.
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
                # This rank's own error, as it was raised (not in the Mismatch's context).
                raise problem from problem.__cause__
            raise
        except BaseException as exc:
            self.tied_gradients.abandon()
            self.broken = f'{type(exc).__name__} on rank {dist.get_rank()}'
            # Ranks waiting for this one's messages raise PeerFailed, and tell
            # the ranks waiting for theirs in turn.
            wire.fail(exc)
            self.channels.abandon()
            raise


def schedule_label(schedule: ScheduleLike) -> str:
    """The schedule of a step, as the ranks agree on it before a rank given no data
    knows the micro-batches: a built-in one's name, or a schedule's name and digest."""
    name = built_in(schedule)
    if name is not None:
        return name
    given = Schedule.parse(schedule)
    return f'{given.name} ({sha1(str(given).encode()).hexdigest()[:8]})'


def described(value: Any) -> Optional[str]:
    """A digest of ``value``'s structure, each tensor as its shape, type and
    whether it requires grad: what makes the shapes of a step's messages."""
    if value is None:
        return None
    tensors: List[Tensor] = []
    try:
        body = encode(value, tensors)
    except Unsendable:
        body = repr(type(value))
    facts = [body, metas_of(tensors), [t.requires_grad for t in tensors]]
    return sha1(json.dumps(facts).encode()).hexdigest()

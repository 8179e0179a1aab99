"""The core of a pipeline across processes: this rank's partitions, and the wire to the others.

:class:`RankCore` is the :class:`~torchgpipe.engine.core.Core` that a
:class:`~torchgpipe.distributed.DistributedGPipe` holds. Its steps run on
the same executor as one process's, the partitions of other ranks absent
and their messages on a :class:`~torchgpipe.distributed.wire.Wire`; around
each step, it makes every rank agree on what runs, sums the gradients of
parameters tied across ranks, and, when a step fails, tells every rank and
refuses further steps.
"""
from contextlib import contextmanager
from hashlib import sha1
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchgpipe.distributed.blocks import Blocks
from torchgpipe.distributed.channels import Capacity
from torchgpipe.distributed.shared import Shared
from torchgpipe.distributed.tied import TiedGradients
from torchgpipe.distributed.wire import Channels, Mismatch, Wire
from torchgpipe.engine.core import Core, Done
from torchgpipe.engine.evaluation import forward_only, join, split_evaluation
from torchgpipe.engine.generators import resolve
from torchgpipe.engine.inputs import split_step
from torchgpipe.engine.schedule import Schedule, ScheduleLike
from torchgpipe.engine.step import LossFunction, Step
from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.runtime.batchnorm import deferred_step
from torchgpipe.skip.layout import SkipLayout

__all__ = ['RankCore']


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
        #: The capacities of the channel to and from each rank (see Channels).
        self.capacities: Dict[Tuple[int, bool], Capacity] = {}
        #: The CPU memory of the messages, reused from step to step.
        self.blocks = Blocks()
        #: The shared memory of the messages to and from ranks of this host.
        self.shared = Shared()
        #: Why the pipeline cannot run any more, after a failed step.
        self.broken: Optional[str] = None
        #: The channels of a failed step, whose sends may still run.
        self.abandoned: Optional[Channels] = None

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

    def train(self, input: TensorOrTensors, target: TensorOrTensors, loss_fn: LossFunction,
              schedule: ScheduleLike, reduction: str, training: bool,
              done: Optional[Done] = None) -> Tensor:
        """A training step over the ranks, its arguments checked: see
        :meth:`DistributedGPipe.train_step
        <torchgpipe.distributed.DistributedGPipe.train_step>`."""
        self.check_whole()
        batches, targets, weights = split_step(input, target, self.chunks, reduction,
                                               self.device)
        m = len(batches)
        plan = resolve(schedule, m, len(self.rank_of), [f'rank {r}' for r in self.rank_of],
                       "lay the partitions over the ranks as it does: placement='v' for "
                       "'zbv', 'loop' for the others")
        self.tied_gradients.start()
        with self.wired(batches, targets, loss_fn, weights, plan, self.stop(m, training),
                        done=done) as (step, wire):
            with deferred_step(self.deferred_batch_norms, m):
                loss = step.run()
            loss, received = wire.finish(loss, self.tied_gradients.shares(wire.others))
        # Every rank is past the end of the step: copies of a tied parameter
        # refused here leave no rank waiting, and the pipeline whole.
        self.tied_gradients.sum(received)
        return cast(Tensor, loss)

    def evaluate(self, input: TensorOrTensors, target: Optional[TensorOrTensors],
                 loss_fn: Optional[LossFunction], reduction: str,
                 output_fn: Optional[Callable[[TensorOrTensors], Any]],
                 everywhere: bool = False) -> Any:
        """An evaluation step over the ranks, its arguments checked and the layers in
        evaluation mode: see :meth:`DistributedGPipe.eval_step
        <torchgpipe.distributed.DistributedGPipe.eval_step>`."""
        self.check_whole()
        batches, targets, weights = split_evaluation(input, target, self.chunks, reduction,
                                                     self.device)
        with self.wired(batches, targets, loss_fn, weights,
                        forward_only(len(batches), len(self.rank_of)), 0, train=False,
                        signature={'loss': loss_fn is not None,
                                   'everywhere': everywhere}) as (step, wire):
            loss = step.run()
            output = None if loss_fn is not None else join(step.outputs())
            if output is not None and output_fn is not None:
                output = output_fn(output)
            sent = loss if loss_fn is not None else output if everywhere else None
            result, _ = wire.finish(sent, None)
        return output if loss_fn is None and not everywhere else result

    @contextmanager
    def wired(self, batches: List[microbatch.Batch], targets: Sequence[Any],
              loss_fn: Optional[LossFunction], weights: List[float], plan: Schedule, stop: int,
              *, done: Optional[Done] = None, train: bool = True,
              signature: Optional[Dict[str, Any]] = None) -> Iterator[Tuple[Step, Wire]]:
        """A step of ``plan`` (a training step's, or an evaluation's), its mailbox the wire.

        On entry every rank agrees on the step (ranks that disagree all raise
        here, before any message); the body runs the step and finishes the
        wire. A failure in the body is told to every rank, and breaks the
        pipeline.

        Args:
            stop: the checkpoint stop (see :class:`~torchgpipe.engine.step.Step`)
            train: a training step, whose end carries the gradients of tied
                parameters; else an evaluation
            signature: more of the step, which every rank must run alike
        """
        if 0 in self.partitions:
            microbatch.move(batches, self.device)
        wire = Wire(Channels(self.device, self.group, self.capacities, self.blocks,
                             self.shared, self.timeout),
                    [self.ranks[r] for r in self.rank_of], dist.get_rank(), self.routes,
                    self.state.recorder)
        step = self.step(batches, targets, loss_fn, weights, plan, stop, mailbox=wire,
                         done=done, train=train)
        try:
            wire.agree({'step': 'train_step' if train else 'eval_step',
                        'micro-batches': [batch[0].size(0) for batch in batches],
                        'schedule': f'{plan.name} ({sha1(str(plan).encode()).hexdigest()[:8]})',
                        **(signature or {})})
            yield step, wire
        except Mismatch:
            self.tied_gradients.abandon()
            raise
        except BaseException as exc:
            self.tied_gradients.abandon()
            self.broken = f'{type(exc).__name__} on rank {dist.get_rank()}'
            # Ranks waiting for this one's messages raise PeerFailed, and tell
            # the ranks waiting for theirs in turn.
            wire.fail(exc)
            self.abandoned = wire.channels
            raise

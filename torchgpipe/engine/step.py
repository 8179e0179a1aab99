"""Training steps the library drives: each partition's actions, in a schedule's order.

Each partition is a :class:`~torchgpipe.engine.stage.Stage`. The schedule's
actions are laid out in clock cycles and issued to the worker of each
partition's device (:mod:`torchgpipe.runtime.worker`), which runs them in
order, waiting in a :class:`~torchgpipe.engine.mailbox.Mailbox` for what
others send. The first failure stops every action and reaches the caller as itself.
"""
import functools
from typing import Callable, Dict, List, Mapping, Optional, Protocol, Sequence, cast

import torch
from torch import Tensor, nn

from torchgpipe.engine.generators import expected_bubble
from torchgpipe.engine.mailbox import Mailbox
from torchgpipe.engine.schedule import Action, Kind, Schedule, clock_order
from torchgpipe.engine.stage import Shared, Stage
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors
from torchgpipe.foundation.record import Recorder
from torchgpipe.foundation.stream import AbstractStream
from torchgpipe.foundation.validation import check_loss_value
from torchgpipe.runtime.traits import PartitionTraits
from torchgpipe.runtime.worker import IssueOrder, Work, distinct_devices, run_on_workers
from torchgpipe.skip.layout import SkipLayout

__all__: List[str] = []

LossFunction = Callable[[TensorOrTensors, TensorOrTensors], Tensor]


class Step:
    """Runs one training step of a schedule over the partitions.

    Args:
        partitions: the partitions, in order; ``None`` for a partition that
            runs elsewhere (in another process), whose messages ``mailbox``
            carries
        devices: the device of each partition
        batches: the input micro-batches, on the first device (``None``
            where the first partition runs elsewhere)
        targets: the target of each micro-batch
        loss_fn: ``loss_fn(output, target)`` of one micro-batch
        weights: what each micro-batch's loss is multiplied by
        schedule: each worker's actions, checked (:meth:`Schedule.check
            <torchgpipe.schedules.Schedule.check>`)
        layout: where the skips go
        checkpoint_stop: micro-batches ``0 .. checkpoint_stop - 1`` are checkpointed
        traits: what runs showed about each partition (whether it draws random numbers)
        recorder: records the actions, inside :func:`torchgpipe.trace`
        mailbox: what carries messages between partitions (default: a new
            :class:`~torchgpipe.engine.mailbox.Mailbox`, for partitions of this process)
        done: called with ``j`` once partition ``j``'s gradients are final,
            before it sends its last gradients back
        train: a training step (default); else an evaluation, without
            autograd (:mod:`torchgpipe.engine.evaluation`)
        copy_streams: for each partition here, a copy stream per
            micro-batch, which moves its messages (default: the devices'
            current streams)
    """

    def __init__(self, partitions: Sequence[Optional[nn.Sequential]],
                 devices: Sequence[torch.device], batches: Sequence[Optional[Batch]],
                 targets: Sequence[Optional[TensorOrTensors]], loss_fn: Optional[LossFunction],
                 weights: Sequence[float], schedule: Schedule,
                 layout: SkipLayout, checkpoint_stop: int, traits: Sequence[PartitionTraits],
                 recorder: Optional[Recorder], *, mailbox: Optional[Mailbox] = None,
                 done: Optional[Callable[[int], None]] = None, train: bool = True,
                 copy_streams: Optional[Sequence[Optional[Sequence[AbstractStream]]]] = None,
                 ) -> None:
        self.n = len(partitions)
        self.devices = devices
        self.targets = targets
        self.loss_fn = loss_fn
        self.weights = weights
        self.schedule = schedule
        self.shared = Shared(self.n, batches, None if loss_fn is None else self.loss, train,
                             layout, checkpoint_stop, mailbox or Mailbox(), recorder, done)
        # Each partition's last action that accumulates its parameters' gradients.
        last = {a.j: a for actions in schedule.workers for a in actions
                if a.kind in (Kind.B, Kind.W)}
        self.stages = {j: Stage(self.shared, j, p, devices[j], traits[j], last.get(j),
                                None if copy_streams is None else copy_streams[j])
                       for j, p in enumerate(partitions) if p is not None}
        #: This process's actions, in clock order.
        self.order = [a for cycle in clock_order(schedule.workers, self.n) for a in cycle
                      if a.j in self.stages]

    def loss(self, i: int, output: Batch) -> Tensor:
        """The weighted loss of micro-batch ``i``."""
        assert self.loss_fn is not None
        loss = self.loss_fn(output.values, cast(TensorOrTensors, self.targets[i]))
        return check_loss_value(loss) * self.weights[i]

    def run(self) -> Optional[Tensor]:
        """Runs the step; returns the loss of the mini-batch, without graph
        (``None`` without the last partition here, or without a loss function).

        An exception of any action is raised here, as itself, once every
        worker has stopped.
        """
        shared = self.shared
        if shared.recorder is not None:
            shared.recorder.begin_step(len(shared.batches), self.devices,
                                       f'train_step (schedule {self.schedule.name!r})'
                                       if shared.train else 'eval_step',
                                       expected_bubble(self.schedule, self.n))
        execute(self.order, self.stages, shared.mailbox)
        last = self.stages.get(self.n - 1)
        if last is None or shared.loss is None:
            return None
        return cast(Tensor, sum(last.losses[i].to(self.devices[-1])
                                for i in range(len(shared.batches))))

    def outputs(self) -> Optional[List[Batch]]:
        """After an evaluation without a loss, each micro-batch's output, if here."""
        last = self.stages.get(self.n - 1)
        if last is None:
            return None
        return [cast(Batch, last.passes[i].output) for i in range(len(self.shared.batches))]


class StageLike(Protocol):
    """What the executor asks of a stage, whichever its boundary."""

    #: The device of its partition.
    device: torch.device

    def run(self, action: Action) -> None:
        """Runs one of its actions."""

    def draws_random(self) -> Optional[bool]:
        """Whether its forward actions may draw from the CPU generator (``None``: unknown)."""


def execute(order: Sequence[Action], stages: Mapping[int, StageLike], mailbox: Mailbox) -> None:
    """Runs actions in order on the workers of their partitions' devices, raising the
    first failure as itself (:func:`~torchgpipe.runtime.worker.run_on_workers`): the
    forward path, steps and ranks.

    Forward actions that may draw random numbers run in ``order``
    (:class:`~torchgpipe.runtime.worker.IssueOrder`), drawing what they
    would on one thread.

    Args:
        order: the actions of the partitions here, in clock order
        stages: the stage of each partition here, by index
        mailbox: where the stages wait for each other's messages
    """
    devices = [stage.device for stage in stages.values()]
    issue_order = IssueOrder() if len(distinct_devices(devices)) > 1 else None

    def stop() -> None:
        # Ends every wait of the actions, for a message or a turn.
        mailbox.stop()
        if issue_order is not None:
            issue_order.stop()

    works: Dict[torch.device, List[Work]] = {}
    for index, action in enumerate(order):
        stage = stages[action.j]
        work: Callable[[], None] = functools.partial(stage.run, action)
        if issue_order is not None and action.kind is Kind.F and stage.draws_random() is not False:
            work = issue_order.wrap(work)
        works.setdefault(distinct_devices([stage.device])[0], []).append((index, work))
    with run_on_workers(works, stop):
        pass  # the workers run the actions; leaving waits for them

"""Training steps: each partition's actions, in clock order, on its device's worker."""
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
    """One step of a checked schedule over the partitions (``None`` where held in another
    process, which ``mailbox`` reaches); an evaluation without autograd unless ``train``.
    ``done(j)`` is called once partition ``j``'s gradients are final."""

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
        last = {a.j: a for actions in schedule.workers for a in actions
                if a.kind in (Kind.B, Kind.W)}
        self.stages = {j: Stage(self.shared, j, p, devices[j], traits[j], last.get(j),
                                None if copy_streams is None else copy_streams[j])
                       for j, p in enumerate(partitions) if p is not None}
        self.order = [a for cycle in clock_order(schedule.workers, self.n) for a in cycle
                      if a.j in self.stages]

    def loss(self, i: int, output: Batch) -> Tensor:
        """The weighted loss of micro-batch ``i``."""
        assert self.loss_fn is not None
        loss = self.loss_fn(output.values, cast(TensorOrTensors, self.targets[i]))
        return check_loss_value(loss) * self.weights[i]

    def run(self) -> Optional[Tensor]:
        """Runs the step, raising an action's failure as itself; returns the loss, if the
        last partition is here with a loss function."""
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
        """After an evaluation without a loss, the outputs, if here."""
        last = self.stages.get(self.n - 1)
        if last is None:
            return None
        return [cast(Batch, last.passes[i].output) for i in range(len(self.shared.batches))]


class StageLike(Protocol):
    """What the executor asks of a stage, whichever its boundary."""

    device: torch.device

    def run(self, action: Action) -> None: ...

    def draws_random(self) -> Optional[bool]: ...


def execute(order: Sequence[Action], stages: Mapping[int, StageLike], mailbox: Mailbox) -> None:
    """The one executor: runs the actions on their devices' workers, raising the first failure
    as itself; forward actions that may draw random numbers run in ``order``, as on one."""
    devices = [stage.device for stage in stages.values()]
    issue_order = IssueOrder() if len(distinct_devices(devices)) > 1 else None

    def stop() -> None:
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

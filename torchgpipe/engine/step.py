"""Training steps: each partition's actions, in clock order, on its device's worker.

Each partition's graph is cut at its input, its backward run when the schedule says::

    partition j-1                           partition j
    F  x ─► layers ─► y ───── y ──────────► x' = y.detach(), requiring grad
                                             x' ─► layers ─► z ─► ...
    B  backward(y, dy) ◄──── dy = x'.grad ◄─ backward(z, dz)

Skips are cut the same way. A checkpointed micro-batch's ``B`` (or ``I``) recomputes first.
"""
import functools
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import (Callable, ContextManager, Dict, List, Mapping, Optional, Protocol, Sequence,
                    Set, Tuple, TypeVar, cast)

import torch
from torch import Tensor, nn

from torchgpipe.engine.generators import expected_bubble
from torchgpipe.engine.mailbox import (Activation, ForwardMessage, Gradient, Mailbox, Reply,
                                       SkipGradient, StepSkips, leaf)
from torchgpipe.engine.schedule import Action, Kind, Schedule, clock_order
from torchgpipe.engine.split import WeightPass, input_pass
from torchgpipe.foundation.copy import Ready
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, check, gather, move, scatter
from torchgpipe.foundation.placement import indexed
from torchgpipe.foundation.record import Recorder, run_task
from torchgpipe.foundation.rng import cpu_generator_held, training_flags, watch
from torchgpipe.foundation.stream import AbstractStream
from torchgpipe.foundation.validation import check_loss_value, describe
from torchgpipe.runtime.partition import partition_function
from torchgpipe.runtime.replay import FirstPass, first_pass, recomputation
from torchgpipe.runtime.traits import PartitionTraits
from torchgpipe.runtime.worker import (IssueOrder, Stopped, Work, distinct_devices,
                                       run_on_workers)
from torchgpipe.skip.layout import SkipLayout

__all__: List[str] = []

T = TypeVar('T')


@dataclass
class Pass:
    """What the forward action of a micro-batch leaves for its backward action."""

    input: Batch
    skips: StepSkips
    output: Optional[Batch] = None
    loss: Optional[Tensor] = None
    replay: Optional[FirstPass] = None
    #: For each output tensor, whether the next partition's leaf requires grad.
    sent_grad: List[bool] = field(default_factory=list)


class Reducer:
    """A data-parallel wrapper's part in a training step (DDP's all-reduce, FSDP's units):
    told when each partition's gradients are final, asked to keep gathered parameters."""

    def done(self, j: int) -> None:
        """Partition ``j`` has no backward pass left in the step: reduce its gradients."""
        raise NotImplementedError

    def keep_gathered(self, j: int) -> ContextManager[None]:
        """Around a pass of partition ``j`` that its worker follows with another of ``j``:
        parameters gathered for it may stay so, as they would be gathered again at once."""
        return nullcontext()


@dataclass
class Shared:
    """What every stage of a step reads: the step's data, and where messages go."""

    n: int
    batches: Sequence[Optional[Batch]]
    #: The weighted loss of micro-batch ``i``'s output; ``None`` keeps the outputs.
    loss: Optional[Callable[[int, Batch], Tensor]]
    train: bool
    layout: SkipLayout
    checkpoint_stop: int
    mailbox: Mailbox
    recorder: Optional[Recorder]
    reducer: Optional[Reducer]


class Stage:
    """One partition in a training step: runs its actions, keeps what they pass on.
    ``last`` is its last ``B`` or ``W``; ``followed`` the micro-batches whose ``F`` its
    worker follows with another action of it; ``streams`` its copy stream per micro-batch."""

    def __init__(self, shared: Shared, j: int, partition: nn.Sequential, device: torch.device,
                 traits: PartitionTraits, last: Optional[Action], followed: Set[int],
                 streams: Optional[Sequence[AbstractStream]] = None) -> None:
        self.shared = shared
        self.streams = streams
        self.j = j
        self.partition = partition
        self.device = device
        self.traits = traits
        self.last = last
        self.followed = followed
        self.flags = training_flags(partition)
        self.is_last = j == shared.n - 1
        self.passes: Dict[int, Pass] = {}
        #: What each micro-batch's ``I`` left for its ``W``.
        self.deferred: Dict[int, WeightPass] = {}
        #: The loss of each micro-batch, without graph (the last partition's).
        self.losses: Dict[int, Tensor] = {}
        #: Whether the last partition's forward action, loss included, drew in this step.
        self.loss_draws: Optional[bool] = None

    def stream(self, i: int) -> Optional[AbstractStream]:
        return None if self.streams is None else self.streams[i]

    def draws_random(self) -> Optional[bool]:
        """Whether the forward actions may draw from the CPU generator, if known; with the
        last partition's loss, which may change at every call, learned anew each step."""
        drew = self.traits.draws(self.flags)
        if self.is_last and drew is False:
            return self.loss_draws
        return drew

    def run(self, action: Action) -> None:
        """Runs an action: waits for what it needs, then does (and records) its work."""
        if self.shared.mailbox.stopped:
            raise Stopped()  # an action elsewhere failed
        i = action.i
        if action.kind is Kind.F:
            input = self.receive(i)
            # Held once the input came, never while waiting for another worker.
            with cpu_generator_held(self.draws_random() is not False), \
                    self.keep_gathered(i in self.followed):
                self.record('forward', i, lambda: self.forward(i, input))
            self.send_output(i)
            return
        if action.kind is Kind.W:
            self.record('weight', i, self.deferred.pop(i).run)
            self.finish(action)
            return
        current = self.passes.pop(i)
        # Recomputed before the gradient is awaited: the two overlap.
        if current.replay is not None:
            with self.keep_gathered(True):  # for the backward pass
                self.record('recompute', i, lambda: self.recompute(i, current))
        tensors, grads = self.gradients(i, current)
        if action.kind is Kind.B:
            self.record('backward', i, lambda: self.backpropagate(tensors, grads))
        else:
            self.deferred[i] = self.record('input', i, lambda: input_pass(
                tensors, grads, self.leaves(current), tuple(current.output or ())))
        self.send_gradients(i, current)
        if action.kind is Kind.B:
            self.finish(action)  # the partition before has its gradient meanwhile

    def finish(self, action: Action) -> None:
        """Tells the reducer after the last ``B`` or ``W``: the gradients may be reduced
        while the partitions before still run backward passes."""
        if action == self.last and self.shared.reducer is not None:
            self.shared.reducer.done(self.j)

    def keep_gathered(self, keep: bool) -> ContextManager[None]:
        """The reducer's :meth:`Reducer.keep_gathered` for this partition, if ``keep``."""
        reducer = self.shared.reducer
        return reducer.keep_gathered(self.j) if keep and reducer is not None else nullcontext()

    def leaves(self, current: Pass) -> List[Tensor]:
        """The leaves the graph of a micro-batch was cut at, whose gradients go back."""
        inputs = [x for x in current.input if self.j > 0 and x is not None and x.requires_grad]
        return inputs + [x for x in current.skips.received.values()
                         if x is not None and x.requires_grad]

    def record(self, kind: str, i: int, work: Callable[[], T]) -> T:
        """Runs an action's work, labelled for a profiler, recorded by a timeline."""
        return run_task(self.shared.recorder, kind, i, self.j, self.device, work)

    def call(self, input: Batch, skips: StepSkips) -> Batch:
        """Runs the partition on ``input``, on copies unless it is known to leave it alone: a
        recomputation runs from it again."""
        function = partition_function(self.partition, self.j, skips)
        return Batch(self.traits.call(function, tuple(input), input.with_tensors, 'train_step'))

    def receive(self, i: int) -> Batch:
        """The input of micro-batch ``i``: the mini-batch's, or what the partition before sent."""
        if self.j == 0:
            return cast(Batch, self.shared.batches[i])
        output, sent_grad, ready = self.shared.mailbox.take(Activation(i, self.j))
        input = Batch(output.plain, output.layout)
        input[:] = tuple(cast(Tensor, leaf(x, self.device, g, ready, self.stream(i)))
                         for x, g in zip(output, sent_grad))
        return input

    def forward(self, i: int, input: Batch) -> None:
        shared = self.shared
        skips = StepSkips(shared.layout, self.device, shared.mailbox, i, shared.train,
                          self.stream(i))
        current = Pass(input, skips)
        checkpointed = i < shared.checkpoint_stop
        # Not known yet whether it draws: the generator is held, so a change is its doing.
        probing = self.draws_random() is None
        if checkpointed:
            with first_pass(self.device, self.draws_random() is not False) as current.replay:
                output, drew = watch(lambda: self.call(input, skips), probing)
        else:
            with torch.set_grad_enabled(shared.train):
                output, drew = watch(lambda: self.call(input, skips), probing)
        if probing:
            # Its own draws, without the loss's: the forward path shares them.
            self.traits.learn_draws(self.flags, drew)
        current.output = output
        if not self.is_last:
            # Checkpointed, a floating point output gets a graph in the recomputation.
            current.sent_grad = [x.requires_grad or (checkpointed and x.is_floating_point())
                                 for x in output]
        elif shared.loss is None:  # an evaluation's output, kept in its pass
            if probing:
                self.loss_draws = drew
        else:
            with torch.set_grad_enabled(shared.train and not checkpointed):
                loss, loss_drew = watch(functools.partial(shared.loss, i, output), probing)
            if current.replay is not None:  # its recomputation ends after the loss too
                current.replay.end()
            self.losses[i] = loss.detach()
            current.loss = None if checkpointed else loss
            if probing:
                self.loss_draws = drew or loss_drew
        self.passes[i] = current

    def send_output(self, i: int) -> None:
        """Sends micro-batch ``i``'s output to the next partition."""
        # An evaluation keeps no pass, but the outputs it returns.
        keep = self.shared.train or (self.is_last and self.shared.loss is None)
        current = self.passes[i] if keep else self.passes.pop(i)
        output = current.output
        if current.replay is not None and self.shared.loss is not None:
            # The recomputation makes them again: held, every checkpointed output of the
            # step (the logits, say) would be alive at once. Let go before the output goes.
            current.output = None
            current.skips.sent.clear()
        if not self.is_last:
            self.shared.mailbox.put(Activation(i, self.j + 1),
                                    ForwardMessage(output, current.sent_grad,
                                                   Ready(self.device, self.stream(i))))

    def recompute(self, i: int, current: Pass) -> None:
        assert current.replay is not None
        current.skips.replay = True
        with recomputation(self.device, current.replay,
                           exclusive=self.draws_random() is not False):
            current.output = self.call(current.input, current.skips)
            if self.is_last:
                assert self.shared.loss is not None  # a training step's
                current.loss = self.shared.loss(i, current.output)

    def gradients(self, i: int, current: Pass) -> Tuple[List[Tensor], List[Optional[Tensor]]]:
        """Micro-batch ``i``'s tensors to backpropagate from, and their gradients, awaited."""
        mailbox = self.shared.mailbox
        tensors: List[Tensor] = []
        grads: List[Optional[Tensor]] = []
        if current.loss is not None:
            tensors.append(current.loss)
            grads.append(None)
        else:
            assert current.output is not None
            received, ready = mailbox.take(Gradient(i, self.j))
            for x, g in zip(current.output, received):
                if x.requires_grad and g is not None:
                    tensors.append(x)
                    grads.append(ready.receive(g, x.device, self.stream(i)))
        for key, tensor in current.skips.sent.items():
            g, ready = mailbox.take(SkipGradient(i, key))
            if tensor is not None and tensor.requires_grad and g is not None:
                tensors.append(tensor)
                grads.append(ready.receive(g, tensor.device, self.stream(i)))
        return tensors, grads

    def backpropagate(self, tensors: List[Tensor], grads: List[Optional[Tensor]]) -> None:
        if tensors:
            torch.autograd.backward(tensors, grads)

    def send_gradients(self, i: int, current: Pass) -> None:
        """Sends the gradients of micro-batch ``i``'s input and popped skips back."""
        mailbox = self.shared.mailbox
        ready = Ready(self.device, self.stream(i))
        # The skips first: a mailbox across processes holds them until the main message.
        for key, popped in current.skips.received.items():
            mailbox.put(SkipGradient(i, key),
                        Reply(None if popped is None else popped.grad, ready))
        if self.j > 0:
            mailbox.put(Gradient(i, self.j - 1), Reply([x.grad for x in current.input], ready))


LossFunction = Callable[[TensorOrTensors, TensorOrTensors], Tensor]


def split_given(input: Optional[TensorOrTensors], target: Optional[TensorOrTensors],
                chunks: int, last_device: torch.device
                ) -> Tuple[Optional[List[Batch]], Optional[List[TensorOrTensors]],
                           Optional[List[int]]]:
    """Splits what is given of a step's input and target (a rank's) into micro-batches,
    checked; the targets on the last device, as the loss function sees them; and the
    micro-batches' sizes, for the losses' weights."""
    if input is not None:
        check(input)
    if target is not None:
        check(target, 'target')
    batches = None if input is None else scatter(input, chunks)
    targets = None if target is None else scatter(target, chunks, 'target')
    sizes = None if batches is None else [b[0].size(0) for b in batches]
    target_sizes = None if targets is None else [t[0].size(0) for t in targets]
    if sizes is not None and target_sizes is not None and sizes != target_sizes:
        raise ValueError(describe('target must split into the micro-batches the input does',
                                  f'input micro-batches of {sizes}, target of {target_sizes}',
                                  'give a target with one row per sample of the input'))
    if targets is None:
        return batches, None, sizes
    # Views where the target is in the last device's memory already: no copies.
    move(targets, last_device)
    return batches, [t.plain for t in targets], sizes or target_sizes


def weighted(sizes: List[int], reduction: str) -> List[float]:
    """The weight of the loss of each micro-batch of ``sizes`` samples, under ``reduction``."""
    total = sum(sizes)
    if not total:
        # A data loader's leftover, whose mean loss would be nan.
        raise ValueError(describe('train_step needs at least one sample',
                                  'input: a mini-batch of 0 rows',
                                  'skip empty batches, e.g. with drop_last=True in the '
                                  'DataLoader'))
    return [size / total if reduction == 'mean' else 1.0 for size in sizes]


class Step:
    """One step of a checked schedule over the partitions (``None`` where held in another
    process, which ``mailbox`` reaches); an evaluation without autograd unless ``train``.
    ``reducer`` hears when each partition's gradients are final."""

    def __init__(self, partitions: Sequence[Optional[nn.Sequential]],
                 devices: Sequence[torch.device], batches: Sequence[Optional[Batch]],
                 targets: Sequence[Optional[TensorOrTensors]], loss_fn: Optional[LossFunction],
                 weights: Sequence[float], schedule: Schedule,
                 layout: SkipLayout, checkpoint_stop: int, traits: Sequence[PartitionTraits],
                 recorder: Optional[Recorder], *, mailbox: Optional[Mailbox] = None,
                 reducer: Optional[Reducer] = None, train: bool = True,
                 copy_streams: Optional[Sequence[Optional[Sequence[AbstractStream]]]] = None,
                 ) -> None:
        self.n = len(partitions)
        self.devices = devices
        self.targets = targets
        self.loss_fn = loss_fn
        self.weights = weights
        self.schedule = schedule
        self.shared = Shared(self.n, batches, None if loss_fn is None else self.loss, train,
                             layout, checkpoint_stop, mailbox or Mailbox(), recorder, reducer)
        last = {a.j: a for actions in schedule.workers for a in actions
                if a.kind in (Kind.B, Kind.W)}
        cycles = schedule.cycles or clock_order(schedule.workers, self.n)
        here = [j for j, p in enumerate(partitions) if p is not None]
        self.order = [a for cycle in cycles for a in cycle if a.j in here]
        followed: Dict[int, Set[int]] = {j: set() for j in here}
        previous: Dict[torch.device, Action] = {}
        for a in self.order:  # as each worker runs them
            worker = indexed(devices[a.j])
            before = previous.get(worker)
            if before is not None and before.kind is Kind.F and before.j == a.j:
                followed[a.j].add(before.i)
            previous[worker] = a
        self.stages = {j: Stage(self.shared, j, cast(nn.Sequential, partitions[j]), devices[j],
                                traits[j], last.get(j), followed[j],
                                None if copy_streams is None else copy_streams[j])
                       for j in here}

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

    def output(self) -> Optional[TensorOrTensors]:
        """After an evaluation without a loss, the mini-batch's output, if here."""
        last = self.stages.get(self.n - 1)
        if last is None:
            return None
        return gather([cast(Batch, last.passes[i].output) for i in range(len(self.shared.batches))])


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

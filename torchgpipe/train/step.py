"""Training steps the library drives: each partition's forward and backward, in a schedule's order.

:meth:`GPipe.forward <torchgpipe.GPipe.forward>` builds one autograd graph
through every partition and leaves the backward pass to the caller's
``loss.backward()``, which PyTorch runs in one thread on CPU. Here each
partition's graph stands alone, cut at its input, and the worker that owns
the partition runs its backward pass itself, when the schedule says::

    partition j-1                           partition j
    F  x ─► layers ─► y ───── y ──────────► x' = y.detach(), requiring grad
                                             x' ─► layers ─► z ─► ...
    B  backward(y, dy) ◄──── dy = x'.grad ◄─ backward(z, dz)

A skip connection from partition ``a`` to ``b`` is cut the same way: ``b``
pops a detached leaf, and sends its gradient back to ``a``, whose backward
pass starts from both its output and the stashed tensor.

The actions of a schedule (:mod:`torchgpipe.train.schedule`) are laid out in clock
cycles and issued at once, each to the worker of its partition's device
(:mod:`torchgpipe.worker`, as the forward path's tasks), which runs them in
that order, waiting in a :class:`~torchgpipe.train.mailbox.Mailbox` for what
others send. Forward actions that may draw random numbers take the same
turns and hold the CPU generator as the forward path's tasks
(:mod:`torchgpipe.rng`). A checkpointed micro-batch runs its forward pass
without keeping activations, and its backward action (``B``, or ``I`` when
the backward pass is split) recomputes them first, in the same replay as
the forward path's (:mod:`torchgpipe.replay`). ``I`` sends the gradients of
the partition's inputs back at once; its ``W`` accumulates the parameters'
later, from what ``I`` kept (:mod:`torchgpipe.train.split`).
"""
import functools
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, cast

import torch
from torch import Tensor, nn

from torchgpipe.record import Recorder, label
from torchgpipe.validation import check_loss_value
from torchgpipe.copy import Ready
from torchgpipe.train.mailbox import (Activation, Gradient, Mailbox, Parcel, Reply,
                                SkipGradient, StepSkips, leaf)
from torchgpipe.microbatch import Batch, TensorOrTensors
from torchgpipe.partition import partition_function
from torchgpipe.replay import FirstPass, first_pass, recomputation
from torchgpipe.rng import cpu_generator_held, training_flags, watch
from torchgpipe.train.generators import expected_bubble
from torchgpipe.train.schedule import Action, Kind, Schedule, clock_order
from torchgpipe.train.split import WeightPass, input_pass
from torchgpipe.skip.layout import SkipLayout
from torchgpipe.traits import PartitionTraits
from torchgpipe.worker import ExcInfo, Stopped, Task, Turns, distinct_devices, spawn_workers

__all__: List[str] = []

T = TypeVar('T')
LossFunction = Callable[[TensorOrTensors, TensorOrTensors], Tensor]


@dataclass
class Pass:
    """What the forward action of a micro-batch leaves for its backward action."""

    input: Batch
    skips: StepSkips
    output: Optional[Batch] = None
    #: The weighted loss, with its graph (last partition, not checkpointed).
    loss: Optional[Tensor] = None
    #: The states to recompute from (checkpointed micro-batches).
    replay: Optional[FirstPass] = None
    #: For each output tensor, whether the next partition's leaf requires grad.
    sent_grad: List[bool] = field(default_factory=list)


@dataclass
class Shared:
    """What every stage of a step reads: the step's data, and where messages go."""

    #: The number of partitions.
    n: int
    #: The input micro-batches (read by partition 0).
    batches: List[Batch]
    #: The weighted loss of micro-batch ``i``'s output (the last partition's);
    #: ``None``: the step keeps the outputs.
    loss: Optional[Callable[[int, Batch], Tensor]]
    #: A training step; else an evaluation (no autograd).
    train: bool
    layout: SkipLayout
    #: Micro-batches ``0 .. checkpoint_stop - 1`` are checkpointed.
    checkpoint_stop: int
    mailbox: Mailbox
    recorder: Optional[Recorder]
    #: Called with ``j`` once partition ``j``'s gradients are final.
    done: Optional[Callable[[int], None]]


class Stage:
    """One partition in a training step: runs its actions, keeps what they pass on.

    Args:
        shared: what every stage of the step reads
        j: the partition's index
        partition: the partition
        device: its device
        traits: what runs showed about it; this one adds what it learns
        last: its last action that accumulates gradients of its parameters (B or W)
    """

    def __init__(self, shared: Shared, j: int, partition: nn.Sequential, device: torch.device,
                 traits: PartitionTraits, last: Optional[Action]) -> None:
        self.shared = shared
        self.j = j
        self.partition = partition
        self.device = device
        self.traits = traits
        self.last = last
        self.flags = training_flags(partition)
        self.is_last = j == shared.n - 1
        self.passes: Dict[int, Pass] = {}
        #: What each micro-batch's ``I`` left for its ``W``.
        self.deferred: Dict[int, WeightPass] = {}
        #: The loss of each micro-batch, without graph (the last partition's).
        self.losses: Dict[int, Tensor] = {}
        #: Whether the forward action, loss included, drew in this step (the
        #: last partition's, learned by its first forward action).
        self.loss_draws: Optional[bool] = None

    def draws_random(self) -> Optional[bool]:
        """Whether the partition's forward actions may draw from the CPU generator, if known.

        The loss is part of the last partition's forward actions. It may be
        another function at every call, so whether the two together draw is
        learned anew in every step, by the first of them (:attr:`loss_draws`).
        """
        drew = self.traits.draws(self.flags)
        if self.is_last and drew is False:
            return self.loss_draws
        return drew

    def run(self, action: Action) -> None:
        """Runs an action: waits for what it needs, then does (and records) its work.

        Waiting for another worker's message is no part of the work: a
        timeline shows it as the gap it is.
        """
        if self.shared.mailbox.stopped:
            # An action elsewhere failed: start nothing more.
            raise Stopped()
        i = action.i
        if action.kind is Kind.F:
            input = self.receive(i)
            # Held after the turn and the input came, never while waiting for
            # another worker; throughout, as a forward path's task (see
            # torchgpipe.rng): a first pass from before it saves the state.
            with cpu_generator_held(self.draws_random() is not False):
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
            self.record('recompute', i, lambda: self.recompute(i, current))
        tensors, grads = self.gradients(i, current)
        if action.kind is Kind.B:
            self.record('backward', i, lambda: self.backpropagate(tensors, grads))
            self.finish(action)
        else:
            self.deferred[i] = self.record('input', i, lambda: input_pass(
                tensors, grads, self.leaves(current), tuple(current.output or ())))
        self.send_gradients(i, current)

    def finish(self, action: Action) -> None:
        """Says so once the partition's gradients are final, after its last ``B`` or ``W``."""
        if action == self.last and self.shared.done is not None:
            # They may be all-reduced while the partitions before it still
            # run backward passes.
            self.shared.done(self.j)

    def leaves(self, current: Pass) -> List[Tensor]:
        """The leaves the graph of a micro-batch was cut at, whose gradients go back."""
        inputs = [x for x in current.input if self.j > 0 and x is not None and x.requires_grad]
        return inputs + [x for x in current.skips.received.values()
                         if x is not None and x.requires_grad]

    def record(self, kind: str, i: int, work: Callable[[], T]) -> T:
        """Runs an action's work, labelled for a profiler and recorded by a timeline."""
        with label(kind, (i, self.j)):
            recorder = self.shared.recorder
            if recorder is None:
                return work()
            return recorder.timed(kind, i, self.j, self.device, work)()

    def call(self, input: Batch, skips: StepSkips) -> Batch:
        """Runs the partition on ``input``, on copies unless it is known to leave its input alone.

        The input must stay as it is: a recomputation runs from it again,
        and a leaf requiring grad cannot be changed in place at all.
        """
        function = partition_function(self.partition, self.j, skips)
        return Batch(self.traits.call(function, tuple(input), input.with_tensors, 'train_step'))

    def receive(self, i: int) -> Batch:
        """The input of micro-batch ``i``: the mini-batch's, or what the partition before sent."""
        if self.j == 0:
            return self.shared.batches[i]
        output, sent_grad, ready = self.shared.mailbox.take(Activation(i, self.j))
        input = Batch(output.plain, output.layout)
        input[:] = tuple(cast(Tensor, leaf(x, self.device, g, ready))
                         for x, g in zip(output, sent_grad))
        return input

    def forward(self, i: int, input: Batch) -> None:
        shared = self.shared
        skips = StepSkips(shared.layout, self.j, self.device, shared.mailbox, i, shared.train)
        current = Pass(input, skips)
        checkpointed = i < shared.checkpoint_stop
        # Not known yet whether the partition draws random numbers: the
        # generator is held, so any change of its state is its doing, or its
        # loss's (the loss is part of the last partition's work).
        probing = self.draws_random() is None
        if checkpointed:
            with first_pass(self.device) as current.replay:
                output, drew = watch(lambda: self.call(input, skips), probing)
        else:
            with torch.set_grad_enabled(shared.train):
                output, drew = watch(lambda: self.call(input, skips), probing)
        if probing:
            # The partition's own draws, without its loss's: the forward
            # path, which has no loss, shares what is learned here.
            self.traits.learn_draws(self.flags, drew)
        current.output = output
        if not self.is_last:
            # Without a graph (checkpointed), a floating point output will
            # have one after the recomputation: the next leaf requires grad.
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
        if not self.is_last:
            self.shared.mailbox.put(Activation(i, self.j + 1),
                                    Parcel(current.output, current.sent_grad, Ready(self.device)))

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
        """Waits for the gradients of micro-batch ``i``'s outputs and sent skips.

        Returns:
            the tensors to backpropagate from, and their gradients
        """
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
                    grads.append(ready.receive(g, x.device))
        for key, tensor in current.skips.sent.items():
            g, ready = mailbox.take(SkipGradient(i, key))
            if tensor is not None and tensor.requires_grad and g is not None:
                tensors.append(tensor)
                grads.append(ready.receive(g, tensor.device))
        return tensors, grads

    def backpropagate(self, tensors: List[Tensor], grads: List[Optional[Tensor]]) -> None:
        if tensors:
            torch.autograd.backward(tensors, grads)

    def send_gradients(self, i: int, current: Pass) -> None:
        """Sends the gradients of micro-batch ``i``'s input and popped skips back."""
        mailbox = self.shared.mailbox
        ready = Ready(self.device)
        # The skips first: a mailbox to other processes holds them back until
        # the main message goes, and sends them right after it.
        for key, popped in current.skips.received.items():
            mailbox.put(SkipGradient(i, key),
                        Reply(None if popped is None else popped.grad, ready))
        if self.j > 0:
            mailbox.put(Gradient(i, self.j - 1), Reply([x.grad for x in current.input], ready))


class Step:
    """Runs one training step of a schedule over the partitions.

    Args:
        partitions: the partitions, in order; ``None`` for a partition that
            runs elsewhere (in another process), whose messages ``mailbox``
            carries
        devices: the device of each partition
        batches: the input micro-batches, on the first device
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
            :class:`~torchgpipe.train.mailbox.Mailbox`, for partitions of this process)
        done: called with ``j`` once partition ``j``'s gradients are final,
            before it sends its last gradients back
        train: a training step (default); else an evaluation, without
            autograd (:mod:`torchgpipe.train.evaluation`)
    """

    def __init__(self, partitions: Sequence[Optional[nn.Sequential]],
                 devices: Sequence[torch.device], batches: List[Batch],
                 targets: Sequence[Optional[TensorOrTensors]], loss_fn: Optional[LossFunction],
                 weights: Sequence[float], schedule: Schedule,
                 layout: SkipLayout, checkpoint_stop: int, traits: Sequence[PartitionTraits],
                 recorder: Optional[Recorder], *, mailbox: Optional[Mailbox] = None,
                 done: Optional[Callable[[int], None]] = None, train: bool = True) -> None:
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
        self.stages = {j: Stage(self.shared, j, p, devices[j], traits[j], last.get(j))
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
        devices = [self.devices[j] for j in self.stages]
        # Forward actions that may draw take turns in clock order on threads: they
        # draw what they would on one thread, where they run in that order anyway.
        turns = Turns() if len(distinct_devices(devices)) > 1 else None
        # One task per device: its partitions' actions in clock order. (A
        # task per action would wake the calling thread at every action.)
        queue = {j: k for k, j in enumerate(self.stages)}
        tasks: Dict[torch.device, Tuple[int, List[Tuple[int, Callable[[], None]]]]] = {}
        for index, action in enumerate(self.order):
            device = distinct_devices([self.devices[action.j]])[0]
            _, works = tasks.setdefault(device, (queue[action.j], []))
            works.append((index, self.work(action, turns)))
        failures: List[Tuple[int, ExcInfo]] = []
        # On Ctrl-C the workers stop after the action they run; no action
        # may wait for a message or a turn of theirs.
        with spawn_workers(devices, lambda: self.stop(turns)) as (in_queues, out_queues):
            for k, works in tasks.values():
                in_queues[k].put(Task(None, compute=functools.partial(
                    self.run_works, works, turns, failures), finalize=None))
            for k, _ in tasks.values():
                out_queues[k].get()
        if failures:
            # The first failure in the schedule; the others may follow from it.
            _, (_, exc, tb) = min(failures, key=lambda f: f[0])
            raise exc.with_traceback(tb)
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

    def work(self, action: Action, turns: Optional[Turns]) -> Callable[[], None]:
        """Runs an action, in its turn if it is a forward action that may draw random numbers."""
        run = functools.partial(self.stages[action.j].run, action)
        if turns is not None and action.kind is Kind.F and \
                self.stages[action.j].draws_random() is not False:
            return turns.take(run)
        return run

    def run_works(self, works: List[Tuple[int, Callable[[], None]]], turns: Optional[Turns],
                  failures: List[Tuple[int, ExcInfo]]) -> None:
        """Runs the actions of one device in order; a failure stops every other action."""
        for index, work in works:
            try:
                work()
            except Stopped:
                return  # an action elsewhere failed, or Ctrl-C
            except BaseException:
                failures.append((index, cast(ExcInfo, sys.exc_info())))
                self.stop(turns)
                return

    def stop(self, turns: Optional[Turns]) -> None:
        """Ends every wait of the step's actions, for a message or a turn."""
        self.shared.mailbox.stop()
        if turns is not None:
            turns.stop()

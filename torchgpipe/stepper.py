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

The actions of a schedule (:mod:`torchgpipe.schedule`) are laid out in clock
cycles; each device's worker runs its partitions' actions in that order,
waiting in a :class:`~torchgpipe.mailbox.Mailbox` for what others send. A checkpointed
micro-batch runs its forward pass without keeping activations, and its
backward action recomputes them first, replaying the random number
generators and autocast.
"""
import functools
import sys
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import (Any, Callable, ContextManager, Dict, List, Optional, Sequence, Tuple, TypeVar,
                    cast)

import torch
from torch import Tensor, nn

from torchgpipe._record import Recorder, label
from torchgpipe._validation import describe
from torchgpipe.autocast import AutocastStates, restore_autocast_states, save_autocast_states
from torchgpipe.phase import enable_checkpointing, enable_recomputing
from torchgpipe import microbatch
from torchgpipe.microbatch import Batch, TensorOrTensors
from torchgpipe.pipeline import partition_function
from torchgpipe.rng import RNGStates, cpu_generator_held, cpu_generator_owned, cpu_rng_state, \
    holding_for_caller, restore_rng_states, save_rng_states, training_flags
from torchgpipe.schedule import Action, clock_order
from torchgpipe.skip.layout import SkipLayout
from torchgpipe.stream import use_device
from torchgpipe.traits import PartitionTraits
from torchgpipe.mailbox import Mailbox, Ready, Stopped, StepSkips, leaf
from torchgpipe.worker import Crew, ExcInfo, distinct_devices

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
    replay: Optional[Tuple[RNGStates, AutocastStates]] = None
    #: For each output tensor, whether the next partition's leaf requires grad.
    sent_grad: List[bool] = field(default_factory=list)


class Stage:
    """One partition in a training step: runs its actions, keeps what they pass on."""

    def __init__(self, step: 'Step', j: int, partition: nn.Sequential,
                 device: torch.device) -> None:
        self.step = step
        self.j = j
        self.partition = partition
        self.device = device
        self.passes: Dict[int, Pass] = {}

    def run(self, action: Action) -> None:
        """Runs an action: waits for what it needs, then does (and records) its work.

        Waiting for another worker's message is no part of the work: a
        timeline shows it as the gap it is.
        """
        i = action.i
        if action.kind == 'F':
            input = self.receive(i)
            with self.step.random_lock(self.j):
                self.record('forward', i, lambda: self.forward(i, input))
            self.send_output(i)
            return
        current = self.passes.pop(i)
        # Recomputed before the gradient is awaited: the two overlap.
        if current.replay is not None:
            self.record('recompute', i, lambda: self.recompute(i, current))
        tensors, grads = self.gradients(i, current)
        self.record('backward', i, lambda: self.backpropagate(tensors, grads))
        if action == self.step.last[self.j] and self.step.done is not None:
            # The partition's gradients are final: they may be all-reduced
            # while the partitions before it still run backward passes.
            self.step.done(self.j)
        self.send_gradients(i, current)

    def record(self, kind: str, i: int, work: Callable[[], T]) -> T:
        """Runs an action's work, labelled for a profiler and recorded by a timeline."""
        with label(kind, (i, self.j)):
            recorder = self.step.recorder
            if recorder is None:
                return work()
            return recorder.timed(kind, i, self.j, self.device, work)()

    def call(self, input: Batch, skips: StepSkips) -> Batch:
        """Runs the partition on ``input``, on copies unless it is known to leave its input alone.

        The input must stay as it is: a recomputation runs from it again,
        and a leaf requiring grad cannot be changed in place at all.
        """
        function = partition_function(self.partition, self.j, skips)
        return Batch(self.step.traits[self.j].call(function, tuple(input), input.with_tensors,
                                                   'train_step'))

    def receive(self, i: int) -> Batch:
        """The input of micro-batch ``i``: the mini-batch's, or what the partition before sent."""
        if self.j == 0:
            return self.step.batches[i]
        output, sent_grad, ready = self.step.mailbox.take(('F', i, self.j))
        input = Batch(output.plain, output.layout)
        input[:] = tuple(cast(Tensor, leaf(x, self.device, g, ready))
                         for x, g in zip(output, sent_grad))
        return input

    def forward(self, i: int, input: Batch) -> None:
        step, j, n = self.step, self.j, self.step.n
        skips = StepSkips(step.layout, j, self.device, step.mailbox, i)
        current = Pass(input, skips)
        checkpointed = i < step.checkpoint_stop
        # Not known yet whether the partition draws random numbers: the
        # generator is held (random_lock), so any change of its state is its
        # doing, or its loss's (the loss is part of the last partition's work).
        probe = cpu_rng_state() if step.draws_random(j) is None else None
        if checkpointed:
            current.replay = (save_rng_states(self.device), save_autocast_states())
            with torch.no_grad(), enable_checkpointing():
                output = self.call(input, skips)
        else:
            with torch.enable_grad():
                output = self.call(input, skips)
        if probe is not None:
            # The partition's own draws, without its loss's: the forward
            # path, which has no loss, shares what is learned here.
            step.traits[j].learn_draws(step.rng_keys[j], probe)
        current.output = output
        if j < n - 1:
            # Without a graph (checkpointed), a floating point output will
            # have one after the recomputation: the next leaf requires grad.
            current.sent_grad = [x.requires_grad or (checkpointed and x.is_floating_point())
                                 for x in output]
        else:
            with torch.enable_grad() if not checkpointed else nullcontext():
                loss = step.loss(i, output)
            step.losses[i] = loss.detach()
            current.loss = None if checkpointed else loss
            if probe is not None:
                step.loss_draws = not torch.equal(probe, cpu_rng_state())
        self.passes[i] = current

    def send_output(self, i: int) -> None:
        """Sends micro-batch ``i``'s output to the next partition."""
        if self.j < self.step.n - 1:
            current = self.passes[i]
            self.step.mailbox.put(('F', i, self.j + 1),
                                  (current.output, current.sent_grad, Ready(self.device)))

    def recompute(self, i: int, current: Pass) -> None:
        assert current.replay is not None
        rng_states, autocast_states = current.replay
        current.skips.replay = True
        with restore_rng_states(self.device, rng_states,
                                exclusive=self.step.draws_random(self.j) is not False), \
                restore_autocast_states(autocast_states), torch.enable_grad(), \
                enable_recomputing():
            current.output = self.call(current.input, current.skips)
            if self.j == self.step.n - 1:
                current.loss = self.step.loss(i, current.output)

    def gradients(self, i: int, current: Pass) -> Tuple[List[Tensor], List[Optional[Tensor]]]:
        """Waits for the gradients of micro-batch ``i``'s outputs and sent skips.

        Returns:
            the tensors to backpropagate from, and their gradients
        """
        step, j = self.step, self.j
        tensors: List[Tensor] = []
        grads: List[Optional[Tensor]] = []
        if current.loss is not None:
            tensors.append(current.loss)
            grads.append(None)
        else:
            assert current.output is not None
            received, ready = step.mailbox.take(('B', i, j))
            for x, g in zip(current.output, received):
                if x.requires_grad and g is not None:
                    tensors.append(x)
                    grads.append(ready.receive(g, x.device))
        for key, tensor in current.skips.sent.items():
            g, ready = step.mailbox.take(('S', i, key))
            if tensor is not None and tensor.requires_grad and g is not None:
                tensors.append(tensor)
                grads.append(ready.receive(g, tensor.device))
        return tensors, grads

    def backpropagate(self, tensors: List[Tensor], grads: List[Optional[Tensor]]) -> None:
        if tensors:
            torch.autograd.backward(tensors, grads)

    def send_gradients(self, i: int, current: Pass) -> None:
        """Sends the gradients of micro-batch ``i``'s input and popped skips back."""
        step, j = self.step, self.j
        ready = Ready(self.device)
        # The skips first: a mailbox to other processes holds them back until
        # the main message goes, and sends them right after it.
        for key, popped in current.skips.received.items():
            step.mailbox.put(('S', i, key), (None if popped is None else popped.grad, ready))
        if j > 0:
            step.mailbox.put(('B', i, j - 1), ([x.grad for x in current.input], ready))


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
        actions: the schedule, a list of actions per partition
        layout: where the skips go
        checkpoint_stop: micro-batches ``0 .. checkpoint_stop - 1`` are checkpointed
        traits: what runs showed about each partition (whether it draws random numbers)
        recorder: records the actions, inside :func:`torchgpipe.trace`
        schedule: the schedule's name, for the timeline
        mailbox: what carries messages between partitions (default: a new
            :class:`~torchgpipe.mailbox.Mailbox`, for partitions of this process)
        done: called with ``j`` once partition ``j``'s gradients are final,
            before it sends its last gradients back
    """

    def __init__(self, partitions: Sequence[Optional[nn.Sequential]],
                 devices: Sequence[torch.device],
                 batches: List[Batch], targets: List[TensorOrTensors], loss_fn: LossFunction,
                 weights: Sequence[float], actions: Sequence[Sequence[Action]],
                 layout: SkipLayout, checkpoint_stop: int, traits: Sequence[PartitionTraits],
                 recorder: Optional[Recorder], schedule: str = '', *,
                 mailbox: Optional[Mailbox] = None,
                 done: Optional[Callable[[int], None]] = None) -> None:
        self.n = len(partitions)
        self.devices = devices
        self.batches = batches
        self.targets = targets
        self.loss_fn = loss_fn
        self.weights = weights
        self.layout = layout
        self.checkpoint_stop = checkpoint_stop
        self.traits = traits
        self.recorder = recorder
        self.schedule = schedule
        self.mailbox = Mailbox() if mailbox is None else mailbox
        self.done = done
        self.losses: Dict[int, Tensor] = {}
        self.stages = {j: Stage(self, j, p, devices[j])
                       for j, p in enumerate(partitions) if p is not None}
        #: The last action of each partition here.
        self.last = {j: actions[j][-1] for j in self.stages if actions[j]}
        self.order = [a for cycle in clock_order(actions) for a in cycle if a.j in self.stages]
        self.threaded = len(distinct_devices([devices[j] for j in self.stages])) > 1
        self.rng_keys = [training_flags(p) if p is not None else () for p in partitions]
        #: Whether the last partition's forward, loss included, drew in this step.
        self.loss_draws: Optional[bool] = None

    def loss(self, i: int, output: Batch) -> Tensor:
        """The weighted loss of micro-batch ``i``."""
        loss = self.loss_fn(output.values, self.targets[i])
        if not isinstance(loss, Tensor) or loss.numel() != 1:
            shape = f' of shape {tuple(loss.shape)}' if isinstance(loss, Tensor) else ''
            raise TypeError(describe('loss_fn must return a tensor of one element (a reduced '
                                     'loss)', f'loss_fn returned {type(loss).__name__}{shape}',
                                     'reduce the loss inside loss_fn, e.g. F.mse_loss(output, '
                                     'target) with its default reduction, or .mean() of a '
                                     'per-sample loss'))
        return loss * self.weights[i]

    def draws_random(self, j: int) -> Optional[bool]:
        """Whether partition ``j``'s forward actions may draw from the CPU generator, if known.

        The loss is part of the last partition's forward actions. It may be
        another function at every call, so whether the two together draw is
        learned anew in every step, by the first of them (:attr:`loss_draws`).
        """
        drew = self.traits[j].draws(self.rng_keys[j])
        if j == self.n - 1 and drew is False:
            return self.loss_draws
        return drew

    def random_lock(self, j: int) -> ContextManager[Any]:
        """Holds the CPU generator while partition ``j`` runs a forward pass, if it may draw.

        On either path: a recomputation elsewhere (on another worker, or of
        another pipeline in another thread) swaps the generator's state for
        its own while it runs, and a task of another pipeline could draw
        between a checkpointed pass's save of the state and its draws, so
        a forward pass that may draw holds the generator throughout.
        """
        # Taken after the turn and the input came: never held while waiting
        # for another worker.
        return cpu_generator_held(self.draws_random(j) is not False)

    def run(self) -> Optional[Tensor]:
        """Runs the step; returns the loss of the mini-batch, without graph.

        Without the last partition here, there is no loss to return: ``None``.

        An exception of any action is raised here, as itself, once every
        worker has stopped.
        """
        if self.recorder is not None:
            self.recorder.begin_step(len(self.batches), self.devices,
                                     f'train_step (schedule {self.schedule!r})')
        # The actions of each device, in clock order. On threads, forward
        # actions of partitions that may draw random numbers take turns in
        # that order, so they draw what they would on one thread.
        turns = 0
        queues: Dict[torch.device, List[Tuple[int, Callable[[], None]]]] = {}
        for index, action in enumerate(self.order):
            work: Callable[[], None] = functools.partial(self.stages[action.j].run, action)
            if self.threaded and action.kind == 'F' and self.draws_random(action.j) is not False:
                work = self.in_turn(turns, work)
                turns += 1
            device = distinct_devices([self.devices[action.j]])[0]
            queues.setdefault(device, []).append((index, work))

        if not self.threaded:
            for device, works in queues.items():
                with use_device(device):
                    for _, work in works:
                        work()
        else:
            self.run_on_threads(queues)
        if self.n - 1 not in self.stages:
            return None
        return cast(Tensor, sum(self.losses[i].to(self.devices[-1])
                                for i in range(len(self.batches))))

    def in_turn(self, turn: int, work: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            self.mailbox.wait_turn(turn)
            try:
                work()
            finally:
                self.mailbox.end_turn()
        return run

    def run_on_threads(self, queues: Dict[torch.device, List[Tuple[int, Callable[[], None]]]]
                       ) -> None:
        failures: List[Tuple[int, ExcInfo]] = []
        grad_mode = torch.is_grad_enabled()
        autocast_states = save_autocast_states()
        held = cpu_generator_owned()

        def worker(device: torch.device, works: List[Tuple[int, Callable[[], None]]]) -> None:
            torch.set_grad_enabled(grad_mode)
            with use_device(device), restore_autocast_states(autocast_states), \
                    holding_for_caller(held):
                for index, work in works:
                    if self.mailbox.stopped:
                        return
                    try:
                        work()
                    except Stopped:
                        return
                    except BaseException:
                        failures.append((index, cast(ExcInfo, sys.exc_info())))
                        self.mailbox.stop()
                        return

        crew = Crew()
        try:
            for device, works in queues.items():
                crew.start(functools.partial(worker, device, works),
                           name=f'torchgpipe worker ({device})')
            crew.wait()
        except BaseException:
            # Ctrl-C in the calling thread: the workers stop before their
            # next action, and the step returns only once none is running.
            self.mailbox.stop()
            crew.stop()
            raise
        if failures:
            # The failure that came first in the schedule; the others may
            # follow from it.
            _, (_, exc, tb) = min(failures, key=lambda f: f[0])
            raise exc.with_traceback(tb)


def split_step(input: TensorOrTensors, target: TensorOrTensors, chunks: int, reduction: str,
               last_device: torch.device
               ) -> Tuple[List[Batch], List[TensorOrTensors], List[float]]:
    """Splits a training step's input and target into micro-batches, checked before any work.

    Returns:
        (batches, targets, weights): the input's micro-batches; the target's,
        on the last device, as the loss function sees them (NoChunk tensors
        unwrapped, as a layer sees its input); and the weight of each
        micro-batch's loss

    Raises:
        TypeError: the input or the target is not a tensor or a tuple of them
        ValueError: they cannot be split alike, or the mini-batch is empty
    """
    microbatch.check(input)
    microbatch.check(target, 'target')
    batches = microbatch.scatter(input, chunks)
    targets = microbatch.scatter(target, chunks, 'target')
    sizes = [b[0].size(0) for b in batches]
    target_sizes = [t[0].size(0) for t in targets]
    if sizes != target_sizes:
        raise ValueError(describe('target must split into the micro-batches the input does',
                                  f'input micro-batches of {sizes}, target of {target_sizes}',
                                  'give a target with one row per sample of the input'))
    total = sum(sizes)
    if not total:
        # The unwrapped model's mean loss would be nan: a step on an
        # empty batch is a data loader's leftover, not a training step.
        raise ValueError(describe('train_step needs at least one sample',
                                  'input: a mini-batch of 0 rows',
                                  'skip empty batches, e.g. with drop_last=True in the '
                                  'DataLoader'))
    for t in targets:
        t[:] = tuple(x.to(last_device) for x in t)
    weights = [size / total if reduction == 'mean' else 1.0 for size in sizes]
    return batches, [t.plain for t in targets], weights

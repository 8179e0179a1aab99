"""One partition in a training step: its forward and backward actions, and its messages.

In a step each partition's graph stands alone, cut at its input, and the
worker owning the partition runs its backward when the schedule says::

    partition j-1                           partition j
    F  x ─► layers ─► y ───── y ──────────► x' = y.detach(), requiring grad
                                             x' ─► layers ─► z ─► ...
    B  backward(y, dy) ◄──── dy = x'.grad ◄─ backward(z, dz)

A skip from partition ``a`` to ``b`` is cut the same way. Messages move on
the micro-batch's copy stream (:class:`~torchgpipe.foundation.copy.Ready`). A
checkpointed micro-batch's ``B`` (or ``I``) recomputes first, in the replay of
:mod:`torchgpipe.runtime.replay`; ``W`` comes later from what ``I`` kept
(:mod:`torchgpipe.engine.split`).
"""
import functools
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar, cast

import torch
from torch import Tensor, nn

from torchgpipe.engine.mailbox import (Activation, ForwardMessage, Gradient, Mailbox, Reply,
                                       SkipGradient, StepSkips, leaf)
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.split import WeightPass, input_pass
from torchgpipe.foundation.copy import Ready
from torchgpipe.foundation.microbatch import Batch
from torchgpipe.foundation.record import Recorder, label
from torchgpipe.foundation.rng import cpu_generator_held, training_flags, watch
from torchgpipe.foundation.stream import AbstractStream
from torchgpipe.runtime.partition import partition_function
from torchgpipe.runtime.replay import FirstPass, first_pass, recomputation
from torchgpipe.runtime.traits import PartitionTraits
from torchgpipe.runtime.worker import Stopped
from torchgpipe.skip.layout import SkipLayout

__all__: List[str] = []

T = TypeVar('T')


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
    #: The input micro-batches (read by partition 0, ``None`` where it runs elsewhere).
    batches: Sequence[Optional[Batch]]
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
        streams: its copy stream for each micro-batch, which moves what it
            sends and receives (default: its device's current stream)
    """

    def __init__(self, shared: Shared, j: int, partition: nn.Sequential, device: torch.device,
                 traits: PartitionTraits, last: Optional[Action],
                 streams: Optional[Sequence[AbstractStream]] = None) -> None:
        self.shared = shared
        self.streams = streams
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

    def stream(self, i: int) -> Optional[AbstractStream]:
        """The copy stream of micro-batch ``i``'s messages, if any."""
        return None if self.streams is None else self.streams[i]

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
            # torchgpipe.foundation.rng): a first pass from before it saves the state.
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
            return cast(Batch, self.shared.batches[i])
        output, sent_grad, ready = self.shared.mailbox.take(Activation(i, self.j))
        input = Batch(output.plain, output.layout)
        input[:] = tuple(cast(Tensor, leaf(x, self.device, g, ready, self.stream(i)))
                         for x, g in zip(output, sent_grad))
        return input

    def forward(self, i: int, input: Batch) -> None:
        shared = self.shared
        skips = StepSkips(shared.layout, self.j, self.device, shared.mailbox, i, shared.train,
                          self.stream(i))
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
        output = current.output
        if current.replay is not None and self.shared.loss is not None:
            # A checkpointed micro-batch's output, and the skips it sent, are
            # made again by its recomputation: held until then, they would
            # keep every such output of the step alive at once (the logits,
            # say), and on another device or rank every such skip. Let go
            # before the output goes: the next partition may run on at once.
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
        # The skips first: a mailbox to other processes holds them back until
        # the main message goes, and sends them right after it.
        for key, popped in current.skips.received.items():
            mailbox.put(SkipGradient(i, key),
                        Reply(None if popped is None else popped.grad, ready))
        if self.j > 0:
            mailbox.put(Gradient(i, self.j - 1), Reply([x.grad for x in current.input], ready))

"""The pipeline core: the partitions one process holds, and the steps that run them.

The modules are faces (checks, registration, state dicts); what runs is their ``core``::

    GPipe ──────────────► Core                 all partitions, a mailbox in memory
    DistributedGPipe ───► RankCore(Core)       this rank's partitions, the wire
"""
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, cast

import torch
from torch import nn

from torchgpipe.engine.evaluation import (check_evaluation, evaluating, forward_only, join,
                                          split_evaluation)
from torchgpipe.engine.generators import check_schedule, resolve
from torchgpipe.engine.inputs import split_step
from torchgpipe.engine.mailbox import Mailbox
from torchgpipe.engine.pipeline import Pipeline
from torchgpipe.engine.schedule import Schedule, ScheduleLike
from torchgpipe.engine.step import LossFunction, Step
from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.stream import current_stream, use_device
from torchgpipe.foundation.tied import shares_apart, tied_masters
from torchgpipe.foundation.validation import check_one_process, check_step, describe
from torchgpipe.runtime.batchnorm import DeferredBatchNorm, deferred_step
from torchgpipe.runtime.checkpoint import checkpoint_stop
from torchgpipe.runtime.state import RunState
from torchgpipe.runtime.traits import PartitionTraits
from torchgpipe.runtime.worker import distinct_devices
from torchgpipe.skip.layout import SkipLayout

__all__ = ['Core', 'CoreModule']

#: Called with ``j`` once partition ``j`` has no backward pass left in the step.
Done = Callable[[int], None]


class Core:
    """One process's share of a pipeline, and the steps that run it."""

    def __init__(self, partitions: Dict[int, nn.Sequential], devices: Sequence[torch.device],
                 skip_layout: SkipLayout, chunks: int, checkpoint: str) -> None:
        self.partitions = partitions
        self.devices = list(devices)
        self.skip_layout = skip_layout
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norms = [m for p in partitions.values() for m in p.modules()
                                     if isinstance(m, DeferredBatchNorm)]
        #: The layers that refuse a mode they have no code for (captured in one mode).
        self.mode_checked = [m for p in partitions.values() for m in p.modules()
                             if callable(getattr(type(m), 'check_mode', None))]
        self.state = RunState(len(partitions))
        #: The intra-op threads its plan measured with, if any; compared once.
        self.planned_threads: Optional[int] = None
        self.threads_checked = False

    def check_threads(self) -> None:
        """Warns at the first step if its intra-op threads are not those its plan measured."""
        if self.threads_checked:
            return
        self.threads_checked = True
        now = torch.get_num_threads()
        if self.planned_threads is not None and now != self.planned_threads:
            warnings.warn(describe(
                'the intra-op threads of a planned pipeline must be those its plan measured '
                'with, or its steps take another time than predicted',
                f'planned_threads: {self.planned_threads}, torch.get_num_threads(): {now}',
                f'call torch.set_num_threads({self.planned_threads}) before the first step, '
                'or plan again for the threads you train with'), UserWarning)

    def check_modes(self) -> None:
        """Raises a layer's ``check_mode()`` error before a step starts work."""
        for layer in self.mode_checked:
            getattr(layer, 'check_mode')()

    def stop(self, m: int, training: bool) -> int:
        """How many of ``m`` micro-batches are checkpointed, in this mode."""
        return checkpoint_stop(self.checkpoint, self.chunks, m, training)

    def step(self, batches: Sequence[Optional[microbatch.Batch]], targets: Sequence[Any],
             loss_fn: Optional[LossFunction], weights: List[float], plan: Schedule, stop: int,
             *, mailbox: Optional[Mailbox] = None, done: Optional[Done] = None,
             train: bool = True) -> Step:
        """A step of ``plan`` over the partitions here (``mailbox`` reaches the others)."""
        self.check_threads()
        n = len(self.devices)
        here = list(self.partitions)
        traits = [PartitionTraits() for _ in range(n)]
        for k, j in enumerate(here):
            traits[j] = self.state.traits[k]
        streams = dict(zip(here, self.state.ensure_copy_streams(
            [self.devices[j] for j in here], self.chunks)))
        return Step([self.partitions.get(j) for j in range(n)], self.devices, batches, targets,
                    loss_fn, weights, plan, self.skip_layout, stop, traits,
                    self.state.recorder, mailbox=mailbox, done=done, train=train,
                    copy_streams=[streams.get(j) for j in range(n)])

    def tied(self) -> List[nn.Parameter]:
        """The parameters several partitions use."""
        return tied_masters(list(self.partitions.values()))

    def forward(self, batches: List[microbatch.Batch], training: bool) -> None:
        """0.0.7's forward: one autograd graph, in clock cycles, for the caller's backward."""
        self.check_modes()
        self.check_threads()
        microbatch.move(batches, self.devices[0])
        streams = [current_stream(d) for d in self.devices]
        with use_device(self.devices[0]):
            copy_streams = self.state.ensure_copy_streams(self.devices, self.chunks)
        pipeline = Pipeline(batches, list(self.partitions.values()), self.devices, copy_streams,
                            streams, self.skip_layout, self.stop(len(batches), training),
                            self.state.traits, self.state.recorder)
        # Deferred BatchNorm commits after this many (a short batch has fewer), or never
        # if the step fails.
        with deferred_step(self.deferred_batch_norms, len(batches)):
            pipeline.run()

    def train(self, input: TensorOrTensors, target: TensorOrTensors, loss_fn: LossFunction,
              schedule: ScheduleLike, reduction: str, training: bool,
              done: Optional[Done] = None) -> torch.Tensor:
        """:meth:`~torchgpipe.GPipe.train_step`, its arguments checked."""
        # Before the input is split: that of an empty pipeline's forward fails.
        if not self.devices:
            raise ValueError('train_step needs at least one layer: this GPipe is empty')
        self.check_modes()
        batches, targets, weights = split_step(input, target, self.chunks, reduction,
                                               self.devices[-1])
        m, n = len(batches), len(self.devices)
        plan = resolve(schedule, m, n, [distinct_devices([d])[0] for d in self.devices])
        microbatch.move(batches, self.devices[0])
        step = self.step(batches, targets, loss_fn, weights, plan, self.stop(m, training),
                         done=done)
        partitions = list(self.partitions.values())
        with deferred_step(self.deferred_batch_norms, m), shares_apart(partitions):
            loss = step.run()
        assert loss is not None  # every partition is here
        return loss

    def evaluate(self, input: TensorOrTensors, target: Optional[TensorOrTensors],
                 loss_fn: Optional[LossFunction], reduction: str,
                 output_fn: Optional[Callable[[TensorOrTensors], Any]]) -> Any:
        """:meth:`~torchgpipe.GPipe.eval_step`, its arguments checked, in evaluation mode."""
        if not self.devices:
            raise ValueError('eval_step needs at least one layer: this GPipe is empty')
        self.check_modes()
        batches, targets, weights = split_evaluation(input, target, self.chunks, reduction,
                                                     self.devices[-1])
        microbatch.move(batches, self.devices[0])
        step = self.step(batches, targets, loss_fn, weights,
                         forward_only(len(batches), len(self.devices)), 0, train=False)
        loss = step.run()
        if loss is not None:
            return loss
        output = join(step.outputs())
        return output if output_fn is None else output_fn(cast(TensorOrTensors, output))


class CoreModule(nn.Module):
    """A module whose settings live in, and whose checked steps run on, its :class:`Core`."""

    core: Core

    @property
    def chunks(self) -> int:
        """The number of micro-batches."""
        return self.core.chunks

    @chunks.setter
    def chunks(self, chunks: int) -> None:
        self.core.chunks = chunks

    @property
    def checkpoint(self) -> str:
        """The checkpoint mode, ``'always'``, ``'except_last'`` (every micro-batch but
        the last of ``chunks``) or ``'never'``."""
        return self.core.checkpoint

    @checkpoint.setter
    def checkpoint(self, checkpoint: str) -> None:
        self.core.checkpoint = checkpoint

    def train_step(self, input: TensorOrTensors, target: TensorOrTensors,
                   loss_fn: Callable[[TensorOrTensors, TensorOrTensors], torch.Tensor], *,
                   schedule: ScheduleLike = '1f1b', reduction: str = 'mean') -> torch.Tensor:
        """Runs the forward and backward passes of a mini-batch, as ``schedule`` orders them.

        Every parameter's ``.grad`` then holds (added to what it held) what
        ``loss_fn(model(input), target).backward()`` gives the unwrapped model.

        Args:
            input (torch.Tensor or tuple): as :meth:`~torchgpipe.GPipe.forward` takes it
            target (torch.Tensor or tuple): split like the input (a
                :class:`~torchgpipe.NoChunk` tensor goes whole to every loss)
            loss_fn (callable): ``loss_fn(output, target)`` of one micro-batch, returning
                one element; called again in a recomputation (see
                :func:`~torchgpipe.is_recomputing`)
            schedule (str or schedule): ``'1f1b'`` (default), ``'fill_drain'``,
                ``'interleaved_1f1b'``, ``'zb_h1'``, ``'zbv'``, or one's own
                (:doc:`/schedules`)
            reduction (str): how ``loss_fn`` reduces a micro-batch, ``'mean'``
                (default: each loss weighted by its share of the mini-batch) or ``'sum'``

        Returns:
            torch.Tensor: the loss of the mini-batch, on the last device, without history

        Raises:
            ValueError: an unknown ``schedule`` or ``reduction``, a schedule that does not
                fit, a target that does not split like the input, an empty mini-batch
            TypeError: ``schedule`` or ``reduction`` of another type, or a ``loss_fn``
                not callable or not returning one element
            RuntimeError: gradients disabled, or several processes (see
                :func:`torchgpipe.distributed.train_step`)

        Example::

            >>> model = GPipe(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
            ...               balance=[2, 1], devices=['cpu:0', 'cpu:1'], chunks=4,
            ...               checkpoint='never')
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> input, target = torch.randn(16, 4), torch.randn(16, 2)
            >>> optimizer.zero_grad()
            >>> loss = model.train_step(input, target, F.mse_loss)
            >>> optimizer.step()
            >>> loss.shape
            torch.Size([])
        """
        check_schedule(schedule)
        check_step(reduction, loss_fn)
        check_one_process()
        return self.core.train(input, target, loss_fn, schedule, reduction, self.training)

    def eval_step(self, input: TensorOrTensors, target: Optional[TensorOrTensors] = None,
                  loss_fn: Optional[LossFunction] = None, *, reduction: str = 'mean',
                  output_fn: Optional[Callable[[TensorOrTensors], Any]] = None) -> Any:
        """Evaluates a mini-batch, as ``model.eval()`` and :func:`torch.no_grad` would the
        unwrapped model; the layers are back in their own mode after.

        Args:
            input (torch.Tensor or tuple): the mini-batch
            target (torch.Tensor or tuple, optional): with ``loss_fn``, the target
            loss_fn (callable, optional): as for :meth:`train_step`
            reduction (str): as for :meth:`train_step`
            output_fn (callable, optional): without ``loss_fn``, what to return of the
                output (the argmax of the logits, say)

        Returns:
            the loss of the mini-batch with ``loss_fn``; else the output (or ``output_fn`` of it)

        Raises:
            ValueError: only one of ``target`` and ``loss_fn``, or ``output_fn`` with
                them; or as for :meth:`train_step`
            TypeError: ``output_fn`` not callable; or as for :meth:`train_step`

        Example::

            >>> model = GPipe(nn.Sequential(nn.Linear(4, 8), nn.Dropout(), nn.Linear(8, 2)),
            ...               balance=[2, 1], devices=['cpu', 'cpu'], chunks=4)
            >>> input, target = torch.randn(16, 4), torch.randn(16, 2)
            >>> model.eval_step(input, target, F.mse_loss).requires_grad
            False
            >>> model.eval_step(input).shape
            torch.Size([16, 2])
            >>> model.training                   # as it was
            True
        """
        check_evaluation(target, loss_fn, reduction, output_fn)
        with evaluating(self):
            return self.core.evaluate(input, target, loss_fn, reduction, output_fn)

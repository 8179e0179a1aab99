"""The steps of :class:`~torchgpipe.GPipe` on the engine of ``torchgpipe.train``.

:meth:`GPipe.forward <torchgpipe.GPipe.forward>` runs the forward path
(:mod:`torchgpipe.pipeline`), whose backward pass is the caller's. The steps
here run every pass themselves, on the engine of a training step
(:class:`~torchgpipe.train.step.Step`) over the same partitions, devices and
workers: :meth:`~Steps.train_step` the forward and backward passes in the
order of a schedule, :meth:`~Steps.eval_step` the forward passes alone,
without autograd. :class:`~torchgpipe.GPipe` has them from :class:`Steps`.
"""
from typing import Any, Callable, List, Optional, cast

import torch
from torch import nn

from torchgpipe.batchnorm import DeferredBatchNorm, deferred_step
from torchgpipe.microbatch import Batch, TensorOrTensors
from torchgpipe.skip.layout import SkipLayout
from torchgpipe.state import RunState
from torchgpipe.stream import AbstractStream
from torchgpipe.tied import shares_apart
from torchgpipe.train.evaluation import (check_evaluation, evaluating, forward_only, join,
                                         split_evaluation)
from torchgpipe.train.generators import check_schedule, resolve
from torchgpipe.train.inputs import split_step
from torchgpipe.train.schedule import ScheduleLike
from torchgpipe.train.step import LossFunction, Step
from torchgpipe.validation import check_one_process, check_step
from torchgpipe.worker import distinct_devices

__all__: List[str] = []


class Steps:
    """The methods of :class:`~torchgpipe.GPipe` that run a whole step."""

    # What GPipe gives them.
    devices: List[torch.device]
    chunks: int
    _skip_layout: SkipLayout
    _run_state: RunState
    _deferred_batch_norms: List[DeferredBatchNorm]
    _partitions: Callable[[], List[nn.Sequential]]
    _prepare: Callable[[List[Batch]], int]
    _ensure_copy_streams: Callable[[], List[List[AbstractStream]]]

    def train_step(self, input: TensorOrTensors, target: TensorOrTensors,
                   loss_fn: Callable[[TensorOrTensors, TensorOrTensors], torch.Tensor], *,
                   schedule: ScheduleLike = '1f1b', reduction: str = 'mean') -> torch.Tensor:
        """Runs the forward and backward passes of a mini-batch, scheduled by the pipeline.

        After it, every parameter's ``.grad`` holds (added to what it held)
        what ``loss_fn(model(input), target).backward()`` gives the
        unwrapped model. Unlike :meth:`~torchgpipe.GPipe.forward` followed by ``backward()``,
        the backward pass of each partition runs in the worker of its
        device, interleaved with forward passes as ``schedule`` says, so
        devices work on forward and backward passes at once, CPU devices
        with distinct indices included.

        The input and the target are split into micro-batches alike; the
        loss of each micro-batch is weighted by its share of the mini-batch
        (``reduction='mean'``, for a loss averaged over the samples: the
        default of PyTorch's losses) or not weighted (``reduction='sum'``,
        for a summed loss), so that the gradients are those of the loss of
        the whole mini-batch.

        Args:
            input (torch.Tensor or tuple): the mini-batch, as
                :meth:`~torchgpipe.GPipe.forward` takes it
            target (torch.Tensor or tuple): the target, split along dimension
                0 like the input (a :class:`~torchgpipe.NoChunk` tensor of a
                tuple is given whole, unwrapped, to every micro-batch's
                loss); moved to the last device
            loss_fn (callable): ``loss_fn(output, target)`` of one
                micro-batch, returning a tensor of one element. It is called
                once per micro-batch, and once more for each checkpointed
                micro-batch, when its backward action recomputes the last
                partition: then :func:`~torchgpipe.is_recomputing` is true,
                and random numbers it draws are the first call's
            schedule (str or schedule): ``'1f1b'`` (default), ``'fill_drain'``,
                ``'interleaved_1f1b'``, ``'zb_h1'``, ``'zbv'``, or a schedule of
                one's own: see :doc:`/schedules` for what each keeps and leaves idle
            reduction (str): ``'mean'`` (default) or ``'sum'``: how ``loss_fn``
                reduces a micro-batch

        Returns:
            torch.Tensor: the loss of the mini-batch, on the last device,
            without autograd history

        Raises:
            ValueError: an unknown ``schedule`` or ``reduction``, a schedule
                that does not fit the step or the devices, a target that does
                not split like the input, an empty mini-batch, or no layers
            TypeError: ``schedule`` or ``reduction`` of another type, or
                ``loss_fn`` not callable or not returning one element
            RuntimeError: called with gradients disabled, or in a
                torch.distributed job of several processes (for data
                parallelism, use :func:`torchgpipe.distributed.train_step`)

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
        return self._train_step(input, target, loss_fn, schedule, reduction)

    def eval_step(self, input: TensorOrTensors, target: Optional[TensorOrTensors] = None,
                  loss_fn: Optional[LossFunction] = None, *, reduction: str = 'mean',
                  output_fn: Optional[Callable[[TensorOrTensors], Any]] = None) -> Any:
        """Evaluates the pipeline on a mini-batch: its output, or its loss.

        What ``model.eval()`` and :func:`torch.no_grad` give the unwrapped
        model, run by the engine of :meth:`train_step` with forward actions
        alone: the layers are in evaluation mode for the step (and back in
        their own mode after), so that dropout is off and BatchNorm
        (deferred or not) uses and keeps its running statistics. As
        :meth:`DistributedGPipe.eval_step
        <torchgpipe.distributed.DistributedGPipe.eval_step>` does across
        processes.

        Args:
            input (torch.Tensor or tuple): the mini-batch, as
                :meth:`~torchgpipe.GPipe.forward` takes it
            target (torch.Tensor or tuple, optional): with ``loss_fn``, the
                target, split as the input
            loss_fn (callable, optional): ``loss_fn(output, target)`` of a
                micro-batch, weighted as :meth:`train_step` weights it
            reduction (str): ``'mean'`` (default) or ``'sum'``, as for :meth:`train_step`
            output_fn (callable, optional): without ``loss_fn``, what to
                return of the output (the argmax of the logits, say)

        Returns:
            with ``loss_fn``, the loss of the mini-batch, as :meth:`train_step`
            returns it; without, the output, as :meth:`~torchgpipe.GPipe.forward`
            returns it, or ``output_fn(output)``

        Raises:
            ValueError: ``target`` without ``loss_fn``, or the other way, or
                ``output_fn`` with ``loss_fn``; or as for :meth:`train_step`
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
        if not self.devices:
            raise ValueError('eval_step needs at least one layer: this GPipe is empty')
        with evaluating(cast(nn.Module, self)):
            batches, targets, weights = split_evaluation(input, target, self.chunks, reduction,
                                                         self.devices[-1])
            self._prepare(batches)
            step = Step(self._partitions(), self.devices, batches, targets, loss_fn, weights,
                        forward_only(len(batches), len(self.devices)), self._skip_layout, 0,
                        self._run_state.traits, self._run_state.recorder, train=False,
                        copy_streams=self._ensure_copy_streams())
            loss = step.run()
            if loss is not None:
                return loss
            output = join(step.outputs())
            return output if output_fn is None else output_fn(cast(TensorOrTensors, output))

    def _train_step(self, input: TensorOrTensors, target: TensorOrTensors,
                    loss_fn: LossFunction, schedule: ScheduleLike, reduction: str,
                    done: Optional[Callable[[int], None]] = None) -> torch.Tensor:
        """:meth:`train_step` with checked arguments; ``done(j)`` as for :class:`Step`."""
        # Before the input is split: that of an empty GPipe's forward fails.
        if not self.devices:
            raise ValueError('train_step needs at least one layer: this GPipe is empty')
        batches, targets, weights = split_step(input, target, self.chunks, reduction,
                                               self.devices[-1])
        m, n = len(batches), len(self.devices)
        plan = resolve(schedule, m, n, [distinct_devices([d])[0] for d in self.devices])
        step = Step(self._partitions(), self.devices, batches, targets, loss_fn, weights, plan,
                    self._skip_layout, self._prepare(batches), self._run_state.traits,
                    self._run_state.recorder, done=done,
                    copy_streams=self._ensure_copy_streams())
        with deferred_step(self._deferred_batch_norms, m), shares_apart(self._partitions()):
            loss = step.run()
        assert loss is not None  # every partition is here
        return loss

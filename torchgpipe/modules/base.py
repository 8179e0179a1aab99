"""The faces' shared base: :class:`CoreModule`, whose :meth:`~CoreModule.build` checks what
:class:`~torchgpipe.GPipe` and :class:`~torchgpipe.distributed.DistributedGPipe` both take
and splits the module into partitions, and whose steps run on its
:class:`~torchgpipe.engine.core.Core`."""
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import nn

from torchgpipe.engine.core import Core, evaluating, refuse
from torchgpipe.engine.schedule import ScheduleLike
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.placement import check_materialized
from torchgpipe.foundation.tied import find_ties, place_partitions
from torchgpipe.foundation.validation import (check_checkpoint, check_chunks,
                                              check_one_process, check_planned_threads,
                                              verify_module)
from torchgpipe.runtime.batchnorm import DeferredBatchNorm
from torchgpipe.skip.layout import SkipLayout, inspect_skip_layout
from torchgpipe.skip.skippable import verify_skippables

__all__ = ['CoreModule']

#: What a core keeps of the arguments both faces take (see :meth:`CoreModule.build`).
Settings = Tuple[SkipLayout, int, str, Optional[int]]


class CoreModule(nn.Module):
    """A module whose settings live in, and whose checked steps run on, its
    :class:`~torchgpipe.engine.core.Core`."""

    core: Core
    #: Whether this process's layers may stay on the meta device, materialized after
    #: the pipeline is built (as a rank of a model no rank could build whole does).
    keeps_meta_layers = False

    def build(self, module: nn.Sequential, balance: Any, chunks: int, checkpoint: str,
              deferred_batch_norm: bool, planned_threads: Optional[int],
              locate: Callable[[Any], Tuple[List[int], Sequence[Optional[torch.device]]]],
              agree: Callable[[Optional[Exception], List[int], str, bool], None] = refuse,
              ) -> Tuple[List[nn.Sequential], Dict[int, nn.Sequential], Settings]:
        """Splits ``module`` into partitions, BatchNorm deferred if asked, and places this
        process's, tied (see ``place_partitions``), once the arguments are checked (the
        face's own by ``locate(balance)``, which returns the balance and each partition's
        device, ``None`` if another process's) and every process agrees (``agree``). Returns the
        partitions, this process's by index, and the core's skip layout, chunks, checkpoint
        and planned threads."""
        devices: Sequence[Optional[torch.device]] = ()
        deferred, problem = False, None
        try:
            deferred = bool(deferred_batch_norm)
            verify_module(module)
            balance, devices = locate(balance)
            if not self.keeps_meta_layers:
                check_materialized(module, balance, devices)
            chunks = check_chunks(chunks)
            planned_threads = check_planned_threads(planned_threads)
            checkpoint = str(checkpoint)  # (the ranks compare it, refused or not)
            check_checkpoint(checkpoint)
            verify_skippables(module)
        except Exception as exc:
            problem = exc
        agree(problem, balance, checkpoint, deferred)
        if deferred:
            module = cast(nn.Sequential,
                          DeferredBatchNorm.convert_deferred_batch_norm(module, chunks))
        self.balance = balance
        children = iter(module.named_children())
        partitions = [nn.Sequential(OrderedDict(next(children) for _ in range(n)))
                      for n in balance]
        find_ties(partitions)  # in any process's partitions
        here = {j: p for j, (p, d) in enumerate(zip(partitions, devices)) if d is not None}
        place_partitions(list(here.values()), [d for d in devices if d is not None])
        return partitions, here, (inspect_skip_layout(partitions), chunks, checkpoint,
                                  planned_threads)

    @property
    def chunks(self) -> int:
        """The number of micro-batches."""
        return self.core.chunks

    @chunks.setter
    def chunks(self, chunks: int) -> None:
        self.core.chunks = chunks

    @property
    def checkpoint(self) -> str:
        """The checkpoint mode, ``'always'``, ``'except_last'`` or ``'never'``."""
        return self.core.checkpoint

    @checkpoint.setter
    def checkpoint(self, checkpoint: str) -> None:
        self.core.checkpoint = checkpoint

    def train_step(self, input: TensorOrTensors, target: TensorOrTensors,
                   loss_fn: Callable[[TensorOrTensors, TensorOrTensors], torch.Tensor], *,
                   schedule: ScheduleLike = '1f1b', reduction: str = 'mean') -> torch.Tensor:
        """Runs the forward and backward passes of a mini-batch, as ``schedule`` orders them:
        ``.grad`` adds what ``loss_fn(model(input), target).backward()`` gives the unwrapped model.

        Args:
            input (torch.Tensor or tuple): as :meth:`~torchgpipe.GPipe.forward` takes it
            target (torch.Tensor or tuple): split like the input (:class:`~torchgpipe.NoChunk`
                tensors go whole to every loss)
            loss_fn (callable): ``loss_fn(output, target)`` of one micro-batch, one element;
                called again in a recomputation (see :func:`~torchgpipe.is_recomputing`)
            schedule (str or schedule): ``'1f1b'`` (default), ``'fill_drain'``,
                ``'interleaved_1f1b'``, ``'zb_h1'``, ``'zbv'`` or one's own (:doc:`/schedules`)
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
            ...               balance=[2, 1], devices=['cpu:0', 'cpu:1'], chunks=4)
            >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            >>> optimizer.zero_grad()
            >>> loss = model.train_step(torch.randn(16, 4), torch.randn(16, 2), F.mse_loss)
            >>> optimizer.step()
        """
        check_one_process()
        return self.core.train(input, target, loss_fn, schedule, reduction, self.training)

    def eval_step(self, input: TensorOrTensors, target: Optional[TensorOrTensors] = None,
                  loss_fn: Optional[LossFunction] = None, *, reduction: str = 'mean',
                  output_fn: Optional[Callable[[TensorOrTensors], Any]] = None) -> Any:
        """Evaluates a mini-batch as ``model.eval()`` and :func:`torch.no_grad` would the
        unwrapped model, the layers back in their own mode after.

        Args:
            input (torch.Tensor or tuple): the mini-batch
            target (torch.Tensor or tuple, optional): with ``loss_fn``, the target
            loss_fn (callable, optional): as for :meth:`train_step`
            reduction (str): as for :meth:`train_step`
            output_fn (callable, optional): without ``loss_fn``, what to return of the output

        Returns:
            the loss of the mini-batch with ``loss_fn``; else the output (or ``output_fn`` of it)

        Raises:
            ValueError: only one of ``target`` and ``loss_fn``, or ``output_fn`` with them;
                or as for :meth:`train_step`
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
        with evaluating(self):
            return self.core.evaluate(input, target, loss_fn, reduction, output_fn)

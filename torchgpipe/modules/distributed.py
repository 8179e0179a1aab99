"""DistributedGPipe: a pipeline whose partitions are the processes of a group, one or more each."""
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.module import _IncompatibleKeys

from torchgpipe.engine.core import evaluating
from torchgpipe.engine.schedule import ScheduleLike
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.placement import same_memory
from torchgpipe.foundation.validation import (check_balance, check_device, check_process_group,
                                              check_timeout, describe)
from torchgpipe.modules.base import CoreModule
from torchgpipe.processes.core import RankCore, agree_on_layout, ranks_of_partitions
from torchgpipe.processes.tied import (TiedGradients, check_finite, clip_grads, slots,
                                       ties_across_ranks, total_norm)

__all__ = ['DistributedGPipe']


class DistributedGPipe(CoreModule):
    """Trains an :class:`nn.Sequential <torch.nn.Sequential>` as a pipeline whose
    partitions are the processes of a :mod:`torch.distributed` group (:doc:`/scaling_out`).

    Every rank builds the same ``module`` and keeps its partitions' layers, under their
    unwrapped names, with the unwrapped module's gradients after :meth:`train_step` (a
    parameter tied across ranks has an equal copy on each).

    Args:
        module (torch.nn.Sequential): the whole module, the same on every rank
        balance (ints): the number of layers of each partition, one or ``v`` per rank

    Keyword Args:
        chunks (int): number of micro-batches (default: ``1``)
        checkpoint (str): ``'always'``, ``'except_last'`` (default) or ``'never'``
        group (torch.distributed.ProcessGroup, optional): the pipeline's processes
            (default: the default group)
        device (torch.device, str or int, optional): this process's device (default: the CPU)
        deferred_batch_norm (bool): as for :class:`~torchgpipe.GPipe` (default: ``False``)
        placement (str): with ``v`` partitions per rank, ``'loop'`` (default; partition ``j``
            on rank ``j % size``) or ``'v'`` (rank ``r`` keeps ``r`` and ``2 size - 1 - r``)
        timeout (float, optional): seconds a rank waits within a step before raising
            :class:`~torchgpipe.distributed.StepTimeout` (default: the process group's)
        planned_threads (int, optional): as for :class:`~torchgpipe.GPipe` (default: ``None``)

    Raises:
        RuntimeError: torch.distributed is not initialized
        TypeError, ValueError: as for :class:`~torchgpipe.GPipe`; also a balance whose
            length is not a multiple of the group's size, or an unknown ``placement``
        ValueError: on every rank, before any layer moves, if the ranks differ in arguments
            or layers; on the others, if one rank raises above

    Example::

        # torchrun --nproc_per_node 2 train.py
        dist.init_process_group('gloo')
        model = nn.Sequential(...)               # the same on every rank
        pipe = DistributedGPipe(model, balance=[4, 4], chunks=8)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        for input, target in loader:             # the same batches on every rank
            optimizer.zero_grad()
            loss = pipe.train_step(input, target, F.cross_entropy)
            optimizer.step()
    """

    core: RankCore
    keeps_meta_layers = True

    def __init__(self, module: nn.Sequential, balance: Iterable[int], *, chunks: int = 1,
                 checkpoint: str = 'except_last', group: Optional[dist.ProcessGroup] = None,
                 device: Optional[Union[torch.device, str, int]] = None,
                 deferred_batch_norm: bool = False, placement: str = 'loop',
                 timeout: Optional[float] = None,
                 planned_threads: Optional[int] = None) -> None:
        super().__init__()
        check_process_group('DistributedGPipe', group,
                            'build the DistributedGPipe only on the ranks of its group, '
                            'giving each rank its own pipeline group')
        size = dist.get_world_size(group)
        self.ranks = [dist.get_global_rank(group, r) if group is not None else r
                      for r in range(size)]
        self.placement = placement
        self.group = group
        self.rank = dist.get_rank(group)
        this_device: Optional[torch.device] = None  # once checked

        def locate(balance: Iterable[int]) -> Tuple[List[int], List[Optional[torch.device]]]:
            nonlocal this_device, timeout
            this_device = check_device(device, "give this process's device, such as "
                                               "device='cpu'")
            balance = check_balance(module, balance)
            #: The rank (in the group) of each partition.
            self.rank_of = ranks_of_partitions(balance, size, placement)
            timeout = check_timeout(timeout)
            return balance, [this_device if r == self.rank else None for r in self.rank_of]

        fresh = False  # whether the pipeline needs new channels (see agree_on_layout)

        def agree(problem: Optional[Exception], balance: List[int], checkpoint: str,
                  deferred: bool) -> None:
            nonlocal fresh
            # Before any layer moves, every rank refuses if one cannot build or cuts differently.
            fresh = agree_on_layout(module, {'balance': balance, 'placement': placement,
                                             'checkpoint': checkpoint,
                                             'deferred_batch_norm': deferred},
                                    problem, group, self.ranks, this_device)
        partitions, here, settings = self.build(module, balance, chunks, checkpoint,
                                                deferred_batch_norm, planned_threads, locate,
                                                agree)
        assert this_device is not None  # else agree_on_layout raised
        self.device = this_device
        #: The slot of each parameter's norm, by every name (see clip_grad_norm_).
        self._slots = slots(module)
        for partition in here.values():
            for name, layer in partition.named_children():
                self.add_module(name, layer)
        if next(self.parameters(), None) is None:
            # Before the optimizer built next refuses the empty list in words about itself.
            warnings.warn(f'rank {self.rank} of the pipeline holds no parameters (its layers: '
                          f'{", ".join(self._modules) or "none"}): torch.optim refuses an '
                          'empty parameter list, so build an optimizer only where '
                          'list(pipe.parameters()) is not empty, and step it there',
                          UserWarning, stacklevel=2)
        tied = TiedGradients(ties_across_ranks(
            partitions, [self.ranks[r] for r in self.rank_of], dist.get_rank()), dist.get_rank(),
            list(here.values()))
        #: The names of the layers of the other partitions.
        self._others = [name for j, p in enumerate(partitions) if j not in here
                        for name, _ in p.named_children()]
        self.core = RankCore(here, self.device, self.rank_of, self.ranks, group, tied, timeout,
                             fresh, *settings)

    @property
    def timeout(self) -> Optional[float]:
        """The step timeout in seconds, or ``None``; set it between steps, alike on every rank."""
        return self.core.timeout

    @timeout.setter
    def timeout(self, timeout: Optional[float]) -> None:
        self.core.timeout = check_timeout(timeout)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused (``TypeError``): no one process holds the output; see :meth:`eval_step`."""
        raise TypeError('a DistributedGPipe is not called: train it with train_step(input, '
                        'target, loss_fn), and evaluate it with eval_step(input), on every '
                        'rank')

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError('a DistributedGPipe belongs to its processes and cannot be copied or '
                        'pickled; save its state_dict() instead, which has the keys of the '
                        'unwrapped module')

    def to_empty(self, *, device: Optional[Union[torch.device, str, int]] = None,
                 recurse: bool = True) -> 'DistributedGPipe':
        """Gives this rank's layers built on the meta device memory on its device, as
        :meth:`torch.nn.Module.to_empty` does: every parameter and buffer of this rank gets
        new memory, uninitialized (initialize them next); a parameter several of them share
        stays one. Other ranks' layers are not held.

        Args:
            device (torch.device, str or int, optional): this rank's device, the default
                and the only one taken
            recurse (bool): as for :meth:`torch.nn.Module.to_empty`

        Raises:
            ValueError: another device

        Example::

            with torch.device('meta'):
                model = build()                  # no memory for any layer
            pipe = DistributedGPipe(model, [4, 4], chunks=8)
            pipe.to_empty()                      # memory for this rank's layers
            for layer in pipe.children():
                layer.reset_parameters()         # or load a checkpoint
        """
        if device is not None and not same_memory(torch.device(device), self.device):
            raise ValueError(describe("a pipeline's layers are materialized on its device",
                                      f'device: {device!r}, the pipeline on {self.device}',
                                      'leave device out'))
        # Module.to_empty makes one new tensor per use: a tied parameter would come apart.
        first: Dict[int, Tuple[Dict[str, Any], str]] = {}
        uses = [(held, name, first.setdefault(id(t), (held, name)))
                for m in self.modules() for held in (m._parameters, m._buffers)
                for name, t in held.items() if t is not None]
        super().to_empty(device=self.device, recurse=recurse)
        for held, name, (held_first, name_first) in uses:
            held[name] = held_first[name_first]
        return self

    def partition(self) -> nn.Sequential:
        """This process's layers, in order, as one sequential module."""
        return nn.Sequential(OrderedDict(self.named_children()))

    def train_step(self, input: Optional[TensorOrTensors], target: Optional[TensorOrTensors],
                   loss_fn: LossFunction, *, schedule: ScheduleLike = '1f1b',
                   reduction: str = 'mean') -> Tensor:
        """Runs a training step of the pipeline; every rank of the group calls it, with
        :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>`'s arguments (only the first
        partition's rank needs ``input``, the last one's ``target``: others may pass ``None``).

        Returns:
            torch.Tensor: the loss of the mini-batch, on every rank's device, without history

        Raises:
            PeerFailed: another rank failed, disconnected or stopped answering in this step;
                every rank raises (the failing one its own error): restart from a checkpoint
            RuntimeError: an earlier step failed
            ValueError: on every rank, if they were called for different steps or lack their
                input or target; on the others, if one refuses the step; or the copies of
                a tied parameter differ (checked in the first step after building or loading)
            ValueError, TypeError: as for :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>`
        """
        return self.core.train(input, target, loss_fn, schedule, reduction, self.training)

    def eval_step(self, input: Optional[TensorOrTensors],
                  target: Optional[TensorOrTensors] = None,
                  loss_fn: Optional[LossFunction] = None, *, reduction: str = 'mean',
                  everywhere: bool = False,
                  output_fn: Optional[Callable[[TensorOrTensors], Any]] = None) -> Any:
        """Evaluates the pipeline on a mini-batch, as ``model.eval()`` under
        :func:`torch.no_grad` (the layers' modes restored after); every rank of the group
        calls it, ``input`` and ``target`` as for :meth:`train_step`, the rest alike.

        Args:
            input, target, loss_fn, reduction: as for :meth:`train_step`
            everywhere (bool): without ``loss_fn``, the output on every rank (default: ``False``)
            output_fn (callable, optional): without ``loss_fn``, applied to the output on the
                last partition's rank, its result returned (and sent) instead

        Returns:
            with ``loss_fn``, the loss, as :meth:`train_step` returns it; else the output
            (or ``output_fn`` of it) on the last partition's rank (or all with
            ``everywhere``), ``None`` elsewhere

        Raises:
            ValueError: ``target`` without ``loss_fn``, or ``output_fn`` with ``loss_fn``
            TypeError: ``output_fn`` not callable
            PeerFailed, RuntimeError, ValueError, TypeError: as for :meth:`train_step`

        Example::

            loss = pipe.eval_step(input, target, F.cross_entropy)   # on every rank
            logits = pipe.eval_step(input)           # on the last partition's rank
        """
        with evaluating(self):
            return self.core.evaluate(input, target, loss_fn, reduction, output_fn, everywhere)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> Tensor:
        """Clips the gradients of the whole pipeline by their norm, every rank calling it, as
        :func:`torch.nn.utils.clip_grad_norm_` the unwrapped module's (norm, result, arguments
        and errors). Under DDP, call it after :func:`torchgpipe.distributed.train_step`."""
        me = dist.get_rank()
        elsewhere = {tie.local for tie in self.core.tied_gradients.ties if tie.ranks[0] != me}
        grads = [(name, p.grad) for name, p in self.named_parameters() if p.grad is not None]
        total = total_norm([(self._slots[name], g) for name, g in grads if name not in elsewhere],
                           len(set(self._slots.values())), float(norm_type), self.device,
                           self.group, foreach)
        if error_if_nonfinite:
            check_finite(total, norm_type)
        clip_grads([g for _, g in grads], max_norm, total)
        return total

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """Loads this process's layers from the unwrapped module's state dict, or its own;
        keys of other processes' layers are ignored, also with ``strict=True``."""
        others = set(self._others)
        mine: Dict[str, Any] = {k: v for k, v in state_dict.items()
                                if k.split('.', 1)[0] not in others}
        self.core.tied_gradients.check = True
        return cast(_IncompatibleKeys, super().load_state_dict(mine, strict, assign))


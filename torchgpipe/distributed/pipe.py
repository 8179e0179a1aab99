"""DistributedGPipe: a pipeline whose partitions are the processes of a group, one or more each."""
import warnings
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Union, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.module import _IncompatibleKeys

from torchgpipe.distributed.core import RankCore
from torchgpipe.distributed.norm import check_finite, clip_grads, slots, total_norm
from torchgpipe.distributed.ranks import agree_on_layout, ranks_of_partitions
from torchgpipe.distributed.tied import TiedGradients, ties_across_ranks
from torchgpipe.engine.core import CoreModule
from torchgpipe.engine.evaluation import evaluating
from torchgpipe.engine.schedule import ScheduleLike
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.placement import check_materialized, place
from torchgpipe.foundation.tied import find_ties, tie_partitions
from torchgpipe.foundation.validation import (check_available, check_balance, check_chunks,
                                              check_planned_threads, check_timeout,
                                              describe, parse_device, verify_module)
from torchgpipe.runtime.batchnorm import DeferredBatchNorm
from torchgpipe.skip.layout import inspect_skip_layout
from torchgpipe.skip.skippable import verify_skippables

__all__ = ['DistributedGPipe']


class DistributedGPipe(CoreModule):
    """Trains an :class:`nn.Sequential <torch.nn.Sequential>` as a pipeline
    whose partitions are the processes of a :mod:`torch.distributed` group.

    Every process runs the same script (under ``torchrun``, say) and builds
    the same ``module``; the process of rank ``r`` in ``group`` keeps the
    ``r``-th partition, ``balance[r]`` layers, on ``device``, and drops the
    others. With ``v`` times more partitions than ranks (virtual stages), a
    rank keeps ``v`` of them, laid out as ``placement`` says: in a loop
    (partition ``j`` on rank ``j % size``, for interleaved 1F1B) or in a V
    (rank ``r`` keeps ``r`` and ``2 size - 1 - r``, for ZBV). :meth:`train_step`
    then trains the whole pipeline: activations and gradients travel between
    the processes by torch.distributed's point-to-point operations
    (``isend``/``irecv``), skip connections included, in the order of a
    schedule, with checkpointing as :class:`~torchgpipe.GPipe` does it. After
    it, each process's parameters hold the gradients the unwrapped module
    would give them.

    The module's layers keep their names: the state dict of this process
    has the keys of its layers in the unwrapped module (``'3.weight'``), and
    :meth:`load_state_dict` takes the unwrapped module's whole state dict.

    A parameter shared by layers of several ranks (tied weights: an
    embedding and its head, say) has a copy on each of them; each step sums
    its gradient over them, so that the copies stay equal
    (:mod:`torchgpipe.distributed.tied`).

    Args:
        module (torch.nn.Sequential): the whole module, the same on every rank
        balance (ints): the number of layers of each partition: one per rank
            of ``group``, or ``v`` per rank

    Keyword Args:
        chunks (int): number of micro-batches (default: ``1``)
        checkpoint (str): ``'always'``, ``'except_last'`` (default) or
            ``'never'``, as for :class:`~torchgpipe.GPipe`
        group (torch.distributed.ProcessGroup, optional): the processes of the pipeline, the
            ``j``-th running partition ``j`` (default: the default group)
        device (torch.device, str or int, optional): this process's device
            (default: the CPU)
        deferred_batch_norm (bool): as for :class:`~torchgpipe.GPipe`
            (default: ``False``)
        placement (str): with several partitions per rank, ``'loop'``
            (default) or ``'v'`` (two per rank)
        timeout (float, optional): the step timeout, in seconds: a rank that
            waits longer within a step for another (stopped, stuck in a
            layer) raises :class:`~torchgpipe.distributed.StepTimeout`,
            naming it and the message it waits for (default: ``None``, the
            process group's timeout, for each message)
        planned_threads (int, optional): as for :class:`~torchgpipe.GPipe`:
            this rank's first step warns if its intra-op threads differ from
            those :func:`torchgpipe.plan` measured with (default: ``None``)

    Raises:
        RuntimeError: torch.distributed is not initialized
        TypeError, ValueError: as for :class:`~torchgpipe.GPipe`; also, a
            balance whose length is not a multiple of the group's size, or
            an unknown ``placement``
        ValueError: on every rank, if the ranks differ in ``balance``,
            ``placement``, ``checkpoint``, ``deferred_batch_norm``, or the
            number of layers, their types or their parameters' shapes, before
            any layer moves; on the others, if one rank raises an error above

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

    def __init__(self, module: nn.Sequential, balance: Iterable[int], *, chunks: int = 1,
                 checkpoint: str = 'except_last', group: Optional[dist.ProcessGroup] = None,
                 device: Optional[Union[torch.device, str, int]] = None,
                 deferred_batch_norm: bool = False, placement: str = 'loop',
                 timeout: Optional[float] = None,
                 planned_threads: Optional[int] = None) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError('DistributedGPipe needs torch.distributed: call '
                               "torch.distributed.init_process_group('gloo') (or 'nccl') "
                               'first, on every rank')
        if dist.get_rank(group) < 0:
            raise ValueError(describe('this process must be in group', f'rank {dist.get_rank()}',
                                      'build the DistributedGPipe only on the ranks of its '
                                      'group, giving each rank its own pipeline group'))
        size = dist.get_world_size(group)
        self.ranks = [dist.get_global_rank(group, r) if group is not None else r
                      for r in range(size)]
        self.placement = placement
        problem: Optional[Exception] = None
        this_device: Optional[torch.device] = None  # once checked
        deferred = False
        try:
            deferred = bool(deferred_batch_norm)
            fix = "give this process's device, such as device='cpu'"
            given = torch.device('cpu') if device is None else parse_device('device', device, fix)
            check_available('device', given, fix)
            this_device = given
            verify_module(module)
            balance = check_balance(module, balance)
            #: The rank (in the group) of each partition.
            self.rank_of = ranks_of_partitions(balance, size, placement)
            chunks = check_chunks(chunks)
            timeout = check_timeout(timeout)
            planned_threads = check_planned_threads(planned_threads)
            checkpoint = str(checkpoint)
            if checkpoint not in ('always', 'except_last', 'never'):
                raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
            check_materialized(module, balance, [given if r == dist.get_rank(group) else None
                                                 for r in self.rank_of])
            verify_skippables(module)
        except Exception as exc:  # anything one rank raises alone, the others hear
            problem = exc
        # Before any layer moves: if one rank cannot build the pipeline, or the
        # ranks would cut the layers differently, every rank refuses.
        agree_on_layout(module, {'balance': balance, 'placement': placement,
                                 'checkpoint': checkpoint,
                                 'deferred_batch_norm': deferred},
                        problem, group, self.ranks, this_device)
        assert this_device is not None  # else agree_on_layout raised
        self.device = this_device
        if deferred:
            module = cast(nn.Sequential,
                          DeferredBatchNorm.convert_deferred_batch_norm(module, chunks))

        children = iter(module.named_children())
        partitions = [nn.Sequential(OrderedDict(next(children) for _ in range(n)))
                      for n in balance]
        # Refuses buffers, and layers with tensors, in two partitions.
        find_ties(partitions)
        #: The place of each parameter's gradient norm in the unwrapped module's
        #: order, by every name (see clip_grad_norm_).
        self._slots = slots(module)
        self.balance = balance
        self.group = group
        self.rank = dist.get_rank(group)
        here = self._keep(partitions)
        # The parameters shared by several partitions, a copy on each rank
        # using them; the later partitions here using one keep their gradients apart.
        tie_partitions(list(here.values()), [self.device] * len(here))
        tied = TiedGradients(ties_across_ranks(
            partitions, [self.ranks[r] for r in self.rank_of], dist.get_rank()), dist.get_rank(),
            list(here.values()))
        #: The names of the layers of the other partitions.
        self._others = [name for j, p in enumerate(partitions) if j not in here
                        for name, _ in p.named_children()]
        #: The pipeline the module runs: this rank's partitions, and the wire.
        self.core = RankCore(here, self.device, self.rank_of, self.ranks, group, tied,
                             inspect_skip_layout(partitions), chunks, checkpoint, timeout)
        self.core.planned_threads = planned_threads

    @property
    def timeout(self) -> Optional[float]:
        """The step timeout, in seconds, or ``None`` (see the constructor); set it between
        steps to change it, the same on every rank."""
        return self.core.timeout

    @timeout.setter
    def timeout(self, timeout: Optional[float]) -> None:
        self.core.timeout = check_timeout(timeout)

    def _keep(self, partitions: List[nn.Sequential]) -> Dict[int, nn.Sequential]:
        """Registers the layers of this rank's partitions, on its device; returns them by index.

        The layers of the other partitions are dropped with the module.
        Placed in place: a tensor of the user's model stays the one the user
        holds (see :mod:`torchgpipe.foundation.placement`).
        """
        here = {j: p for j, p in enumerate(partitions) if self.rank_of[j] == self.rank}
        for partition in here.values():
            for name, layer in partition.named_children():
                place(layer, self.device)
                self.add_module(name, layer)
        if next(self.parameters(), None) is None:
            # Said here, before the optimizer that a script builds next
            # refuses the empty list of parameters in words about itself.
            warnings.warn(f'rank {self.rank} of the pipeline holds no parameters (its layers: '
                          f'{", ".join(self._modules) or "none"}): torch.optim refuses an '
                          'empty parameter list, so build an optimizer only where '
                          'list(pipe.parameters()) is not empty, and step it there',
                          UserWarning, stacklevel=3)
        return here

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Refused: a pipeline across processes has no output in any one of them to return
        (see :meth:`eval_step`).

        Raises:
            TypeError: always
        """
        raise TypeError('a DistributedGPipe is not called: train it with train_step(input, '
                        'target, loss_fn), and evaluate it with eval_step(input), on every '
                        'rank')

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise TypeError('a DistributedGPipe belongs to its processes and cannot be copied or '
                        'pickled; save its state_dict() instead, which has the keys of the '
                        'unwrapped module')

    def partition(self) -> nn.Sequential:
        """The layers of this process's partitions, in order, as one sequential module."""
        return nn.Sequential(OrderedDict(self.named_children()))

    def train_step(self, input: Optional[TensorOrTensors], target: Optional[TensorOrTensors],
                   loss_fn: LossFunction, *, schedule: ScheduleLike = '1f1b',
                   reduction: str = 'mean') -> Tensor:
        """Runs a training step of the pipeline; every rank of the group calls it.

        The first partition's rank takes the input, the last one's the target
        (and computes the loss): each needs its part of the mini-batch, and
        may pass ``None`` for the other; a rank holding neither may pass
        ``None`` for both, and learns the sizes of the micro-batches from the
        others, so that a data loader runs only where its data is used.
        Passing the whole mini-batch everywhere works too. The arguments are
        those of :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>`.

        Returns:
            torch.Tensor: the loss of the mini-batch, on every rank (on its
            device), without autograd history

        Raises:
            PeerFailed: another rank failed in this step, or its
                connection broke (it died, in this step or since the last),
                or it stopped answering (within the process group's
                timeout). Every rank raises, the one that failed its own
                error: restart the job, from a checkpoint
            RuntimeError: an earlier step failed: this pipeline's ranks no
                longer agree on their messages
            ValueError: on every rank, if the ranks were called for
                different steps, or the first partition's rank was given no
                input, or the last one's no target; on the others, if one
                rank refuses the step for a reason below (that rank raises its
                own error); the pipeline stays whole
            ValueError: the copies of a parameter tied across ranks differ
                (checked at the end of the first step and of the first after
                a load); nothing else is wrong, and the pipeline trains on
                once they are equal
            ValueError, TypeError: as for :meth:`GPipe.train_step
                <torchgpipe.GPipe.train_step>`
        """
        return self.core.train(input, target, loss_fn, schedule, reduction, self.training)

    def eval_step(self, input: Optional[TensorOrTensors],
                  target: Optional[TensorOrTensors] = None,
                  loss_fn: Optional[LossFunction] = None, *, reduction: str = 'mean',
                  everywhere: bool = False,
                  output_fn: Optional[Callable[[TensorOrTensors], Any]] = None) -> Any:
        """Evaluates the pipeline on a mini-batch; every rank of the group calls it.

        What ``model.eval()`` and :func:`torch.no_grad` give the unwrapped
        model: the micro-batches go through the partitions, forward only,
        without autograd, the layers in evaluation mode for the step (and
        back in their own mode after), so that dropout is off and BatchNorm
        (deferred or not) uses and keeps its running statistics. As for
        :meth:`train_step`, the first partition's rank needs the input and,
        with ``loss_fn``, the last one's the target; the others may pass
        ``None`` for them (``loss_fn``, ``everywhere`` and ``output_fn`` the
        same on every rank).

        Args:
            input (torch.Tensor or tuple): the mini-batch (or ``None``, above)
            target (torch.Tensor or tuple, optional): with ``loss_fn``, the
                target, split as the input
            loss_fn (callable, optional): ``loss_fn(output, target)`` of a
                micro-batch, weighted as :meth:`train_step` weights it
            reduction (str): ``'mean'`` (default) or ``'sum'``, as for
                :meth:`train_step`
            everywhere (bool): without ``loss_fn``, the output on every rank,
                not only on the last partition's (default: ``False``)
            output_fn (callable, optional): without ``loss_fn``, applied to
                the output on the last partition's rank: its result is
                returned, and sent with ``everywhere`` (the argmax of the
                logits rather than the logits, say)

        Returns:
            with ``loss_fn``, the loss of the mini-batch on every rank, as
            :meth:`train_step` returns it; without, the output of the last
            partition (micro-batches joined, as :class:`~torchgpipe.GPipe`
            returns it), or ``output_fn`` of it, on its rank, or on every
            rank with ``everywhere``, and ``None`` on the others

        Raises:
            ValueError: ``target`` without ``loss_fn``, or ``output_fn`` with
                ``loss_fn``
            TypeError: ``output_fn`` not callable
            PeerFailed, RuntimeError: as for :meth:`train_step`
            ValueError: on every rank, as for :meth:`train_step`
            ValueError, TypeError: the input or the target do not split, as
                for :meth:`train_step`

        Example::

            pipe.eval()                              # or not: eval_step evaluates
            loss = pipe.eval_step(input, target, F.cross_entropy)   # on every rank
            logits = pipe.eval_step(input)           # on the last partition's rank
        """
        with evaluating(self):
            return self.core.evaluate(input, target, loss_fn, reduction, output_fn, everywhere)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> Tensor:
        """Clips the gradients of the whole pipeline by their norm; every rank of the group
        calls it.

        :meth:`GPipe.clip_grad_norm_ <torchgpipe.GPipe.clip_grad_norm_>`
        across processes: the norm is that of every rank's gradients together,
        computed as torch computes it for the unwrapped module (a weight tied
        across ranks counted once), the same value on every rank
        (:mod:`torchgpipe.distributed.norm`); each rank then scales its own
        gradients by it. Under DDP (pipelines replicated), call it after
        :func:`torchgpipe.distributed.train_step`: the norm is that of the
        averaged gradients. The arguments, result and errors are
        :func:`torch.nn.utils.clip_grad_norm_`'s.
        """
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
        """Loads this process's layers from the unwrapped module's state dict, or from its own.

        Keys of layers in other processes are ignored, also with ``strict=True``.
        """
        others = set(self._others)
        mine: Dict[str, Any] = {k: v for k, v in state_dict.items()
                                if k.split('.', 1)[0] not in others}
        # The next step compares the copies of tied parameters again.
        self.core.tied_gradients.check = True
        return cast(_IncompatibleKeys, super().load_state_dict(mine, strict, assign))


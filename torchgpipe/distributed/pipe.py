"""DistributedGPipe: a pipeline whose partitions are the processes of a group, one or more each."""
import warnings
from hashlib import sha1
from collections import OrderedDict
from typing import (Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple,
                    Union, cast)

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.modules.module import _IncompatibleKeys

from torchgpipe import microbatch
from torchgpipe.validation import (check_available, check_balance, check_chunks, check_step,
                                    check_timeout, describe, parse_device, verify_module)
from torchgpipe.batchnorm import DeferredBatchNorm, deferred_step
from torchgpipe.distributed.blocks import Blocks
from torchgpipe.distributed.norm import check_finite, clip_grads, slots, total_norm
from torchgpipe.distributed.ranks import ranks_of_partitions
from torchgpipe.distributed.tied import TiedGradients, ties_across_ranks
from torchgpipe.distributed.wire import Channels, Mismatch, Wire
from torchgpipe.microbatch import TensorOrTensors
from torchgpipe.placement import place
from torchgpipe.checkpoint import checkpoint_stop
from torchgpipe.train.generators import check_schedule, resolve
from torchgpipe.train.schedule import ScheduleLike
from torchgpipe.skip.layout import inspect_skip_layout
from torchgpipe.skip.skippable import verify_skippables
from torchgpipe.train.evaluation import (check_evaluation, evaluating, forward_only, join,
                                         split_evaluation)
from torchgpipe.train.inputs import split_step
from torchgpipe.train.schedule import Schedule
from torchgpipe.train.step import LossFunction, Step
from torchgpipe.tied import find_ties
from torchgpipe.state import RunState
from torchgpipe.traits import PartitionTraits

__all__ = ['DistributedGPipe']


class DistributedGPipe(nn.Module):
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

    Raises:
        RuntimeError: torch.distributed is not initialized
        TypeError, ValueError: as for :class:`~torchgpipe.GPipe`; also, a
            balance whose length is not a multiple of the group's size, or
            an unknown ``placement``

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

    def __init__(self, module: nn.Sequential, balance: Iterable[int], *, chunks: int = 1,
                 checkpoint: str = 'except_last', group: Optional[dist.ProcessGroup] = None,
                 device: Optional[Union[torch.device, str, int]] = None,
                 deferred_batch_norm: bool = False, placement: str = 'loop',
                 timeout: Optional[float] = None) -> None:
        super().__init__()
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError('DistributedGPipe needs torch.distributed: call '
                               "torch.distributed.init_process_group('gloo') (or 'nccl') "
                               'first, on every rank')
        verify_module(module)
        balance = check_balance(module, balance)
        if dist.get_rank(group) < 0:
            raise ValueError(describe('this process must be in group', f'rank {dist.get_rank()}',
                                      'build the DistributedGPipe only on the ranks of its '
                                      'group, giving each rank its own pipeline group'))
        size = dist.get_world_size(group)
        self.placement = placement
        #: The rank (in the group) of each partition.
        self.rank_of = ranks_of_partitions(balance, size, placement)
        self.chunks = check_chunks(chunks)
        self.timeout = check_timeout(timeout)
        self.checkpoint = str(checkpoint)
        if self.checkpoint not in ('always', 'except_last', 'never'):
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
        fix = "give this process's device, such as device='cpu'"
        self.device = torch.device('cpu') if device is None else parse_device('device', device,
                                                                               fix)
        check_available('device', self.device, fix)
        verify_skippables(module)
        if deferred_batch_norm:
            module = cast(nn.Sequential,
                          DeferredBatchNorm.convert_deferred_batch_norm(module, self.chunks))

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
        self.ranks = [dist.get_global_rank(group, r) if group is not None else r
                      for r in range(size)]
        #: The parameters shared with layers on other ranks, a copy on each.
        self._tied = TiedGradients(ties_across_ranks(
            partitions, [self.ranks[r] for r in self.rank_of], dist.get_rank()), dist.get_rank())
        layout = inspect_skip_layout(partitions)
        self._routes = {key: route for key, route in layout.by_ns_name.items()
                        if route[0] != route[1]}
        self._skip_layout = layout
        #: This process's partitions, by index.
        self._here = self._keep(partitions)
        #: The names of the layers of the other partitions.
        self._others = [name for j, p in enumerate(partitions) if j not in self._here
                        for name, _ in p.named_children()]
        self._deferred_batch_norms = [m for m in self.modules()
                                      if isinstance(m, DeferredBatchNorm)]
        self._run_state = RunState(len(self._here))
        #: The capacity of the channel to each rank (see Channels).
        self._capacities: Dict[int, int] = {}
        #: The CPU memory of the messages, reused from step to step.
        self._blocks = Blocks()
        #: Why the pipeline cannot run any more, after a failed step.
        self._broken: Optional[str] = None
        #: The channels of a failed step, whose sends may still run.
        self._abandoned: Optional[Channels] = None

    def _keep(self, partitions: List[nn.Sequential]) -> Dict[int, nn.Sequential]:
        """Registers the layers of this rank's partitions, on its device; returns them by index.

        The layers of the other partitions are dropped with the module.
        Placed in place: a tensor of the user's model stays the one the user
        holds (see :mod:`torchgpipe.placement`).
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

    def train_step(self, input: TensorOrTensors, target: TensorOrTensors,
                   loss_fn: LossFunction, *, schedule: ScheduleLike = '1f1b',
                   reduction: str = 'mean') -> Tensor:
        """Runs a training step of the pipeline; every rank of the group calls it.

        Every rank passes the same mini-batch: the first partition's rank
        takes the input, the last one's the target (and computes the loss);
        the others only look at their size, which sets the micro-batches.
        The arguments are those of :meth:`GPipe.train_step
        <torchgpipe.GPipe.train_step>`.

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
            ValueError: the copies of a parameter tied across ranks differ
                (checked at the end of the first step and of the first after
                a load); nothing else is wrong, and the pipeline trains on
                once they are equal
            ValueError, TypeError: as for :meth:`GPipe.train_step
                <torchgpipe.GPipe.train_step>`
        """
        check_schedule(schedule)
        check_step(reduction, loss_fn)
        self._check_whole()
        return self._train_step(input, target, loss_fn, schedule, reduction)

    def eval_step(self, input: TensorOrTensors, target: Optional[TensorOrTensors] = None,
                  loss_fn: Optional[LossFunction] = None, *, reduction: str = 'mean',
                  everywhere: bool = False,
                  output_fn: Optional[Callable[[TensorOrTensors], Any]] = None) -> Any:
        """Evaluates the pipeline on a mini-batch; every rank of the group calls it.

        What ``model.eval()`` and :func:`torch.no_grad` give the unwrapped
        model: the micro-batches go through the partitions, forward only,
        without autograd, the layers in evaluation mode for the step (and
        back in their own mode after), so that dropout is off and BatchNorm
        (deferred or not) uses and keeps its running statistics. Every rank
        passes the same mini-batch, as to :meth:`train_step`.

        Args:
            input (torch.Tensor or tuple): the mini-batch
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
            ValueError: ``target`` without ``loss_fn``, or the other way, or
                ``output_fn`` with ``loss_fn``
            TypeError: ``output_fn`` not callable
            PeerFailed, RuntimeError: as for :meth:`train_step`
            ValueError, TypeError: the input or the target do not split, as
                for :meth:`train_step`

        Example::

            pipe.eval()                              # or not: eval_step evaluates
            loss = pipe.eval_step(input, target, F.cross_entropy)   # on every rank
            logits = pipe.eval_step(input)           # on the last partition's rank
        """
        check_evaluation(target, loss_fn, reduction, output_fn)
        self._check_whole()
        with evaluating(self):
            batches, targets, weights = split_evaluation(input, target, self.chunks, reduction,
                                                         self.device)
            here: List[Any] = [None]

            def outcome(step: Step) -> Any:
                loss = step.run()
                if loss_fn is not None:
                    return loss
                output = join(step.outputs())
                if output is not None and output_fn is not None:
                    output = output_fn(output)
                here[0] = output
                return output if everywhere else None
            result, _ = self._run(batches, targets, loss_fn, weights,
                                  forward_only(len(batches), len(self.balance)), 0, outcome,
                                  train=False, signature={'loss': loss_fn is not None,
                                                          'everywhere': everywhere})
        return here[0] if loss_fn is None and not everywhere else result

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
        elsewhere = {tie.local for tie in self._tied.ties if tie.ranks[0] != me}
        grads = [(name, p.grad) for name, p in self.named_parameters() if p.grad is not None]
        total = total_norm([(self._slots[name], g) for name, g in grads if name not in elsewhere],
                           len(set(self._slots.values())), float(norm_type), self.device,
                           self.group, foreach)
        if error_if_nonfinite:
            check_finite(total, norm_type)
        clip_grads([g for _, g in grads], max_norm, total)
        return total

    def _check_whole(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f'an earlier step failed ({self._broken}): the ranks of '
                               'this pipeline no longer agree on the messages between them; '
                               'restart the job, from a checkpoint')

    def _train_step(self, input: TensorOrTensors, target: TensorOrTensors,
                    loss_fn: LossFunction, schedule: ScheduleLike, reduction: str,
                    done: Optional[Callable[[int], None]] = None) -> Tensor:
        batches, targets, weights = split_step(input, target, self.chunks, reduction,
                                               self.device)
        m = len(batches)
        plan = resolve(schedule, m, len(self.balance), [f'rank {r}' for r in self.rank_of],
                       "lay the partitions over the ranks as it does: placement='v' for "
                       "'zbv', 'loop' for the others")

        def outcome(step: Step) -> Optional[Tensor]:
            with deferred_step(self._deferred_batch_norms, m):
                return step.run()
        self._tied.start()
        loss, received = self._run(batches, targets, loss_fn, weights, plan,
                                   checkpoint_stop(self.checkpoint, self.chunks, m,
                                                   self.training), outcome, done)
        # Every rank is past the end of the step: copies of a tied parameter
        # refused here leave no rank waiting, and the pipeline whole.
        self._tied.sum(received)
        return cast(Tensor, loss)

    def _run(self, batches: List[microbatch.Batch],
             targets: Sequence[Optional[TensorOrTensors]], loss_fn: Optional[LossFunction],
             weights: List[float], plan: Schedule, stop: int, outcome: Callable[[Step], Any],
             done: Optional[Callable[[int], None]] = None, train: bool = True,
             signature: Optional[Dict[str, Any]] = None) -> Tuple[Any, Dict[int, Any]]:
        """Runs a step of ``plan`` (a training step's, or an evaluation's) over the ranks.

        Args:
            stop: the checkpoint stop (see :class:`~torchgpipe.train.step.Step`)
            outcome: runs the step; returns what the last partition's rank sends everyone
            train: a training step, whose end carries the gradients of tied
                parameters; else an evaluation
            signature: more of the step, which every rank must run alike

        Returns:
            as :meth:`Wire.finish <torchgpipe.distributed.wire.Wire.finish>`
        """
        n = len(self.balance)
        if 0 in self._here:
            microbatch.move(batches, self.device)
        partitions: List[Optional[nn.Sequential]] = [self._here.get(j) for j in range(n)]
        traits = [PartitionTraits() for _ in range(n)]
        for k, j in enumerate(self._here):
            traits[j] = self._run_state.traits[k]
        streams = dict(zip(self._here, self._run_state.ensure_copy_streams(
            [self.device] * len(self._here), self.chunks)))
        recorder = self._run_state.recorder
        wire = Wire(Channels(self.device, self.group, self._capacities, self._blocks,
                             self.timeout),
                    [self.ranks[r] for r in self.rank_of], dist.get_rank(), self._routes,
                    recorder)
        step = Step(partitions, [self.device] * n, batches, targets, loss_fn, weights,
                    plan, self._skip_layout, stop, traits, recorder, mailbox=wire, done=done,
                    train=train, copy_streams=[streams.get(j) for j in range(n)])
        try:
            # Before any message of the step: ranks that disagree on it all raise here.
            wire.agree({'step': 'train_step' if train else 'eval_step',
                        'micro-batches': [batch[0].size(0) for batch in batches],
                        'schedule': f'{plan.name} ({sha1(str(plan).encode()).hexdigest()[:8]})',
                        **(signature or {})})
            return wire.finish(outcome(step), self._tied.shares(wire.others) if train else None)
        except Mismatch:
            self._tied.abandon()
            raise
        except BaseException as exc:
            self._tied.abandon()
            self._broken = f'{type(exc).__name__} on rank {dist.get_rank()}'
            # Ranks waiting for this one's messages raise PeerFailed, and tell
            # the ranks waiting for theirs in turn.
            wire.fail(exc)
            self._abandoned = wire.channels
            raise

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """Loads this process's layers from the unwrapped module's state dict, or from its own.

        Keys of layers in other processes are ignored, also with ``strict=True``.
        """
        others = set(self._others)
        mine: Dict[str, Any] = {k: v for k, v in state_dict.items()
                                if k.split('.', 1)[0] not in others}
        # The next step compares the copies of tied parameters again.
        self._tied.check = True
        return cast(_IncompatibleKeys, super().load_state_dict(mine, strict, assign))


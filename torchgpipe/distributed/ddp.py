"""train_step for data-parallel replicas of a pipeline, wrapped in DistributedDataParallel,
whose hooks ``train_step`` never arms: it does DDP's work around the pipeline's own step,
averaging the gradients partition by partition, as DDP's reducer would, had it seen the
step's backward passes. Each partition's all-reduce starts once its last backward action
is done, from the last partition, in that order on every rank::

    partition 2   B B B B ─► all-reduce(2)
    partition 1     B B B B ─► all-reduce(1)
    partition 0       B B B B ─► all-reduce(0) ─► wait for the three, write back
"""
import threading
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from torchgpipe.engine.generators import check_schedule
from torchgpipe.engine.schedule import ScheduleLike
from torchgpipe.engine.step import LossFunction, Reducer
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.validation import check_step, describe
from torchgpipe.modules.distributed import DistributedGPipe
from torchgpipe.modules.gpipe import GPipe

__all__ = ['train_step']

Bucket = Tuple[List[nn.Parameter], Tensor]


class AllReduce(Reducer):
    """Averages the gradients of the ``parameters`` of each partition here over ``group``
    as they become final, ``after`` ones (tied) in :meth:`wait`. A flag per parameter
    says which ranks gave a gradient: as DDP with ``find_unused_parameters=True``, the
    average counts zeros for the others, and ``None`` stays if no rank gave one."""

    def __init__(self, parameters: Dict[int, Sequence[nn.Parameter]],
                 group: Optional[dist.ProcessGroup],
                 after: Sequence[nn.Parameter] = ()) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        seen: Set[int] = set()
        self.parameters: Dict[int, List[nn.Parameter]] = {}
        # Index -1 (tied) comes first here, taking them from their partitions, and
        # launches last, in wait(): no partition reports it done.
        every = {-1: after, **parameters}
        for j in sorted(every):
            mine = [p for p in every[j] if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in mine)
            self.parameters[j] = mine
        #: The partitions still to launch, the next last.
        self.pending = sorted(self.parameters)
        self.done_partitions: Set[int] = set()
        self.lock = threading.Lock()
        self.launched: List[Tuple[dist.Work, Bucket]] = []

    def done(self, j: int) -> None:
        """Partition ``j``'s gradients are final: launches what can be, in order."""
        with self.lock:
            self.done_partitions.add(j)
            while self.pending and self.pending[-1] in self.done_partitions:
                self.launch(self.pending.pop())

    def launch(self, j: int) -> None:
        # A collective takes tensors of one device and type.
        groups: Dict[Tuple[torch.device, torch.dtype], List[nn.Parameter]] = {}
        for p in self.parameters[j]:
            groups.setdefault((p.device, p.dtype), []).append(p)
        for (device, dtype), params in groups.items():
            pieces = [torch.zeros(p.numel(), device=device, dtype=dtype) if p.grad is None
                      else p.grad.detach().reshape(-1) for p in params]
            flags = torch.tensor([p.grad is not None for p in params], device=device,
                                 dtype=dtype)
            # Divided before the sum, as DDP's reducer does.
            flat = torch.cat(pieces + [flags]).div_(self.size)
            work = dist.all_reduce(flat, group=self.group, async_op=True)
            assert work is not None
            self.launched.append((work, (params, flat)))

    def wait(self) -> None:
        """Launches what is left, waits for it all and writes the averages back."""
        with self.lock:
            while self.pending:
                self.launch(self.pending.pop())
        for work, (params, flat) in self.launched:
            work.wait()
            used = (flat[-len(params):] > 0).tolist()
            for p, u, average in zip(params, used, pieces(flat, params)):
                if p.grad is not None:
                    p.grad.copy_(average)
                elif u:
                    p.grad = average.clone()
        self.launched.clear()


def pieces(flat: Tensor, like: Sequence[Tensor]) -> List[Tensor]:
    """The views of ``flat`` shaped as each of ``like``, one after the other."""
    views = []
    offset = 0
    for t in like:
        views.append(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


def train_step(model: DistributedDataParallel, input: TensorOrTensors,
               target: TensorOrTensors, loss_fn: LossFunction, *, schedule: ScheduleLike = '1f1b',
               reduction: str = 'mean') -> Tensor:
    """Runs :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>` on one data-parallel
    replica, averaging the gradients over the replicas as DDP does.

    Every process of ``model``'s group calls it with its share of the mini-batch; ``.grad``
    then adds DDP's gradients over the unwrapped model. Buffers are broadcast and
    :meth:`~torch.nn.parallel.DistributedDataParallel.no_sync` is honoured as DDP does; a
    communication hook is not used.

    Args:
        model (torch.nn.parallel.DistributedDataParallel): a wrapped :class:`~torchgpipe.GPipe`
            or :class:`~torchgpipe.distributed.DistributedGPipe` (whose replicas are the
            ranks holding the same partition)
        input, target, loss_fn, schedule, reduction: as for
            :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>`

    Returns:
        torch.Tensor: this replica's loss, on the last device, without autograd history

    Raises:
        TypeError: ``model`` is not a GPipe (or a DistributedGPipe) wrapped in
            DistributedDataParallel
        ValueError, TypeError, RuntimeError: as for :meth:`GPipe.train_step
            <torchgpipe.GPipe.train_step>`

    Example::

        dist.init_process_group('gloo')          # under torchrun
        gpipe = GPipe(model, balance=[2, 2], devices=['cpu:0', 'cpu:1'], chunks=8)
        ddp = DistributedDataParallel(gpipe)
        for input, target in loader:             # this replica's shard
            optimizer.zero_grad()
            loss = torchgpipe.distributed.train_step(ddp, input, target, F.cross_entropy)
            optimizer.step()
    """
    module = model.module if isinstance(model, DistributedDataParallel) else None
    if not isinstance(module, (GPipe, DistributedGPipe)):
        wrapped = f' of {type(module).__name__}' if module is not None else ''
        raise TypeError(describe('model must be a GPipe or a DistributedGPipe wrapped in '
                                 'DistributedDataParallel',
                                 f'model: {type(model).__name__}{wrapped}',
                                 'pass DistributedDataParallel(GPipe(...)); without data '
                                 'parallelism, call gpipe.train_step(...)'))
    check_schedule(schedule)
    check_step(loss_fn, reduction)
    group = model.process_group
    ignored = model.parameters_to_ignore
    # As DDP's forward: no broadcast after a step inside no_sync().
    if model.require_forward_param_sync and getattr(model, 'forward_sync_buffers',
                                                    model.broadcast_buffers):
        broadcast([b for name, b in module.named_buffers() if name not in ignored], group)
    model.require_forward_param_sync = model.require_backward_grad_sync
    core = module.core
    if not model.require_backward_grad_sync:  # inside no_sync()
        return core.train(input, target, loss_fn, schedule, reduction, module.training)
    names = {id(p): name for name, p in module.named_parameters()}
    # Tied parameters' gradients are final as the step ends: averaged after it.
    reducer = AllReduce({j: [p for p in partition.parameters() if names[id(p)] not in ignored]
                         for j, partition in core.partitions.items()}, group,
                        [p for p in core.tied() if names[id(p)] not in ignored])
    loss = core.train(input, target, loss_fn, schedule, reduction, module.training, reducer)
    reducer.wait()
    return loss


def broadcast(tensors: Sequence[Tensor], group: dist.ProcessGroup) -> None:
    """Copies the group's first rank's values of ``tensors`` into every rank's."""
    if not tensors:
        return
    source = dist.get_global_rank(group, 0)
    kinds: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = {}
    for t in tensors:
        kinds.setdefault((t.device, t.dtype), []).append(t)
    with torch.no_grad():
        for same in kinds.values():
            flat = torch.cat([t.reshape(-1) for t in same])
            dist.broadcast(flat, source, group=group)
            for t, value in zip(same, pieces(flat, same)):
                t.copy_(value)

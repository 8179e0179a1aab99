"""train_step for data-parallel replicas of a pipeline, wrapped in DistributedDataParallel,
whose hooks ``train_step`` never arms: it does DDP's work around the pipeline's own step."""
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from torchgpipe.engine.generators import check_schedule
from torchgpipe.engine.schedule import ScheduleLike
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.validation import check_step, describe
from torchgpipe.modules.distributed import DistributedGPipe
from torchgpipe.modules.gpipe import GPipe
from torchgpipe.processes.reduce import AllReduce, pieces

__all__ = ['train_step']


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
    loss = core.train(input, target, loss_fn, schedule, reduction, module.training,
                      reducer.done)
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

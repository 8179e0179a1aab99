"""train_step for data-parallel replicas of a pipeline, wrapped in DistributedDataParallel.

DistributedDataParallel averages gradients from hooks that its ``forward``
arms for the one ``backward()`` to follow. ``train_step`` calls neither: it
runs a backward pass per micro-batch and partition. :func:`train_step` here
does what DDP's forward and backward would do around the pipeline's own
step: broadcast the buffers from the group's first rank before it, and
average the gradients over the group as the partitions finish
(:class:`~torchgpipe.distributed.reduce.AllReduce`).
"""
from typing import Dict, List, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.nn.parallel import DistributedDataParallel

from torchgpipe.distributed.pipe import DistributedGPipe
from torchgpipe.distributed.reduce import AllReduce, pieces
from torchgpipe.engine.generators import check_schedule
from torchgpipe.engine.schedule import ScheduleLike
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.validation import check_step, describe
from torchgpipe.gpipe import GPipe

__all__ = ['train_step']


def train_step(model: DistributedDataParallel, input: TensorOrTensors,
               target: TensorOrTensors, loss_fn: LossFunction, *, schedule: ScheduleLike = '1f1b',
               reduction: str = 'mean') -> Tensor:
    """Runs :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>` on one
    data-parallel replica, averaging the gradients over the replicas as DDP does.

    Every process of ``model``'s group calls it with its own share of the
    global mini-batch. Afterwards, every replica's parameters hold in
    ``.grad`` (added to what they held) the gradients that
    ``loss_fn(model(input), target).backward()`` gives under
    DistributedDataParallel over the unwrapped model: the average over the
    replicas of each one's gradients. As DDP does:

    - before the step, the buffers (BatchNorm's running statistics, say) are
      broadcast from the group's first rank, if ``model.broadcast_buffers``
      and the step before did not run inside ``no_sync()``;
    - inside :meth:`model.no_sync() <torch.nn.parallel.DistributedDataParallel.no_sync>`
      the gradients stay local, to be averaged with the next step's;
    - a parameter no replica gave a gradient keeps ``None``; one that some
      replica did gets the average, zeros standing for the others.

    Each partition's gradients are all-reduced as soon as its last backward
    pass is done, while the partitions before it still compute. A
    communication hook registered on ``model`` is not used.

    Args:
        model (torch.nn.parallel.DistributedDataParallel): a :class:`~torchgpipe.GPipe`,
            or a :class:`~torchgpipe.distributed.DistributedGPipe` (its
            replicas: the ranks holding the same partition), wrapped in
            :class:`~torch.nn.parallel.DistributedDataParallel`
        input, target, loss_fn, schedule, reduction: as for
            :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>`

    Returns:
        torch.Tensor: the loss of this replica's mini-batch, on the last
        device, without autograd history

    Raises:
        TypeError: ``model`` is not a GPipe (or a DistributedGPipe) wrapped in
            DistributedDataParallel; or as for :meth:`GPipe.train_step
            <torchgpipe.GPipe.train_step>`
        ValueError, RuntimeError: as for :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>`

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
    check_step(reduction, loss_fn)
    group = model.process_group
    ignored = model.parameters_to_ignore
    # DDP's forward broadcasts the buffers unless the step before it ran
    # inside no_sync(), and remembers for the next whether this one did.
    if model.require_forward_param_sync and getattr(model, 'forward_sync_buffers',
                                                    model.broadcast_buffers):
        broadcast([b for name, b in module.named_buffers() if name not in ignored], group)
    model.require_forward_param_sync = model.require_backward_grad_sync
    core = module.core
    if not model.require_backward_grad_sync:  # inside no_sync()
        return core.train(input, target, loss_fn, schedule, reduction, module.training)
    names = {id(p): name for name, p in module.named_parameters()}
    # Tied parameters get their gradients as the step ends (summed over the
    # ranks, or over the partitions' shares): averaged after it.
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

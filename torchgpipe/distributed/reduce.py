"""Averaging a training step's gradients over data-parallel replicas, partition by partition.

:meth:`GPipe.train_step <torchgpipe.GPipe.train_step>` runs its backward
passes itself, one per micro-batch and partition, so DistributedDataParallel's
reducer (which expects one ``backward()`` of one graph) never sees them.
:class:`AllReduce` does its work instead, as DDP would: each gradient is
divided by the size of the group and summed over it. A partition's
gradients are final once its last backward action is done, and the schedule
finishes the partitions from the last to the first, so each partition's
all-reduce runs while the partitions before it still compute::

    partition 2   B B B B ─► all-reduce(2)
    partition 1     B B B B ─► all-reduce(1)
    partition 0       B B B B ─► all-reduce(0) ─► wait for the three, write back

Every rank must launch its collectives in one order: they are launched in
the order of the partitions, from the last, whichever worker finishes first.
"""
import threading
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__: List[str] = []

Bucket = Tuple[List[nn.Parameter], Tensor]


class AllReduce:
    """Averages the gradients of the partitions here over ``group``, as they become final.

    Alongside the gradients, each bucket sums one flag per parameter: whether
    the rank gave it a gradient. A parameter no rank gave one keeps ``None``;
    one that some rank did gets the average, zeros standing for the others,
    as DistributedDataParallel with ``find_unused_parameters=True`` gives.

    Args:
        parameters: the parameters of each partition here, by partition index
        group: the process group (``None``: the default group)
        after: parameters whose gradients are final only after the step
            (tied weights, whose shares are summed as it ends): averaged
            last, by :meth:`wait`, and not with their partition
    """

    def __init__(self, parameters: Dict[int, Sequence[nn.Parameter]],
                 group: Optional[dist.ProcessGroup],
                 after: Sequence[nn.Parameter] = ()) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        seen: Set[int] = set()
        self.parameters: Dict[int, List[nn.Parameter]] = {}
        # Under index -1, which no partition reports done: wait() launches it, last.
        # First here, it takes the tied parameters from their partitions.
        every = {-1: after, **parameters}
        for j in sorted(every):
            mine = [p for p in every[j] if p.requires_grad and id(p) not in seen]
            seen.update(id(p) for p in mine)
            self.parameters[j] = mine
        #: The partitions still to launch, the next one last.
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
        # One bucket per device and type: a collective takes tensors of one kind.
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
        """Launches what is left, waits for every all-reduce and writes the averages back."""
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

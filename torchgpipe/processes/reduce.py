"""Averaging a step's gradients over data-parallel replicas, partition by partition, as
DDP's reducer would, had it seen the step's backward passes. Each partition's all-reduce
starts once its last backward action is done, from the last partition, in that order on
every rank::

    partition 2   B B B B ─► all-reduce(2)
    partition 1     B B B B ─► all-reduce(1)
    partition 0       B B B B ─► all-reduce(0) ─► wait for the three, write back
"""
import threading
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__: List[str] = []

Bucket = Tuple[List[nn.Parameter], Tensor]


class AllReduce:
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

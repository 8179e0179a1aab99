"""Blocks: CPU memory for the wire's messages, reused once no tensor views it.

Every message between two ranks is received as buffers of bytes (see
:class:`~torchgpipe.distributed.channels.Channels`), and the tensors a rank
receives are views of them, used by its partition until their backward pass.
Allocating a fresh megabyte buffer per message costs page faults on every
step, unless the C allocator happens to keep freed memory for reuse (glibc
returns large blocks to the system at once). :class:`Blocks` keeps the
memory instead, as CUDA's caching allocator does for GPUs: a block goes
back to the pool when the last tensor using it is gone, and never before.

How "the last tensor" is seen: a block is lent out as a :class:`memoryview`
wrapped by :func:`torch.frombuffer`. The tensor's storage holds that
memoryview until the storage itself dies, which is when no tensor, view,
saved tensor or storage object refers to it any more. A finalizer on the
memoryview returns the block::

    bytearray (pool) <-- memoryview <-- storage <-- tensor, views of it, ...
                              |
                              '-- finalizer: back to the pool
"""
import weakref
from typing import Dict, List, Set

import torch
from torch import Tensor

__all__: List[str] = []


#: Where a block's tensor starts, in bytes: a cache line, and the alignment
#: that PyTorch's own CPU allocator gives.
ALIGNMENT = 64


class Blocks:
    """A pool of CPU blocks of memory, by size in bytes.

    A block freed by the tensors using it waits in the pool for a message of
    its size. The sizes of a pipeline's messages repeat from step to step;
    :meth:`trim` drops the free blocks of sizes the last step did not use.
    """

    def __init__(self) -> None:
        self.free: Dict[int, List[bytearray]] = {}
        #: The sizes taken since the last trim.
        self.used: Set[int] = set()

    def take(self, size: int) -> Tensor:
        """A ``uint8`` tensor of ``size`` bytes, of a block nothing else uses.

        Its contents are whatever the block held last.
        """
        self.used.add(size)
        free = self.free.setdefault(size, [])
        # pop() and append() are atomic: the finalizer may run in any thread.
        block = free.pop() if free else bytearray(size + ALIGNMENT)
        # Lent from a multiple of ALIGNMENT in memory, as tensors of PyTorch's
        # own allocator are (a bytearray's bytes start 16 bytes past one),
        # which kernels may be faster on.
        start = -torch.frombuffer(block, dtype=torch.uint8).data_ptr() % ALIGNMENT
        lease = memoryview(block)[start:start + size]
        weakref.finalize(lease, self.give_back, size, block).atexit = False
        return torch.frombuffer(lease, dtype=torch.uint8)

    def give_back(self, size: int, block: bytearray) -> None:
        # Blocks of a size the pool has dropped are left to the garbage collector.
        free = self.free.get(size)
        if free is not None:
            free.append(block)

    def trim(self) -> None:
        """Drops the free blocks of every size not taken since the last trim."""
        for size in list(self.free):
            if size not in self.used:
                del self.free[size]
        self.used.clear()

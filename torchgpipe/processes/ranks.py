"""Which rank holds each partition of a DistributedGPipe, and every rank agreeing on it."""
import json
from typing import Any, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from torchgpipe.engine.generators import worker_of
from torchgpipe.foundation.validation import describe
from torchgpipe.transport.faults import Mismatch, by_rank

__all__: List[str] = []


def ranks_of_partitions(balance: List[int], size: int, placement: str) -> List[int]:
    """The rank of each partition over ``size`` ranks, laid out as ``placement`` says;
    ``ValueError`` for an unknown placement or partitions that do not divide evenly."""
    if placement not in ('loop', 'v'):
        raise ValueError(describe("placement must be 'loop' or 'v'", f'placement: {placement!r}',
                                  "use placement='loop' (partition j on rank j % size), or "
                                  "'v' (rank r keeps partitions r and 2 size - 1 - r)"))
    n = len(balance)
    if placement == 'v' and n != 2 * size:
        raise ValueError(describe("placement='v' needs two partitions per rank of the group",
                                  f'balance: {balance}, ranks: {size}',
                                  f'give {2 * size} numbers of layers'))
    if n % size:
        raise ValueError(describe('balance must give each rank of the group as many '
                                  'partitions', f'balance: {balance}, ranks: {size}',
                                  f'give {size} numbers of layers (or a multiple of {size}), '
                                  f'or run {n} processes'))
    return [worker_of(j, n, size, placement) for j in range(n)]


def agree_on_layout(module: nn.Sequential, arguments: Dict[str, Any],
                    problem: Optional[Exception], group: Optional[dist.ProcessGroup],
                    ranks: List[int], device: Optional[torch.device]) -> None:
    """Checks in one exchange that every rank of ``group`` can build the pipeline and cuts
    the layers alike (``device`` is ``None`` if this rank's is unusable). Raises ``problem``
    on its rank once the others know, :exc:`~torchgpipe.distributed.Mismatch` on the
    others, or on all if ``arguments`` or layers differ."""
    if device is None:  # the device of the backend's collectives
        device = torch.device('cuda', torch.cuda.current_device()) \
            if dist.get_backend(group) == 'nccl' else torch.device('cpu')
    layers = [] if problem is not None else [
        [type(layer).__name__,
         *(f'{name} {tuple(p.shape)} {p.dtype}' for name, p in layer.named_parameters())]
        for layer in module]
    error = None if problem is None else f'{type(problem).__name__}: {problem}'
    # As JSON, never pickled: a rank reads another's data, not its code.
    mine = [{} if problem is not None else arguments, layers, error]
    everyone = [json.loads(data) for data in all_gather_bytes(json.dumps(mine).encode(), group,
                                                               device)]
    if problem is not None:
        raise problem
    for rank, (_, _, theirs) in zip(ranks, everyone):
        if theirs is not None:
            raise Mismatch(f'rank {rank} cannot build the pipeline: {theirs}')
    said = [{**theirs, 'layers': len(described)} for theirs, described, _ in everyone]
    if len({values['layers'] for values in said}) == 1:
        for k in range(len(layers)):
            if any(theirs[k] != everyone[0][1][k] for _, theirs, _ in everyone):
                for values, (_, theirs, _) in zip(said, everyone):
                    values[f'layer {k}'] = theirs[k]
                break
    keys = [key for key in said[0] if any(values[key] != said[0][key] for values in said)]
    if keys:
        raise Mismatch('the ranks of the pipeline lay out its layers differently '
                       f'({by_rank({r: {k: v[k] for k in keys} for r, v in zip(ranks, said)})}); '
                       'build the pipeline alike on every rank: the same module, and one '
                       'balance, placement, checkpoint and deferred_batch_norm for all (such '
                       'as plan.kwargs of torchgpipe.plan(..., group=...), the same on every '
                       'rank)')


def all_gather_bytes(data: bytes, group: Optional[dist.ProcessGroup],
                     device: torch.device) -> List[bytes]:
    """What each rank of ``group`` gave, in rank order (on ``device``: CUDA for NCCL);
    unlike :func:`torch.distributed.all_gather_object`, without NumPy."""
    size = torch.tensor([len(data)], dtype=torch.int64, device=device)
    sizes = [torch.empty_like(size) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    buffer = torch.zeros(longest, dtype=torch.uint8, device=device)
    if data:
        buffer[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    buffers = [torch.empty_like(buffer) for _ in sizes]
    dist.all_gather(buffers, buffer, group=group)
    return [bytes(b[:int(s)].cpu().tolist()) for b, s in zip(buffers, sizes)]

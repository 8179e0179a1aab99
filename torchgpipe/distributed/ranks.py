"""Which rank holds each partition of a DistributedGPipe: in a loop, or in a V."""
from typing import List

from torchgpipe.foundation.validation import describe

__all__: List[str] = []


def ranks_of_partitions(balance: List[int], size: int, placement: str) -> List[int]:
    """The rank of each partition over ``size`` ranks, laid out as ``placement`` says.

    Raises:
        ValueError: the partitions do not divide evenly among the ranks, or
            ``placement`` is not ``'loop'``, or ``'v'`` with two partitions per rank
    """
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
    if placement == 'v':
        return [min(j, n - 1 - j) for j in range(n)]
    return [j % size for j in range(n)]

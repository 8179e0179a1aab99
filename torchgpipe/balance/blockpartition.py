"""Optimal block partitioning, in ``O(n log^2 n)`` expected, on exact integers:

1. the smallest largest block sum ``U`` (the slowest stage paces the pipeline), by
   random pivots among run sums, each tried by a greedy walk over prefix sums;
2. the largest smallest block sum ``L`` the same way, each tried by a dynamic program
   over suffixes (block counts as bit sets) with a two-stack sliding window;
3. the cuts, read off the program, shortest block first.
"""
import math
import numbers
import random
from bisect import bisect_left, bisect_right
from itertools import accumulate
from typing import List, Optional, Sequence, Tuple, TypeVar

from torchgpipe.foundation.validation import check_number

__all__: List[str] = []

T = TypeVar('T', int, float)

# The seed of the pivots: the result does not depend on them, the running time does.
PIVOT_SEED = 0


def solve(sequence: Sequence[T], partitions: int = 1) -> List[List[T]]:
    """Splits costs into contiguous blocks whose largest sum is smallest; then whose
    smallest sum is largest; then whose cuts are earliest.

    Example::

        >>> solve([1, 2, 3, 4, 5, 6], partitions=2)
        [[1, 2, 3, 4], [5, 6]]
        >>> solve([1, 0, 1], partitions=2)
        [[1], [0, 1]]

    Raises:
        ValueError: ``partitions`` is less than 1 or more than the items, or a cost is
            negative, NaN or infinite
        TypeError: ``partitions`` is not an int, or a cost is not a real number
    """
    check_partitions(partitions)
    n = len(sequence)
    if n < partitions:
        raise ValueError(f'sequence is shorter than intended partitions '
                         f'(sequence: {n}, partitions: {partitions}); every block needs '
                         f'at least one item, so ask for at most {n} partitions')

    costs = exact_integers(sequence)
    prefix = [0]
    for cost in costs:
        prefix.append(prefix[-1] + cost)

    rng = random.Random(PIVOT_SEED)
    upper = min_bottleneck(prefix, partitions, rng)
    lower = max_lower_bound(prefix, partitions, upper, rng)

    reach = suffix_block_counts(prefix, partitions, lower, upper)
    cuts = shortest_first_cuts(prefix, partitions, lower, reach)
    return [list(sequence[i:j]) for i, j in zip(cuts, cuts[1:])]


def check_partitions(partitions: object) -> None:
    check_number('partitions', partitions,
                 'give the number of devices to balance over, such as partitions=2',
                 integer=True, least=1, must='a positive integer')


def exact_integers(sequence: Sequence[T]) -> List[int]:
    """The costs scaled to integers by their common denominator: no rounding decides."""
    ratios: List[Tuple[int, int]] = []
    for index, x in enumerate(sequence):
        if isinstance(x, numbers.Integral):
            ratio = (int(x), 1)
        elif isinstance(x, numbers.Rational):
            ratio = (int(x.numerator), int(x.denominator))
        elif isinstance(x, numbers.Real):
            value = float(x)
            if not math.isfinite(value):
                raise ValueError(f'costs must be finite (sequence[{index}]: {x!r})')
            ratio = value.as_integer_ratio()
        else:
            raise TypeError(f'costs must be real numbers (sequence[{index}]: {x!r})')
        if ratio[0] < 0:
            raise ValueError(f'costs must be non-negative (sequence[{index}]: {x!r})')
        ratios.append(ratio)

    denominator = math.lcm(*(d for _, d in ratios))
    return [p * (denominator // q) for p, q in ratios]


def min_bottleneck(prefix: List[int], partitions: int, rng: random.Random) -> int:
    """The smallest largest block sum of any partition into ``partitions`` blocks."""
    total = prefix[-1]
    largest = max(b - a for a, b in zip(prefix, prefix[1:]))
    average = -(-total // partitions)
    # At least the largest item and the average. Greedy blocks bounded by the upper
    # bound each exceed the average (but the last): at most `partitions` of them.
    lower = max(largest, average)
    upper = largest + average

    def fits(bound: int) -> bool:
        return greedy_blocks(prefix, bound, partitions) <= partitions

    # Invariant: the optimum is a run sum in [lower, upper], and upper fits.
    while True:
        pivot = random_run_sum(prefix, lower, upper - 1, rng)
        if pivot is None:
            return upper
        if fits(pivot):
            upper = pivot
        else:
            lower = pivot + 1


def greedy_blocks(prefix: List[int], bound: int, limit: int) -> int:
    """The fewest blocks of sum at most ``bound`` (at least the largest item), counted up
    to ``limit`` + 1. Splitting a block never raises a sum: if they are at most ``limit``,
    exactly ``limit`` fit too."""
    n = len(prefix) - 1
    start = 0
    blocks = 0
    while start < n:
        start = bisect_right(prefix, prefix[start] + bound) - 1
        blocks += 1
        if blocks > limit:
            break
    return blocks


def max_lower_bound(prefix: List[int], partitions: int, bottleneck: int,
                    rng: random.Random) -> int:
    """The largest ``L`` such that blocks of sums in ``[L, bottleneck]`` cover the sequence."""
    def fits(lower: int) -> bool:
        reach = suffix_block_counts(prefix, partitions, lower, bottleneck)
        return bool(reach[0] >> partitions & 1)

    # Invariant: the optimum is in [lower, upper] and lower fits; at most the average.
    lower = 0
    upper = min(bottleneck, prefix[-1] // partitions)
    while True:
        pivot = random_run_sum(prefix, lower + 1, upper, rng)
        if pivot is None:
            return lower
        if fits(pivot):
            lower = pivot
        else:
            upper = pivot - 1


def random_run_sum(prefix: List[int], low: int, high: int,
                   rng: random.Random) -> Optional[int]:
    """A run sum in ``[low, high]`` drawn uniformly (counted with multiplicity), or ``None``."""
    if low > high:
        return None
    starts = prefix[:-1]
    # For the runs starting at i, the ends with a sum in range are contiguous:
    # from firsts[i] (at least i + 1, so runs are non-empty) to ends[i] - 1.
    firsts = [bisect_left(prefix, base + low, i + 1) for i, base in enumerate(starts)]
    ends = [bisect_right(prefix, base + high, i) for i, base in enumerate(starts)]
    counts = [end - first if end > first else 0 for first, end in zip(firsts, ends)]

    cumulative = list(accumulate(counts))
    if cumulative[-1] == 0:
        return None
    rank = rng.randrange(cumulative[-1])
    i = bisect_right(cumulative, rank)
    before = cumulative[i - 1] if i else 0
    return prefix[firsts[i] + rank - before] - prefix[i]


def suffix_block_counts(prefix: List[int], partitions: int, lower: int, upper: int) -> List[int]:
    """For each suffix ``i``, the block counts (bit ``c`` for ``c``, up to ``partitions``)
    it splits into with sums in ``[lower, upper]``; ``reach[n]`` is ``1``."""
    n = len(prefix) - 1
    mask = (1 << (partitions + 1)) - 1
    reach = [0] * (n + 1)
    reach[n] = 1

    # A block starting at i ends in a window [first, last] that slides down with i.
    # Its union of reach bits is two stacks: the front [middle, last] as running
    # unions from `middle` up (dropping `last` is free), the back [first, middle) one
    # union growing down. A dry front is rebuilt from the window: each index once.
    front = [0] * (n + 1)
    first = middle = n + 1
    back = 0
    for i in range(n - 1, -1, -1):
        base = prefix[i]
        new_first = max(i + 1, bisect_left(prefix, base + lower, i + 1))
        last = bisect_right(prefix, base + upper, i) - 1

        if last < middle:
            middle = new_first
            back = 0
            union = 0
            for j in range(new_first, last + 1):
                union |= reach[j]
                front[j] = union
            window = union
        else:
            for j in range(new_first, first):
                back |= reach[j]
            window = front[last] | back
        first = new_first

        reach[i] = (window << 1) & mask
    return reach


def shortest_first_cuts(prefix: List[int], partitions: int, lower: int,
                        reach: List[int]) -> List[int]:
    """The cuts (``0`` and ``n`` included): each the shortest block reaching ``lower`` that
    leaves a feasible rest (the first such end is within the upper bound too)."""
    cuts = [0]
    start = 0
    for remaining in range(partitions - 1, -1, -1):
        end = max(start + 1, bisect_left(prefix, prefix[start] + lower, start + 1))
        while not reach[end] >> remaining & 1:
            end += 1
        cuts.append(end)
        start = end
    return cuts

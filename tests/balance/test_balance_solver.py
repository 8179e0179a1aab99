"""The block partition solver against exhaustive references.

Optimal means: the largest block sum is the smallest possible, and among the
partitions achieving it, the smallest block sum is the largest possible
(smallest spread); remaining ties go to the lexicographically smallest block
lengths. The references compute with exact fractions, as the solver does.
"""
import itertools
import random
from fractions import Fraction
from typing import List, Sequence, Tuple, Union

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchgpipe.balance.blockpartition import solve

Cost = Union[int, float]

small_ints = st.lists(st.integers(0, 10), min_size=1, max_size=8)
ties = st.lists(st.sampled_from([0, 1, 2]), min_size=1, max_size=8)
floats = st.lists(st.floats(0, 1e3, allow_nan=False, allow_infinity=False),
                  min_size=1, max_size=8)
wide_floats = st.lists(st.floats(0, 1e300, allow_nan=False, allow_infinity=False)
                       | st.floats(0, 1e-300) | st.just(0.0), min_size=1, max_size=8)


@st.composite
def one_huge(draw: st.DrawFn, max_size: int = 8) -> List[int]:
    costs = draw(st.lists(st.integers(0, 3), min_size=0, max_size=max_size - 1))
    index = draw(st.integers(0, len(costs)))
    costs.insert(index, draw(st.integers(10**6, 10**18)))
    return costs


@st.composite
def costs_and_partitions(draw: st.DrawFn,
                         costs: st.SearchStrategy[List[Cost]]) -> Tuple[List[Cost], int]:
    sequence = draw(costs)
    return sequence, draw(st.integers(1, len(sequence)))


def block_sums(blocks: Sequence[Sequence[Cost]]) -> List[Fraction]:
    return [sum((Fraction(x) for x in block), Fraction(0)) for block in blocks]


def exact_prefix_sums(sequence: Sequence[Cost]) -> List[Fraction]:
    prefix = [Fraction(0)]
    for x in sequence:
        prefix.append(prefix[-1] + Fraction(x))
    return prefix


def brute_force(sequence: Sequence[Cost], partitions: int) -> List[List[Cost]]:
    """The optimum by enumerating every set of cuts."""
    n = len(sequence)
    prefix = exact_prefix_sums(sequence)
    best = None
    for inner in itertools.combinations(range(1, n), partitions - 1):
        cuts = (0, *inner, n)
        sums = [prefix[j] - prefix[i] for i, j in zip(cuts, cuts[1:])]
        key = (max(sums), max(sums) - min(sums), [j - i for i, j in zip(cuts, cuts[1:])])
        if best is None or key < best[0]:
            best = (key, cuts)
    assert best is not None
    cuts = best[1]
    return [list(sequence[i:j]) for i, j in zip(cuts, cuts[1:])]


def optimal_max_and_min(sequence: Sequence[Cost], partitions: int) -> Tuple[Fraction, Fraction]:
    """The optimal largest block sum, and the largest smallest block sum among
    partitions achieving it, by dynamic programming over prefixes."""
    n = len(sequence)
    prefix = exact_prefix_sums(sequence)

    # largest[c][i]: the smallest largest block sum of the first i items in c blocks.
    largest: List[List[Union[Fraction, None]]] = [[None] * (n + 1) for _ in range(partitions + 1)]
    largest[0][0] = Fraction(0)
    for c in range(1, partitions + 1):
        for i in range(c, n + 1):
            options = [max(prev, prefix[i] - prefix[j])
                       for j in range(c - 1, i) if (prev := largest[c - 1][j]) is not None]
            largest[c][i] = min(options)
    bottleneck = largest[partitions][n]
    assert bottleneck is not None

    # smallest[c][i]: the largest smallest block sum of the first i items in
    # c blocks, each at most the bottleneck (None: impossible).
    smallest: List[List[Union[Fraction, None]]] = [[None] * (n + 1)
                                                   for _ in range(partitions + 1)]
    for c in range(1, partitions + 1):
        for i in range(c, n + 1):
            options = []
            for j in range(c - 1, i):
                block = prefix[i] - prefix[j]
                if block > bottleneck:
                    continue
                if c == 1:
                    if j == 0:
                        options.append(block)
                elif (prev := smallest[c - 1][j]) is not None:
                    options.append(min(prev, block))
            smallest[c][i] = max(options) if options else None
    spread_min = smallest[partitions][n]
    assert spread_min is not None
    return bottleneck, spread_min


def assert_partition_of(blocks: List[List[Cost]], sequence: Sequence[Cost],
                        partitions: int) -> None:
    assert len(blocks) == partitions
    assert all(blocks), 'a block is empty'
    assert [x for block in blocks for x in block] == list(sequence)


@settings(max_examples=250, deadline=None)
@given(costs_and_partitions(small_ints | ties | floats | wide_floats | one_huge()))
def test_equals_brute_force(case: Tuple[List[Cost], int]) -> None:
    sequence, partitions = case
    blocks = solve(sequence, partitions)
    assert_partition_of(blocks, sequence, partitions)
    assert blocks == brute_force(sequence, partitions)


def random_costs(rng: random.Random) -> List[Cost]:
    """One random sequence of a random family: small ints, ties, floats of
    one or of wildly different magnitudes, or one huge item among small ones."""
    n = rng.randint(1, 8)
    family = rng.randrange(5)
    if family == 0:
        return [rng.randint(0, 10) for _ in range(n)]
    if family == 1:
        return [rng.choice([0, 1, 2]) for _ in range(n)]
    if family == 2:
        return [rng.random() * 100 for _ in range(n)]
    if family == 3:
        return [rng.random() * 10.0 ** rng.randint(-300, 300) for _ in range(n)]
    costs: List[Cost] = [rng.randint(0, 3) for _ in range(n - 1)]
    costs.insert(rng.randint(0, n - 1), 10**12)
    return costs


# Hypothesis spends about a millisecond per drawn value here; drawing a seed
# per example and many sequences from it covers thousands of sequences fast.
@settings(max_examples=60, deadline=None)
@given(st.randoms(use_true_random=False))
def test_equals_brute_force_on_many_sequences(rng: random.Random) -> None:
    for _ in range(25):
        sequence = random_costs(rng)
        partitions = rng.randint(1, len(sequence))
        assert solve(sequence, partitions) == brute_force(sequence, partitions), \
            (sequence, partitions)


@settings(max_examples=200, deadline=None)
@given(costs_and_partitions(st.lists(st.integers(0, 50), min_size=1, max_size=24)
                            | st.lists(st.sampled_from([0, 1, 5]), min_size=1, max_size=24)
                            | st.lists(st.floats(0, 10, allow_nan=False), min_size=1,
                                       max_size=16)
                            | one_huge(max_size=24)))
def test_bottleneck_and_spread_equal_dynamic_programming(case: Tuple[List[Cost], int]) -> None:
    sequence, partitions = case
    blocks = solve(sequence, partitions)
    assert_partition_of(blocks, sequence, partitions)
    sums = block_sums(blocks)
    assert (max(sums), min(sums)) == optimal_max_and_min(sequence, partitions)


def test_examples() -> None:
    assert solve([1, 2, 3, 4, 5, 6], partitions=2) == [[1, 2, 3, 4], [5, 6]]
    assert solve([1, 0, 1], partitions=2) == [[1], [0, 1]]
    assert solve([5], partitions=1) == [[5]]
    assert solve([0, 0, 0, 0], partitions=2) == [[0], [0, 0, 0]]


def test_one_huge_element_is_alone() -> None:
    sequence = [1] * 10 + [10**9] + [1] * 10
    assert solve(sequence, 3) == [[1] * 10, [10**9], [1] * 10]


def test_spread_breaks_bottleneck_ties() -> None:
    # The 10 alone is the bottleneck in every optimal split; of the rest,
    # [1 2 3 | 4] has the largest smallest block, though [1 | 2 3 4] has
    # earlier cuts.
    assert solve([10, 1, 2, 3, 4], 3) == [[10], [1, 2, 3], [4]]


def test_items_are_returned_as_given() -> None:
    sequence = [1, 2.5, 3, 0.5]
    blocks = solve(sequence, 2)
    assert all(type(a) is type(b) for a, b in zip(itertools.chain(*blocks), sequence))


def test_fractions() -> None:
    sequence = [Fraction(1, 3), Fraction(1, 3), Fraction(2, 3)]
    assert solve(sequence, 2) == [[Fraction(1, 3), Fraction(1, 3)], [Fraction(2, 3)]]


def test_deterministic() -> None:
    sequence = [(i * 7919) % 101 for i in range(500)]
    assert solve(sequence, 16) == solve(sequence, 16)


def test_large_sequence() -> None:
    sequence = [(i * 7919) % 1009 for i in range(1000)]
    blocks = solve(sequence, 64)
    assert_partition_of(blocks, sequence, 64)
    # The bottleneck is at least the average and the largest item; the
    # greedy bound shows it is within one item of the average.
    sums = [sum(b) for b in blocks]
    assert max(sums) >= max(sum(sequence) / 64, max(sequence))
    assert max(sums) <= sum(sequence) / 64 + max(sequence)


@pytest.mark.parametrize('partitions', [0, -1])
def test_partitions_must_be_positive(partitions: int) -> None:
    with pytest.raises(ValueError, match='partitions must be a positive integer'):
        solve([1, 2, 3], partitions)


def test_partitions_must_be_int() -> None:
    with pytest.raises(TypeError, match='partitions must be an int'):
        solve([1, 2, 3], 1.5)  # type: ignore[arg-type]


def test_fewer_items_than_partitions() -> None:
    with pytest.raises(ValueError, match='sequence is shorter than intended partitions'):
        solve([1, 2, 3], 4)
    with pytest.raises(ValueError, match='sequence is shorter than intended partitions'):
        solve([], 1)


@pytest.mark.parametrize('cost', [-1, -0.5, float('nan'), float('inf')])
def test_costs_must_be_finite_and_non_negative(cost: float) -> None:
    with pytest.raises(ValueError, match=r'sequence\[1\]'):
        solve([1, cost, 2], 2)


def test_costs_must_be_real() -> None:
    with pytest.raises(TypeError, match='costs must be real numbers'):
        solve([1, 'two', 3], 2)  # type: ignore[list-item]

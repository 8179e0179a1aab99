"""Micro-batches: Batch, check, scatter and gather."""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchgpipe import NoChunk
from torchgpipe.foundation.microbatch import Batch, check, gather, map_tensors, scatter


def test_atomic_batch() -> None:
    x = torch.zeros(2, 3)
    batch = Batch(x)
    assert batch.atomic and len(batch) == 1 and list(batch) == [x]
    assert batch.tensor is x and batch.values is x and batch[0] is x
    with pytest.raises(AttributeError):
        batch.tensors
    with pytest.raises(IndexError):
        batch[1]
    y = torch.ones(2, 3)
    batch[0] = y
    assert batch.tensor is y
    batch[:] = (x,)
    assert batch.tensor is x
    with pytest.raises(IndexError):
        batch[1] = y
    with pytest.raises(IndexError):
        batch[:] = (x, y)
    assert batch.call(lambda t: t + 1).tensor.sum().item() == 6


def test_tuple_batch() -> None:
    x, y = torch.zeros(1), torch.ones(1)
    batch = Batch((x, y))
    assert not batch.atomic and len(batch) == 2 and list(batch) == [x, y]
    assert batch.tensors == (x, y) and batch.values == (x, y) and batch[1] is y
    with pytest.raises(AttributeError):
        batch.tensor
    batch[0] = y
    assert batch.tensors == (y, y)
    batch[:] = (x,)
    assert batch.tensors == (x,)
    with pytest.raises(NotImplementedError):
        batch[1:] = (x,)
    assert batch.find(lambda t: t.sum() > 0) is None
    assert Batch((x, y)).find(lambda t: t.sum() > 0) == 1
    assert 'atomic=False' in repr(batch)


def test_map_tensors_keeps_the_form() -> None:
    x, y = torch.zeros(1), torch.ones(1)
    doubled = map_tensors(lambda t: t * 2, x)
    assert isinstance(doubled, torch.Tensor) and torch.equal(doubled, x * 2)
    pair = map_tensors(lambda t: t + 1, (x, y))
    assert isinstance(pair, tuple) and len(pair) == 2
    assert torch.equal(pair[0], x + 1) and torch.equal(pair[1], y + 1)
    assert map_tensors(lambda t: t, ()) == ()


def test_check() -> None:
    check(torch.zeros(1))
    check((torch.zeros(1), torch.zeros(1)))
    with pytest.raises(TypeError, match=re.escape('(input: list); use a tuple instead')):
        check([torch.zeros(1)])
    with pytest.raises(TypeError, match=re.escape('(input: a tuple holding list at index 1); ')):
        check((torch.zeros(1), [1]))
    with pytest.raises(TypeError, match=re.escape('(input: a tuple of NoneType, int); ')):
        check((None, 1))
    with pytest.raises(TypeError, match='^output of partition 2 must be'):
        check(None, 'output of partition 2')


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 20), st.integers(1, 10), st.booleans())
def test_scatter_follows_torch_chunk_and_gather_inverts_it(size: int, chunks: int,
                                                           as_tuple: bool) -> None:
    x = torch.arange(size * 2).view(size, 2)
    input = (x, x * 10) if as_tuple else x
    batches = scatter(input, chunks)
    expected = x.chunk(chunks)
    assert len(batches) == len(expected) <= chunks
    for batch, piece in zip(batches, expected):
        first = batch[0]
        assert torch.equal(first, piece)
        if as_tuple:
            assert torch.equal(batch[1], piece * 10)
    gathered = gather(batches)
    if as_tuple:
        assert torch.equal(gathered[0], x) and torch.equal(gathered[1], x * 10)
    else:
        assert torch.equal(gathered, x)


# Entries of a mixed tuple: a batched tensor, a NoChunk tensor, or another value.
ENTRIES = st.sampled_from(['batch', 'nochunk', None, True, 3, 2.5, 'text'])


@settings(max_examples=50, deadline=None)
@given(st.lists(ENTRIES, max_size=5), st.integers(1, 8), st.integers(1, 4))
def test_scatter_shares_other_values_and_gather_takes_them_back(
        kinds: list, size: int, chunks: int) -> None:
    kinds = ['batch', *kinds]
    x = torch.arange(size * 2.0).view(size, 2)
    shared = torch.ones(3)
    input = tuple(x * i if kind == 'batch' else NoChunk(shared) if kind == 'nochunk' else kind
                  for i, kind in enumerate(kinds))
    expected_pieces = x.chunk(chunks)
    batches = scatter(input, chunks)
    assert len(batches) == len(expected_pieces)
    for batch, piece in zip(batches, expected_pieces):
        values = batch.plain
        assert len(batch) == sum(kind in ('batch', 'nochunk') for kind in kinds)
        for i, (kind, value) in enumerate(zip(kinds, values)):
            if kind == 'batch':
                assert torch.equal(value, piece * i)
            elif kind == 'nochunk':
                assert value is shared
                assert isinstance(batch.values[i], NoChunk)
            else:
                assert value is kind
    # Every tensor can be replaced through the batch, in place, keeping the rest.
    batch = batches[0]
    batch[:] = tuple(t + 1 for t in batch)
    assert [v for v in batch.plain if not isinstance(v, torch.Tensor)] == \
        [k for k in kinds if k not in ('batch', 'nochunk')]
    gathered = gather(scatter(input, chunks))
    for i, (kind, value) in enumerate(zip(kinds, gathered)):
        if kind == 'batch':
            assert torch.equal(value, x * i)
        else:
            assert value is (shared if kind == 'nochunk' else kind)


def test_map_tensors_keeps_other_values() -> None:
    x, y = torch.ones(1), torch.zeros(2)
    mapped = map_tensors(lambda t: t + 1, (x, NoChunk(y), None, 'a'))
    assert isinstance(mapped, tuple) and mapped[2:] == (None, 'a')
    assert torch.equal(mapped[0], x + 1)
    assert isinstance(mapped[1], NoChunk) and torch.equal(mapped[1].tensor, y + 1)

"""Micro-batches: Batch, check, scatter and gather."""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchgpipe.microbatch import Batch, check, gather, map_tensors, scatter


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

"""Deferred BatchNorm inside GPipe: running statistics as if on the full batch.

On both execution paths: the statistics are committed by whichever thread
runs the last micro-batch of the partition.
"""
import copy
from typing import Callable

import pytest
import torch
from torch import Tensor, nn

from helpers import cpu_devices
from torchgpipe import GPipe
from torchgpipe.runtime.batchnorm import DeferredBatchNorm


class Block(nn.Module):
    """A custom module with a BatchNorm inside: conversion must reach it."""

    def __init__(self, bn: nn.Module) -> None:
        super().__init__()
        self.inner = nn.Sequential(bn, nn.ReLU())

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)


# One BatchNorm per model: a second one would see activations normalized per
# micro-batch, which differ from the full batch's by design.
MODELS = {
    '1d': (lambda: nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.BatchNorm1d(6),
                                 nn.Linear(6, 6), nn.ReLU()),
           lambda b: torch.randn(b, 4)),
    '2d-nested': (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), Block(nn.BatchNorm2d(3)),
                                        nn.Conv2d(3, 3, 1), nn.ReLU(), nn.Conv2d(3, 1, 1)),
                  lambda b: torch.randn(b, 2, 5, 5)),
    '3d-nested': (lambda: nn.Sequential(nn.Conv3d(2, 3, 1), nn.ReLU(), nn.Conv3d(3, 3, 1),
                                        Block(nn.BatchNorm3d(3, momentum=None)),
                                        nn.Conv3d(3, 3, 1)),
                  lambda b: torch.randn(b, 2, 3, 3, 3)),
}


def batch_norms(module: nn.Module) -> list:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


@pytest.mark.parametrize('batch_size, chunks', [(8, 4), (6, 4), (9, 2)])  # 6 → 3 chunks
@pytest.mark.parametrize('kind', sorted(MODELS))
def test_running_statistics_equal_the_unwrapped_full_batch(kind: str, batch_size: int,
                                                           chunks: int, checkpoint: str,
                                                           threaded: bool) -> None:
    make_model, make_input = MODELS[kind]
    model: nn.Sequential = make_model()  # type: ignore[operator]
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [2, 3], devices=cpu_devices(2, threaded), chunks=chunks,
                  checkpoint=checkpoint, deferred_batch_norm=True)
    assert len([m for m in gpipe.modules() if isinstance(m, DeferredBatchNorm)]) == 1

    for _ in range(3):
        x = make_input(batch_size)  # type: ignore[operator]
        reference(x).sum().backward()
        gpipe(x).sum().backward()
        for expected, actual in zip(batch_norms(reference), batch_norms(gpipe)):
            torch.testing.assert_close(actual.running_mean, expected.running_mean)
            torch.testing.assert_close(actual.running_var, expected.running_var)
            assert actual.num_batches_tracked == expected.num_batches_tracked

    # Eval mode normalizes with the committed statistics.
    reference.eval()
    gpipe.eval()
    x = make_input(batch_size)  # type: ignore[operator]
    torch.testing.assert_close(gpipe(x), reference(x))


def test_without_deferral_statistics_follow_micro_batches(threaded: bool) -> None:
    """The property is real: plain BatchNorm in GPipe does not match the full batch."""
    make_model: Callable[[], nn.Sequential] = MODELS['1d'][0]  # type: ignore[assignment]
    model = make_model()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [2, 3], devices=cpu_devices(2, threaded), chunks=4)
    x = torch.randn(8, 4) * 3 + 1
    reference(x)
    gpipe(x)
    assert batch_norms(gpipe)[0].num_batches_tracked == 4
    assert batch_norms(reference)[0].num_batches_tracked == 1
    assert not torch.allclose(batch_norms(gpipe)[0].running_var,
                              batch_norms(reference)[0].running_var)


@pytest.mark.parametrize('by', ['convert_deferred_batch_norm', 'GPipe'])
def test_deferred_layer_of_other_chunks_is_replaced_and_commits_once_per_mini_batch(by: str,
                                                                          threaded: bool) -> None:
    """A layer deferred over 2 micro-batches, converted again for 4 (by the
    classmethod, or by GPipe's deferred_batch_norm=True), gives the running
    statistics of the unwrapped model: one commit per mini-batch of 4.

    GPipe also tells every deferred layer of its partitions how many
    micro-batches each call makes, so the statistics would hold without the
    conversion too; the conversion must still replace the layer, leaving the
    one given as it was."""
    make_model: Callable[[], nn.Sequential] = MODELS['1d'][0]  # type: ignore[assignment]
    model = make_model()
    reference = copy.deepcopy(model)
    old = DeferredBatchNorm.convert_deferred_batch_norm(model[2], chunks=2)
    model[2] = old
    if by == 'convert_deferred_batch_norm':
        model[2] = DeferredBatchNorm.convert_deferred_batch_norm(old, chunks=4)
    gpipe = GPipe(model, [2, 3], devices=cpu_devices(2, threaded), chunks=4,
                  deferred_batch_norm=(by == 'GPipe'))

    for _ in range(2):
        x = torch.randn(8, 4) * 3 + 1
        reference(x).sum().backward()
        gpipe(x).sum().backward()
        expected, actual = batch_norms(reference)[0], batch_norms(gpipe)[0]
        torch.testing.assert_close(actual.running_mean, expected.running_mean)
        torch.testing.assert_close(actual.running_var, expected.running_var)
        assert actual.num_batches_tracked == expected.num_batches_tracked
    assert gpipe[2] is not old and gpipe[2].chunks == 4 and old.chunks == 2


class FailOnce(nn.Module):
    """Raises at its ``at``-th call (counted from 0), once."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at, self.calls = at, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls - 1 == self.at:
            raise ValueError('planned failure')
        return x


def forward_step(gpipe: GPipe, x: Tensor) -> None:
    gpipe(x).pow(2).mean().backward()


def step_by_train_step(gpipe: GPipe, x: Tensor) -> None:
    gpipe.train_step(x, torch.zeros(x.size(0), 1), lambda y, t: (y - t).pow(2).mean())


@pytest.mark.parametrize('step', [forward_step, step_by_train_step], ids=['forward', 'train_step'])
@pytest.mark.parametrize('at', [1, 3], ids=['during', 'after-the-commit'])
def test_a_failed_step_leaves_running_statistics_as_they_were(
        step: Callable[[GPipe, Tensor], None], at: int, threaded: bool) -> None:
    """A step that fails leaves no accumulated sums behind for the next to commit,
    and undoes nothing it committed: the statistics are those of the good steps only.
    Failing at the last micro-batch of the second partition comes after the first
    partition's layer has seen every micro-batch."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6),
                          nn.BatchNorm1d(6), nn.Linear(6, 1))
    reference = copy.deepcopy(model)
    model.insert(4, FailOnce(at))
    gpipe = GPipe(model, balance=[3, 4], devices=cpu_devices(2, threaded), chunks=4,
                  deferred_batch_norm=True)
    before = copy.deepcopy(gpipe.state_dict())
    with pytest.raises(ValueError, match='planned failure'):
        step(gpipe, torch.randn(16, 4) * 3 + 1)
    for name, value in gpipe.state_dict().items():
        assert torch.equal(value, before[name]), name

    x = torch.randn(16, 4)
    step(gpipe, x)
    # The reference sees the good mini-batch only; the second BatchNorm sees
    # activations normalized per micro-batch, so compare the first one.
    reference(x)
    layer = gpipe[1]
    assert isinstance(layer, DeferredBatchNorm)
    torch.testing.assert_close(layer.running_mean, reference[1].running_mean)
    torch.testing.assert_close(layer.running_var, reference[1].running_var)
    assert layer.num_batches_tracked == 1

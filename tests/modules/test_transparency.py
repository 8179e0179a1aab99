"""Property 1: GPipe computes what the unwrapped nn.Sequential computes.

Outputs, the input gradient and every parameter gradient equal those of the
unwrapped model on the full batch, for any model, balance, chunks and
checkpoint mode, with every partition in the calling thread or one worker
thread per device (the ``threaded`` fixture of conftest.py).
"""
import copy
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from helpers import (CHECKPOINT_MODES, assert_same_random_step, assert_same_training_step,
                     cpu_devices, run_in_clock_order)
from test_train_step import assert_train_step_as_unwrapped
from torchgpipe import GPipe

WIDTH = 5
LAYER_KINDS = ['linear', 'relu', 'tanh', 'layernorm', 'scale', 'softplus']


def make_layer(kind: str) -> nn.Module:
    if kind == 'linear':
        return nn.Linear(WIDTH, WIDTH)
    if kind == 'relu':
        return nn.ReLU()
    if kind == 'tanh':
        return nn.Tanh()
    if kind == 'layernorm':
        return nn.LayerNorm(WIDTH)
    if kind == 'softplus':
        return nn.Softplus()
    return Scale()


class Scale(nn.Module):
    """A layer whose parameter has the same shape as its input rows."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


@st.composite
def pipelines(draw: st.DrawFn) -> Tuple[List[str], List[int], int, int, str]:
    kinds = draw(st.lists(st.sampled_from(LAYER_KINDS), min_size=1, max_size=8))
    partitions = draw(st.integers(1, min(4, len(kinds))))
    # A random composition of len(kinds) into `partitions` positive parts.
    cuts = sorted(draw(st.sets(st.integers(1, len(kinds) - 1),
                               min_size=partitions - 1, max_size=partitions - 1))) \
        if partitions > 1 else []
    bounds = [0, *cuts, len(kinds)]
    balance = [b - a for a, b in zip(bounds, bounds[1:])]
    chunks = draw(st.integers(1, 8))
    batch_size = draw(st.integers(1, 12))
    checkpoint = draw(st.sampled_from(CHECKPOINT_MODES))
    return kinds, balance, chunks, batch_size, checkpoint


@settings(max_examples=80, deadline=None)
@given(pipelines(), st.integers(0, 2**16), st.booleans())
def test_outputs_and_gradients_equal_unwrapped(case: Tuple[List[str], List[int], int, int, str],
                                               seed: int, threaded: bool) -> None:
    kinds, balance, chunks, batch_size, checkpoint = case
    torch.manual_seed(seed)
    model = nn.Sequential(*[make_layer(k) for k in kinds]).double()
    input = torch.randn(batch_size, WIDTH, dtype=torch.double)

    assert_same_training_step(
        model,
        lambda m: GPipe(m, balance, devices=cpu_devices(len(balance), threaded), chunks=chunks,
                        checkpoint=checkpoint),
        input)


@pytest.mark.parametrize('batch_size, chunks', [(10, 4), (3, 8), (7, 7), (1, 3)])
def test_uneven_and_small_batches(batch_size: int, chunks: int, checkpoint: str,
                                  threaded: bool) -> None:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
                          nn.ReLU()).double()
    input = torch.randn(batch_size, WIDTH, dtype=torch.double)
    assert_same_training_step(
        model, lambda m: GPipe(m, [1, 2, 1], devices=cpu_devices(3, threaded), chunks=chunks,
                               checkpoint=checkpoint),
        input)


def test_float32_matches_closely(threaded: bool) -> None:
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(6)])
    input = torch.randn(24, 16)
    assert_same_training_step(
        model, lambda m: GPipe(m, [2, 2, 1, 1], devices=cpu_devices(4, threaded), chunks=5),
        input, rtol=1e-6, atol=1e-6)


def test_dropout_is_replayed_in_recomputation(checkpoint: str, threaded: bool) -> None:
    """Dropout draws one mask per micro-batch; the recomputation must redraw the same.

    The reference is the unwrapped model run on the micro-batches in clock
    order, which draws the same random numbers as GPipe, with worker threads
    too. If the recomputation drew new masks, the gradients would not match.
    """
    balance = [2, 3, 2]
    chunks = 4
    model = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5),
                          nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh(),
                          nn.Dropout(0.5), nn.Linear(8, 8)).double()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, balance, devices=cpu_devices(3, threaded), chunks=chunks,
                  checkpoint=checkpoint)
    input = torch.randn(8, 8, dtype=torch.double)
    actual, _ = assert_same_random_step(reference, gpipe, input)
    # Dropout did drop something, or this test would prove nothing.
    with torch.no_grad():
        assert not torch.allclose(actual, copy.deepcopy(reference).eval()(input))


def test_autocast_is_carried_into_workers_and_recomputation(checkpoint: str,
                                                            threaded: bool) -> None:
    """Under torch.autocast, every partition computes in bfloat16, also when recomputed.

    The reference runs the unwrapped model per micro-batch under the same
    autocast. A worker without autocast would compute in float32; a
    recomputation without it would backpropagate through float32 kernels.
    The weight cast cache is off: with it, the reference would sum the
    micro-batches' weight gradients in bfloat16 through one cached cast,
    while a recomputation casts (and sums) anew.
    """
    balance = [2, 2, 2]
    chunks = 3
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.GELU(),
                          nn.Linear(32, 8), nn.Tanh())
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, balance, devices=cpu_devices(3, threaded), chunks=chunks,
                  checkpoint=checkpoint)
    input = torch.randn(12, 16)

    with torch.autocast('cpu', dtype=torch.bfloat16, cache_enabled=False):
        expected = run_in_clock_order(reference, balance, input, chunks)
        actual = gpipe(input)
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)

    expected.float().pow(2).sum().backward()
    actual.float().pow(2).sum().backward()
    for (name, p), q in zip(gpipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_autocast_off_inside_autocast_region_stays_off(threaded: bool) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    gpipe = GPipe(model, [1, 1], devices=cpu_devices(2, threaded), chunks=2)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        with torch.autocast('cpu', enabled=False):
            output = gpipe(torch.randn(4, 4))
    assert output.dtype == torch.float32


class Split(nn.Module):
    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        return x, x * 2


class PairLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)
        self.b = nn.Linear(WIDTH, WIDTH)

    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        x, y = pair
        return self.a(x) + y, self.b(y).tanh()


class Masked(nn.Module):
    """Takes (x, mask) where the mask needs no gradient, returns (x * mask, mask)."""

    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        x, mask = pair
        return x * mask, mask


class Merge(nn.Module):
    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tensor:
        return pair[0] + pair[1]


@pytest.mark.parametrize('balance', [[1, 1, 1, 1], [2, 2], [1, 3], [3, 1]])
def test_tuples_at_every_boundary(balance: List[int], checkpoint: str, threaded: bool) -> None:
    model = nn.Sequential(Split(), PairLinear(), PairLinear(), Merge()).double()
    input = torch.randn(9, WIDTH, dtype=torch.double)
    assert_same_training_step(
        model, lambda m: GPipe(m, balance, devices=cpu_devices(len(balance), threaded),
                               chunks=4, checkpoint=checkpoint),
        input)


def test_tuple_input_with_a_tensor_that_needs_no_grad(checkpoint: str, threaded: bool) -> None:
    torch.manual_seed(0)
    layers = [PairLinear(), Masked(), PairLinear(), Masked(), Merge()]
    model = nn.Sequential(*layers).double()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [2, 2, 1], devices=cpu_devices(3, threaded), chunks=3,
                  checkpoint=checkpoint)

    x = torch.randn(6, WIDTH, dtype=torch.double, requires_grad=True)
    mask = (torch.rand(6, WIDTH) > 0.5).double()
    x_ref = x.detach().clone().requires_grad_()

    expected = reference((x_ref, mask))
    expected.sum().backward()
    actual = gpipe((x, mask))
    actual.sum().backward()

    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(x.grad, x_ref.grad)
    assert mask.grad is None and not mask.requires_grad
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


class Embed(nn.Module):
    """Integer token ids in, as the first tensor of a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, WIDTH)

    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        ids, scale = pair
        return ids, self.embedding(ids) * scale


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, 1)

    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        ids, h = pair
        return ids, self.linear(h).squeeze(1) + ids.double()


def test_integer_tensors_cross_boundaries(checkpoint: str, threaded: bool) -> None:
    model = nn.Sequential(Embed(), Head()).double()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [1, 1], devices=cpu_devices(2, threaded), chunks=4,
                  checkpoint=checkpoint)

    ids = torch.randint(10, (8,))
    scale = torch.ones(8, 1, dtype=torch.double)
    expected = reference((ids, scale))
    actual = gpipe((ids, scale))
    assert actual[0].dtype == torch.int64
    torch.testing.assert_close(actual, expected)
    expected[1].sum().backward()
    actual[1].sum().backward()
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_input_requiring_grad_receives_it_and_no_grad_mode_builds_no_graph(
        threaded: bool) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    graph_built: List[bool] = []
    for layer in model:
        layer.register_forward_hook(lambda m, args, y: graph_built.append(y.requires_grad))
    gpipe = GPipe(model, [2, 1], devices=cpu_devices(2, threaded), chunks=2)
    with torch.no_grad():
        output = gpipe(torch.randn(4, 4, requires_grad=True))
    assert not output.requires_grad
    # Not in any layer either, whichever thread ran it: the output alone is
    # assembled in the calling thread, where no_grad is on anyway.
    assert len(graph_built) == 2 * len(model) and not any(graph_built)

    x = torch.randn(4, 4, requires_grad=True)
    gpipe(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_repeated_steps_match_unwrapped_training(checkpoint: str, threaded: bool) -> None:
    """A few SGD steps: parameters stay equal to those of the unwrapped model."""
    model = nn.Sequential(nn.Linear(6, 12), nn.ReLU(), nn.Linear(12, 12), nn.ReLU(),
                          nn.Linear(12, 3)).double()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [2, 2, 1], devices=cpu_devices(3, threaded), chunks=4,
                  checkpoint=checkpoint)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1)
    opt = torch.optim.SGD(gpipe.parameters(), lr=0.1)
    for step in range(5):
        x = torch.randn(10, 6, dtype=torch.double)
        target = torch.randint(3, (10,))
        for net, optimizer in ((reference, opt_ref), (gpipe, opt)):
            optimizer.zero_grad()
            nn.functional.cross_entropy(net(x), target).backward()
            optimizer.step()
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q)


class Branches(nn.Module):
    """Several linear branches of one input; the layers after it use some of them."""

    def __init__(self, count: int) -> None:
        super().__init__()
        self.branches = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(count))

    def forward(self, x: Tensor) -> Tuple[Tensor, ...]:
        return tuple(branch(x) for branch in self.branches)


class Pick(nn.Module):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def forward(self, branches: Tuple[Tensor, ...]) -> Tensor:
        return branches[self.index]


@st.composite
def unused_branches(draw: st.DrawFn) -> Tuple[nn.Sequential, List[int], int, str]:
    """Branches, a pick of one, then more layers, cut anywhere (the pick may be at a boundary)."""
    count = draw(st.integers(2, 3))
    tail = draw(st.lists(st.sampled_from(LAYER_KINDS), max_size=3))
    layers = [Branches(count), Pick(draw(st.integers(0, count - 1))),
              *(make_layer(k) for k in tail)]
    cuts = sorted(draw(st.sets(st.integers(1, len(layers) - 1), max_size=3)))
    bounds = [0, *cuts, len(layers)]
    balance = [b - a for a, b in zip(bounds, bounds[1:])]
    return (nn.Sequential(*layers).double(), balance, draw(st.integers(1, 4)),
            draw(st.sampled_from(CHECKPOINT_MODES)))


@settings(max_examples=60, deadline=None)
@given(unused_branches(), st.booleans(), st.sampled_from(['call', '1f1b', 'fill_drain']))
def test_parameters_of_unused_outputs_get_no_gradient(case: Tuple[nn.Sequential, List[int],
                                                                  int, str],
                                                      threaded: bool, how: str) -> None:
    """None, as unwrapped, not zeros: an optimizer skips a None gradient, not a zero one."""
    model, balance, chunks, checkpoint = case
    options = dict(balance=balance, devices=cpu_devices(len(balance), threaded), chunks=chunks,
                   checkpoint=checkpoint)
    input = torch.randn(6, WIDTH, dtype=torch.double)
    if how == 'call':
        assert_same_training_step(model, lambda m: GPipe(m, **options), input)
    else:
        target = torch.randn(6, WIDTH, dtype=torch.double)
        assert_train_step_as_unwrapped(model, input, target, F.mse_loss, schedule=how, **options)


@st.composite
def unused_final_outputs(draw: st.DrawFn) -> Tuple[nn.Sequential, List[int], int, str,
                                                   List[int]]:
    """Layers ending in branches, of which the loss uses a random subset."""
    head = draw(st.lists(st.sampled_from(LAYER_KINDS), max_size=3))
    count = draw(st.integers(2, 3))
    layers = [*(make_layer(k) for k in head), Branches(count)]
    cuts = sorted(draw(st.sets(st.integers(1, len(layers) - 1), max_size=2))) \
        if len(layers) > 1 else []
    bounds = [0, *cuts, len(layers)]
    used = sorted(draw(st.sets(st.integers(0, count - 1), min_size=1, max_size=count - 1)))
    return (nn.Sequential(*layers).double(), [b - a for a, b in zip(bounds, bounds[1:])],
            draw(st.integers(1, 4)), draw(st.sampled_from(CHECKPOINT_MODES)),
            used)


@settings(max_examples=60, deadline=None)
@given(unused_final_outputs(), st.booleans(), st.sampled_from(['call', '1f1b', 'fill_drain']))
def test_outputs_the_loss_leaves_out_get_no_gradient(
        case: Tuple[nn.Sequential, List[int], int, str, List[int]],
        threaded: bool, how: str) -> None:
    """The last partition's outputs the loss does not use: it trains as unwrapped."""
    model, balance, chunks, checkpoint, used = case
    options = dict(balance=balance, devices=cpu_devices(len(balance), threaded), chunks=chunks,
                   checkpoint=checkpoint)
    input = torch.randn(6, WIDTH, dtype=torch.double)
    target = torch.randn(6, WIDTH, dtype=torch.double)

    def loss_fn(output: Tuple[Tensor, ...], target: Tensor = target) -> Tensor:
        return sum((F.mse_loss(output[k], target) for k in used), torch.zeros(()))

    if how == 'call':
        assert_same_training_step(model, lambda m: GPipe(m, **options), input,
                                  loss_fn=loss_fn)
    else:
        assert_train_step_as_unwrapped(model, input, target, loss_fn, schedule=how, **options)

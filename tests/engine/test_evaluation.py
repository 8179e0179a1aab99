"""GPipe.eval_step: the forward actions of a step alone, as model.eval() and no_grad give them.

Compared with the unwrapped model in evaluation mode under ``torch.no_grad()``,
on both execution paths: the output, the loss, the running statistics left
alone, the modes of the layers given back, no gradient anywhere.
"""
from typing import List, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from helpers import cpu_devices
from test_distributed import FEATURES, TOLERANCE, build
from torchgpipe import GPipe


def with_dropout() -> Tuple[nn.Sequential, List[int]]:
    """Dropout and BatchNorm, which evaluation turns off and freezes."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 8), nn.Dropout(0.5), nn.BatchNorm1d(8), nn.Tanh(),
                         nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, FEATURES)).double(), \
        [2, 3, 2]


def models() -> List[Tuple[str, Tuple[nn.Sequential, List[int]]]]:
    return [(name, build(name)) for name in ('mlp', 'unet', 'batchnorm')] + \
        [('dropout', with_dropout())]


def expected(model: nn.Module, input: Tensor, target: Tensor) -> Tuple[Tensor, Tensor]:
    """The unwrapped model's output and loss, evaluated; its modes given back."""
    modes = [m.training for m in model.modules()]
    model.eval()
    with torch.no_grad():
        output = model(input)
    for m, training in zip(model.modules(), modes):
        m.training = training
    return output, F.mse_loss(output, target)


def state(model: nn.Module) -> List[Tensor]:
    return [t.clone() for t in model.state_dict().values()]


@pytest.mark.parametrize('name, built', models(), ids=[n for n, _ in models()])
@pytest.mark.parametrize('deferred', [False, True], ids=['batchnorm', 'deferred'])
def test_evaluation_is_the_unwrapped_model_in_eval_mode_without_grad(
        name: str, built: Tuple[nn.Sequential, List[int]], deferred: bool,
        threaded: bool) -> None:
    model, balance = built
    gpipe = GPipe(model, balance, devices=cpu_devices(len(balance), threaded), chunks=3,
                  deferred_batch_norm=deferred)
    model[0].eval()  # a layer in its own mode, given back
    input, target = (torch.randn(10, FEATURES, dtype=torch.float64) for _ in range(2))
    want_output, want_loss = expected(model, input, target)
    before = state(model)
    output = gpipe.eval_step(input)
    loss = gpipe.eval_step(input, target, F.mse_loss)
    torch.testing.assert_close(output, want_output, **TOLERANCE)
    torch.testing.assert_close(loss, want_loss, **TOLERANCE)
    assert not output.requires_grad and not loss.requires_grad
    assert all(p.grad is None for p in model.parameters())
    # Running statistics (deferred or not) untouched, modes given back.
    assert all(torch.equal(a, b) for a, b in zip(state(model), before))
    assert [m.training for m in model.modules()] == [m is not model[0] for m in model.modules()]


@settings(max_examples=15, deadline=None)
@given(chunks=st.integers(1, 6), batch=st.integers(1, 9), cuts=st.sets(st.integers(1, 6)),
       threaded=st.booleans())
def test_any_balance_and_chunks(chunks: int, batch: int, cuts: set, threaded: bool) -> None:
    model, _ = with_dropout()
    bounds = [0, *sorted(cuts), len(model)]
    balance = [b - a for a, b in zip(bounds, bounds[1:])]
    gpipe = GPipe(model, balance, devices=cpu_devices(len(balance), threaded), chunks=chunks)
    input, target = (torch.randn(batch, FEATURES, dtype=torch.float64) for _ in range(2))
    want_output, want_loss = expected(model, input, target)
    torch.testing.assert_close(gpipe.eval_step(input), want_output, **TOLERANCE)
    torch.testing.assert_close(gpipe.eval_step(input, target, F.mse_loss, reduction='mean'),
                               want_loss, **TOLERANCE)


def test_training_after_evaluation_is_training_without_it(threaded: bool) -> None:
    """An evaluation between two steps changes nothing the steps see."""
    results = []
    for evaluate in (False, True):
        model, balance = with_dropout()
        gpipe = GPipe(model, balance, devices=cpu_devices(len(balance), threaded), chunks=3)
        optimizer = torch.optim.SGD(gpipe.parameters(), lr=0.1)
        torch.manual_seed(5)
        for step in range(2):
            input, target = (torch.randn(8, FEATURES, dtype=torch.float64) for _ in range(2))
            optimizer.zero_grad()
            gpipe.train_step(input, target, F.mse_loss)
            optimizer.step()
            if evaluate:
                gpipe.eval_step(input, target, F.mse_loss)
        results.append(state(model))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_a_target_goes_with_a_loss_function() -> None:
    model, balance = build('mlp')
    gpipe = GPipe(model, balance, devices=['cpu'] * len(balance))
    x = torch.randn(4, FEATURES, dtype=torch.float64)
    with pytest.raises(ValueError, match=r'eval_step takes a target and a loss_fn together, '
                                         r'or neither \(target without loss_fn\); pass '
                                         r'loss_fn too for the loss, or neither for the output'):
        gpipe.eval_step(x, x)
    with pytest.raises(ValueError, match=r'\(loss_fn without target\); pass target too'):
        gpipe.eval_step(x, loss_fn=F.mse_loss)
    with pytest.raises(TypeError, match='loss_fn must be callable'):
        gpipe.eval_step(x, x, 'mse')  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction must be 'mean' or 'sum'"):
        gpipe.eval_step(x, x, F.mse_loss, reduction='max')


def test_output_fn_picks_what_is_returned() -> None:
    model, balance = build('mlp')
    gpipe = GPipe(model, balance, devices=['cpu'] * len(balance), chunks=2)
    x = torch.randn(6, FEATURES, dtype=torch.float64)
    picked = gpipe.eval_step(x, output_fn=lambda output: output.argmax(-1))
    # The argmax of the pipeline's own output: the unwrapped model's, on the
    # whole batch, may differ in its last bits, and so in a near tie.
    assert torch.equal(picked, gpipe.eval_step(x).argmax(-1))
    with pytest.raises(ValueError, match=r'eval_step returns the loss, or the output \(or '
                                         r'output_fn of it\), not both'):
        gpipe.eval_step(x, x, F.mse_loss, output_fn=lambda output: output)
    with pytest.raises(TypeError, match=r'output_fn must be callable \(output_fn: 3\)'):
        gpipe.eval_step(x, output_fn=3)  # type: ignore[arg-type]

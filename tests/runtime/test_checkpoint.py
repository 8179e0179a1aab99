"""Checkpointing: how often it happens per mode, and what layers see while it does."""
from collections import Counter
from typing import List

import pytest
import torch
from torch import Tensor, nn

from helpers import cpu_devices
from torchgpipe import GPipe, is_checkpointing, is_recomputing
from torchgpipe.runtime.checkpoint import checkpoint, enable_checkpointing, enable_recomputing


class Probe(nn.Module):
    """Counts its calls by what is_checkpointing()/is_recomputing() say."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter = Counter()
        self.linear = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> Tensor:
        state = ('checkpointing' if is_checkpointing() else
                 'recomputing' if is_recomputing() else 'plain')
        self.calls[state] += 1
        return self.linear(x)


def counts(checkpoint: str, chunks: int, threaded: bool, *, train: bool = True,
           grad: bool = True) -> Counter:
    probe = Probe()
    gpipe = GPipe(nn.Sequential(nn.Linear(3, 3), probe), [1, 1],
                  devices=cpu_devices(2, threaded), chunks=chunks, checkpoint=checkpoint)
    gpipe.train(train)
    with torch.set_grad_enabled(grad):
        output = gpipe(torch.randn(chunks * 2, 3))
    if output.requires_grad:
        output.sum().backward()
    return probe.calls


@pytest.mark.parametrize('chunks', [1, 2, 5])
def test_checkpoint_counts_per_mode(chunks: int, threaded: bool) -> None:
    m = chunks
    assert counts('always', m, threaded) == Counter(checkpointing=m, recomputing=m)
    assert counts('except_last', m, threaded) == Counter(checkpointing=m - 1,
                                                         recomputing=m - 1, plain=1)
    assert counts('never', m, threaded) == Counter(plain=m)


def test_no_checkpointing_in_eval_mode_or_without_grad(checkpoint: str, threaded: bool) -> None:
    assert counts(checkpoint, 4, threaded, train=False) == Counter(plain=4)
    assert counts(checkpoint, 4, threaded, grad=False) == Counter(plain=4)


def test_flags_are_off_outside_and_restored() -> None:
    assert not is_checkpointing() and not is_recomputing()
    with enable_checkpointing():
        assert is_checkpointing()
        with enable_recomputing():
            assert is_recomputing()
        assert not is_recomputing()
    assert not is_checkpointing()


def test_checkpoint_function_matches_plain_autograd() -> None:
    x = torch.randn(4, 3, requires_grad=True)
    linear = nn.Linear(3, 3)
    y = checkpoint(lambda t: linear(t).tanh(), x)
    y.sum().backward()
    expected_x, expected_w = x.grad.clone(), linear.weight.grad.clone()
    x.grad = None
    linear.weight.grad = None
    linear(x).tanh().sum().backward()
    torch.testing.assert_close(x.grad, expected_x)
    torch.testing.assert_close(linear.weight.grad, expected_w)


def test_recomputation_replays_rng_and_leaves_the_generator_alone() -> None:
    draws: List[Tensor] = []

    def noisy(x: Tensor) -> Tensor:
        noise = torch.rand_like(x)
        draws.append(noise)
        return x * noise

    x = torch.ones(5, requires_grad=True)
    torch.manual_seed(3)
    y = checkpoint(noisy, x)
    after_forward = torch.get_rng_state()
    y.sum().backward()
    # The recomputation drew the same numbers, and the gradient used them.
    torch.testing.assert_close(draws[0], draws[1])
    torch.testing.assert_close(x.grad, draws[0])
    # The recomputation did not advance the caller's generator.
    assert torch.equal(torch.get_rng_state(), after_forward)


def test_checkpoint_tuple_output_with_integer_tensor() -> None:
    x = torch.randn(3, requires_grad=True)
    out, index = checkpoint(lambda t: (t * 2, torch.arange(3)), x)
    assert not index.requires_grad and out.requires_grad
    out.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


@pytest.mark.parametrize('brought_in_by', ['hook', 'attribute'])
def test_a_tensor_a_layer_reaches_besides_its_parameters_gets_its_gradient(
        brought_in_by: str, threaded: bool) -> None:
    """PyTorch's layers reach no leaf but their input and parameters, unless given a hook or
    a tensor attribute; brought in after a call without it, the recomputation reaches it
    (asked at every call), and its gradient is the unwrapped model's."""
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 3))
    gpipe = GPipe(model, [1, 2], devices=cpu_devices(2, threaded), chunks=2,
                  checkpoint='always')
    x = torch.randn(4, 3)
    gpipe(x).sum().backward()
    scale = torch.randn(3, requires_grad=True)
    if brought_in_by == 'hook':
        model[2].register_forward_hook(lambda module, input, output: output * scale)
    else:
        del model[2].bias
        model[2].bias = scale
    expected, = torch.autograd.grad(model(x).sum(), scale)
    gpipe(x).sum().backward()
    torch.testing.assert_close(scale.grad, expected)

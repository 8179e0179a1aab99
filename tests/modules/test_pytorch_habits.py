"""Drop-in means habits too: what works on the unwrapped nn.Sequential works on GPipe.

Backward twice through a retained graph, layers that change their input in
place at a partition boundary, and copies of a module that has already run
(``copy.deepcopy``, ``pickle``, ``torch.save``), on both execution paths.
"""
import copy
from typing import Callable, List

import pytest
import torch
from torch import Tensor, nn

from helpers import COPIERS, assert_same_training_step, cpu_devices, mlp, run_in_clock_order
from torchgpipe import GPipe


def mlp_with_dropout() -> nn.Sequential:
    """Linear, Tanh, Linear, Dropout, Linear, Tanh, in double precision."""
    model = mlp(6, depth=3, dtype=torch.double)
    model[3] = nn.Dropout(0.3)  # in place of the second Tanh
    return model


def test_backward_twice_through_a_retained_graph(checkpoint: str, threaded: bool) -> None:
    """The second backward recomputes again, from the same random numbers, and
    accumulates what the unwrapped model's second backward accumulates."""
    torch.manual_seed(0)
    model = mlp_with_dropout()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [2, 2, 2], devices=cpu_devices(3, threaded), chunks=3,
                  checkpoint=checkpoint)
    input = torch.randn(9, 6, dtype=torch.double)

    torch.manual_seed(1)
    expected = run_in_clock_order(reference, [2, 2, 2], input, 3).pow(2).sum()
    torch.manual_seed(1)
    actual = gpipe(input).pow(2).sum()

    for retain_graph in (True, False):
        expected.backward(retain_graph=retain_graph)
        actual.backward(retain_graph=retain_graph)
        for p, q in zip(gpipe.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def test_autograd_grad_twice_gives_the_same_gradients(checkpoint: str, threaded: bool) -> None:
    gpipe = GPipe(mlp_with_dropout(), [3, 3], devices=cpu_devices(2, threaded), chunks=2,
                  checkpoint=checkpoint)
    loss = gpipe(torch.randn(4, 6, dtype=torch.double)).sum()
    parameters = list(gpipe.parameters())
    first = torch.autograd.grad(loss, parameters, retain_graph=True)
    second = torch.autograd.grad(loss, parameters)
    for g, h in zip(first, second):
        assert torch.equal(g, h)


class Double(nn.Module):
    """Doubles its input in place: not idempotent, so running it twice on the
    same tensor (a recomputation from an overwritten input) shows."""

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2)


def inplace_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 5), nn.ReLU(inplace=True), nn.Linear(5, 5), Double(),
                         nn.Linear(5, 5), nn.ReLU(inplace=True)).double()


@pytest.mark.parametrize('balance', [[1, 2, 3], [3, 3], [1, 1, 1, 1, 1, 1]])
def test_in_place_first_layer_of_a_partition_trains_identically(
        balance: List[int], checkpoint: str, threaded: bool) -> None:
    torch.manual_seed(0)
    model = inplace_model()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, balance, devices=cpu_devices(len(balance), threaded), chunks=3,
                  checkpoint=checkpoint)
    opt = torch.optim.SGD(gpipe.parameters(), lr=0.05)
    opt_ref = torch.optim.SGD(reference.parameters(), lr=0.05)
    # Several steps: the first learns which partitions write into their input.
    for _ in range(3):
        input = torch.randn(7, 5, dtype=torch.double)
        for net, optimizer in ((reference, opt_ref), (gpipe, opt)):
            optimizer.zero_grad()
            net(input).pow(2).sum().backward()
        for p, q in zip(gpipe.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        opt.step()
        opt_ref.step()


class SometimesInPlace(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_place = False

    def forward(self, x: Tensor) -> Tensor:
        return x.mul_(2) if self.in_place else x * 2


def test_a_partition_that_starts_writing_into_its_input_is_an_error_then_works(
        threaded: bool) -> None:
    layer = SometimesInPlace()
    gpipe = GPipe(nn.Sequential(nn.Linear(3, 3), layer, nn.Linear(3, 3)), [1, 2],
                  devices=cpu_devices(2, threaded), chunks=2, checkpoint='always')
    gpipe(torch.randn(4, 3)).sum().backward()
    layer.in_place = True
    with pytest.raises(RuntimeError, match='modified its input in place'):
        gpipe(torch.randn(4, 3))

    reference = nn.Sequential(*copy.deepcopy(list(gpipe)))
    input = torch.randn(4, 3)
    gpipe.zero_grad()
    assert_close_step(gpipe, reference, input)


def assert_close_step(gpipe: nn.Module, reference: nn.Module, input: Tensor) -> None:
    gpipe(input).sum().backward()
    reference(input).sum().backward()
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize('copier', COPIERS)
def test_a_copy_after_a_forward_trains_exactly_like_the_original(
        copier: Callable[[nn.Module], nn.Module], checkpoint: str, threaded: bool) -> None:
    torch.manual_seed(0)
    gpipe = GPipe(inplace_model(), [2, 2, 2], devices=cpu_devices(3, threaded), chunks=3,
                  checkpoint=checkpoint)
    gpipe(torch.randn(6, 5, dtype=torch.double)).sum().backward()
    gpipe.zero_grad()

    clone = copier(gpipe)
    assert isinstance(clone, GPipe)
    assert clone.devices == gpipe.devices and clone.balance == gpipe.balance
    input = torch.randn(6, 5, dtype=torch.double)
    for net in (gpipe, clone):
        torch.optim.SGD(net.parameters(), lr=0.1).zero_grad()
        net(input).pow(2).sum().backward()
        torch.optim.SGD(net.parameters(), lr=0.1).step()
    for p, q in zip(gpipe.parameters(), clone.parameters()):
        assert p is not q
        assert torch.equal(p, q)
    # The copy trains on, as the original does.
    assert_same_training_step(nn.Sequential(*list(clone)),
                              lambda m: copier(gpipe), torch.randn(6, 5, dtype=torch.double))


@pytest.mark.cuda
def test_a_copy_of_a_cuda_pipeline_after_a_forward_has_its_own_streams() -> None:
    n = torch.cuda.device_count()
    gpipe = GPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(n)]), [1] * n,
                  devices=list(range(n)), chunks=2)
    gpipe(torch.randn(4, 4)).sum().backward()
    clone = copy.deepcopy(gpipe)
    assert clone.core.state.copy_streams == []
    clone(torch.randn(4, 4)).sum().backward()

"""The GPipe module's interface: validation, sequence behaviour, placement."""
import copy
import re

import pytest
import torch
from torch import nn

from torchgpipe import GPipe
from torchgpipe.gpipe import BalanceError, split_module, verify_module

CPU2 = ['cpu', 'cpu']


def model3() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))


def test_module_must_be_sequential() -> None:
    message = 'module must be nn.Sequential to be partitioned'
    with pytest.raises(TypeError, match=re.escape(message)):
        GPipe(nn.Linear(2, 2), [1], devices=['cpu'])  # type: ignore[arg-type]


def test_duplicate_children() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match='module with duplicate children is not supported'):
        GPipe(nn.Sequential(layer, layer), [1, 1], devices=CPU2)


def test_shared_parameters_across_children() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    with pytest.raises(ValueError, match='module with duplicate parameters in distinct children '
                                         'is not supported'):
        GPipe(nn.Sequential(a, b), [1, 1], devices=CPU2)


@pytest.mark.parametrize('balance, reason', [
    (None, 'balance is required'),
    ([1, 1], 'module and sum of balance have different length'),
    ([2, 2], 'module and sum of balance have different length'),
    ([3, 0], 'all balance numbers must be positive integer'),
    ([4, -1], 'all balance numbers must be positive integer'),
])
def test_bad_balance_recommends_torchgpipe_balance(balance: object, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as excinfo:
        GPipe(model3(), balance, devices=CPU2)  # type: ignore[arg-type]
    assert 'torchgpipe.balance' in str(excinfo.value)
    assert 'balance_by_time' in str(excinfo.value)


def test_missing_balance_argument() -> None:
    with pytest.raises(ValueError, match='balance is required'):
        GPipe(model3(), devices=CPU2)


@pytest.mark.parametrize('chunks', [0, -1])
def test_chunks_must_be_positive(chunks: int) -> None:
    with pytest.raises(ValueError, match='number of chunks must be positive integer'):
        GPipe(model3(), [3], devices=['cpu'], chunks=chunks)


def test_checkpoint_mode_is_validated() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "checkpoint is not one of 'always', 'except_last', or 'never'")):
        GPipe(model3(), [3], devices=['cpu'], checkpoint='sometimes')


def test_too_few_devices() -> None:
    with pytest.raises(IndexError, match='too few devices'):
        GPipe(model3(), [1, 1, 1], devices=CPU2)


@pytest.mark.skipif(torch.cuda.is_available(), reason='checks the default without CUDA')
def test_default_devices_are_cuda_devices() -> None:
    with pytest.raises(IndexError, match=r'devices: 0, partitions: 1'):
        GPipe(model3(), [3])


def test_devices_accept_strings_and_torch_devices() -> None:
    gpipe = GPipe(model3(), [1, 2], devices=['cpu', torch.device('cpu')])
    assert gpipe.devices == [torch.device('cpu')] * 2
    assert all(isinstance(d, torch.device) for d in gpipe.devices)


def test_extra_devices_are_not_used() -> None:
    gpipe = GPipe(model3(), [3], devices=['cpu', 'cpu', 'cpu'])
    assert gpipe.devices == [torch.device('cpu')]


def test_attributes() -> None:
    gpipe = GPipe(model3(), [2, 1], devices=CPU2, chunks=3, checkpoint='always')
    assert gpipe.balance == [2, 1]
    assert gpipe.chunks == 3
    assert gpipe.checkpoint == 'always'
    assert isinstance(gpipe.partitions, nn.ModuleList)
    assert all(isinstance(p, nn.Sequential) for p in gpipe.partitions)
    assert [len(p) for p in gpipe.partitions] == [2, 1]
    # No attribute fallthrough to the wrapped children.
    with pytest.raises(AttributeError):
        gpipe.weight  # noqa: B018


def test_parameter_names() -> None:
    gpipe = GPipe(model3(), [2, 1], devices=CPU2)
    assert [name for name, _ in gpipe.named_parameters()] == [
        'partitions.0.0.weight', 'partitions.0.0.bias',
        'partitions.1.2.weight', 'partitions.1.2.bias',
    ]


def test_state_dict_round_trip() -> None:
    gpipe = GPipe(model3(), [2, 1], devices=CPU2)
    other = GPipe(model3(), [2, 1], devices=CPU2)
    other.load_state_dict(gpipe.state_dict())
    x = torch.randn(3, 2)
    torch.testing.assert_close(other(x), gpipe(x))


def test_sequence_behaviour() -> None:
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh()]
    gpipe = GPipe(nn.Sequential(*layers), [1, 2, 1], devices=['cpu'] * 3)
    assert len(gpipe) == 4
    assert list(gpipe) == layers
    for index in range(-4, 4):
        assert gpipe[index] is layers[index]
    for index in (4, -5):
        with pytest.raises(IndexError):
            gpipe[index]


def test_moving_is_denied_but_casting_works() -> None:
    gpipe = GPipe(model3(), [2, 1], devices=CPU2)
    for move in (lambda: gpipe.cuda(), lambda: gpipe.cpu(), lambda: gpipe.to('cpu'),
                 lambda: gpipe.to(torch.device('cpu')), lambda: gpipe.to(0),
                 lambda: gpipe.to(torch.zeros(1)), lambda: gpipe.to(device='cpu'),
                 lambda: gpipe.to('cpu', torch.double)):
        with pytest.raises(TypeError, match='denied to move parameters and buffers'):
            move()
    assert gpipe.to(torch.double) is gpipe
    assert all(p.dtype == torch.double for p in gpipe.parameters())
    assert gpipe.to(dtype=torch.float).partitions[0][0].weight.dtype == torch.float


def test_input_must_be_tensor_or_tuple_of_tensors() -> None:
    gpipe = GPipe(model3(), [2, 1], devices=CPU2, chunks=2)
    for bad in ([torch.zeros(2, 2)], 'text', None, (torch.zeros(2, 2), 1.0), {'x': 1}):
        with pytest.raises(TypeError, match='input must be a tensor or a tuple of tensors'):
            gpipe(bad)  # type: ignore[arg-type]


def test_tuple_tensors_must_split_alike() -> None:
    class Take(nn.Module):
        def forward(self, pair: tuple) -> torch.Tensor:
            return pair[0]

    gpipe = GPipe(nn.Sequential(Take()), [1], devices=['cpu'], chunks=2)
    with pytest.raises(ValueError, match='different numbers of micro-batches'):
        gpipe((torch.zeros(4, 1), torch.zeros(1, 1)))
    with pytest.raises(ValueError, match='batch dimension'):
        gpipe(torch.tensor(1.0))


def test_empty_sequential_is_identity() -> None:
    gpipe = GPipe(nn.Sequential(), [], devices=[])
    x = torch.randn(2, 2)
    assert gpipe(x) is x


def test_verify_module_and_split_module_directly() -> None:
    verify_module(model3())
    partitions, balance, devices = split_module(model3(), [1, 2], [torch.device('cpu')] * 3)
    assert balance == [1, 2] and devices == [torch.device('cpu')] * 2
    assert [list(p._modules) for p in partitions] == [['0'], ['1', '2']]
    with pytest.raises(BalanceError):
        split_module(model3(), [1, 1], [torch.device('cpu')] * 2)
    assert issubclass(BalanceError, ValueError)


def test_partitions_hold_the_original_layers() -> None:
    model = model3()
    layers = list(model)
    gpipe = GPipe(model, [1, 2], devices=CPU2)
    assert list(gpipe) == layers
    assert [p for p in gpipe.parameters()] == [p for p in model.parameters()]
    assert copy.deepcopy(gpipe)(torch.zeros(1, 2)).shape == (1, 2)

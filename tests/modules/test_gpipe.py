"""The GPipe module's interface: validation, sequence behaviour, placement."""
import ast
import copy
import re
import sys
from typing import Any, Callable, Generator

import pytest
import torch
from torch import nn
from torch.nn.parameter import UninitializedTensorMixin

from helpers import cpu_devices
import torchgpipe
from torchgpipe import GPipe, NoChunk, to_sequential
from torchgpipe.balance import balance_by_size, balance_by_time
from torchgpipe.gpipe import BalanceError, split_module, verify_module
from torchgpipe.runtime.batchnorm import DeferredBatchNorm
from torchgpipe.skip import skippable, stash

CPU2 = ['cpu', 'cpu']


def model3() -> nn.Sequential:
    return nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))


def test_module_must_be_sequential() -> None:
    message = 'module must be nn.Sequential to be partitioned'
    with pytest.raises(TypeError, match=re.escape(message)) as caught:
        GPipe(nn.Linear(2, 2), [1], devices=['cpu'])  # type: ignore[arg-type]
    # The fix rides in a note, where Python has them: str() stays 0.0.7's.
    assert str(caught.value) == message
    if sys.version_info >= (3, 11):
        assert caught.value.__notes__ == [
            '(module: Linear) flatten it first with torchgpipe.to_sequential(module), or '
            'write its layers as an nn.Sequential; see "module must be nn.Sequential" in '
            "the documentation's troubleshooting page"]


def test_duplicate_children() -> None:
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match='module with duplicate children is not supported'):
        GPipe(nn.Sequential(layer, layer), [1, 1], devices=CPU2)


def test_shared_parameters_across_children() -> None:
    """Tied weights are supported (tests/foundation/test_tied.py): 0.0.7's error is gone."""
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight
    gpipe = GPipe(nn.Sequential(a, b), [1, 1], devices=CPU2)
    assert gpipe[1].weight is gpipe[0].weight
    assert len(list(gpipe.parameters())) == 3


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
    for bad in ([torch.zeros(2, 2)], 'text', None, (torch.zeros(2, 2), [1.0]), {'x': 1}):
        with pytest.raises(TypeError, match='input must be a tensor or a tuple of tensors'):
            gpipe(bad)  # type: ignore[arg-type]


EMPTY_INPUTS = {
    'tensor': torch.randn(4, 2),
    '0-dim tensor': torch.tensor(42.0),  # 0.0.7's own test
    'tuple': (torch.randn(4, 2), torch.randn(3, 1)),
    'tuple of a 0-dim tensor': (torch.tensor(42.0),),
    'tuple of other values': (torch.tensor(1.0), None, 0.5, 'text', True),
    'empty tuple': (),
}


@pytest.mark.parametrize('input', EMPTY_INPUTS.values(), ids=list(EMPTY_INPUTS))
def test_empty_sequential_returns_its_input_unchanged(input: Any) -> None:
    # chunks=4: nothing is split, so inputs that cannot be come back too.
    gpipe = GPipe(nn.Sequential(), [], chunks=4)
    output = gpipe(input)
    if isinstance(input, torch.Tensor):
        assert output is input
    else:
        assert type(output) is tuple and len(output) == len(input)
        assert all(a is b for a, b in zip(output, input))


def test_empty_sequential_unwraps_nochunk_and_refuses_what_gpipe_refuses() -> None:
    gpipe = GPipe(nn.Sequential(), [], devices=[])
    x, mask = torch.randn(4, 2), torch.ones(2)
    output = gpipe((x, NoChunk(mask)))
    assert output[0] is x and output[1] is mask  # what a layer would receive
    # Only a tensor or a tuple is an input, with layers or without (as in 0.0.7).
    for bad in (42, None, [x]):
        with pytest.raises(TypeError, match='input must be a tensor or a tuple of tensors'):
            gpipe(bad)


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


# ---------------------------------------------------------------------------
# A failed constructor leaves the user's module untouched


def batchnorm_model() -> nn.Sequential:
    """Five children, BatchNorm layers at the top level and nested, mixed training flags."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(),
                          nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(4, 2))
    model[3].eval()
    # Non-default statistics, so that a reset would show.
    model(torch.randn(6, 4))
    return model


def with_layer(layer: nn.Module) -> Callable[[nn.Sequential], nn.Sequential]:
    def extend(model: nn.Sequential) -> nn.Sequential:
        model.append(layer)
        return model
    return extend


@skippable(stash=['never_popped'])
class StashOnly(nn.Module):
    def forward(self, x: torch.Tensor) -> Generator[object, None, torch.Tensor]:
        yield stash('never_popped', x)
        return x


# A CUDA device that cannot be used here: none without CUDA, one past the last with it.
MISSING_CUDA = f'cuda:{torch.cuda.device_count()}'

# (how to change the model, constructor arguments, expected error). The 'meta'
# devices show a partition moved before a later one fails: moving to the CPU
# would change nothing visible on this machine.
CONSTRUCTOR_ERRORS = [
    pytest.param(None, dict(balance=[2, 2]), ValueError, id='balance-sum'),
    pytest.param(None, dict(balance=[5, 0]), ValueError, id='balance-zero'),
    pytest.param(None, dict(balance=[3, -1, 3], devices=['meta'] * 3), ValueError,
                 id='balance-negative'),
    pytest.param(None, dict(balance=[2, 3.5], devices=['meta'] * 2), TypeError,
                 id='balance-float-entry'),
    pytest.param(None, dict(balance=[2.5, 2.5]), TypeError, id='balance-floats'),
    pytest.param(None, dict(balance='23'), TypeError, id='balance-string'),
    pytest.param(None, dict(balance=5), TypeError, id='balance-int'),
    pytest.param(None, dict(balance=None), ValueError, id='balance-missing'),
    pytest.param(None, dict(balance=[2, 3], devices=['meta']), IndexError, id='too-few-devices'),
    pytest.param(None, dict(devices='cpu'), TypeError, id='devices-string'),
    pytest.param(None, dict(devices=torch.device('cpu')), TypeError, id='devices-device'),
    pytest.param(None, dict(devices=['meta', 'gpu']), ValueError, id='devices-invalid'),
    pytest.param(None, dict(devices=['meta', 1.5]), TypeError, id='devices-float'),
    pytest.param(None, dict(devices=['meta', MISSING_CUDA]), ValueError, id='devices-missing'),
    pytest.param(None, dict(chunks=0), ValueError, id='chunks-zero'),
    pytest.param(None, dict(chunks=1.5), ValueError, id='chunks-float'),
    pytest.param(None, dict(chunks='2'), TypeError, id='chunks-string'),
    pytest.param(None, dict(checkpoint='sometimes'), ValueError, id='checkpoint'),
    pytest.param(with_layer(nn.LazyBatchNorm1d()), dict(balance=[3, 3], devices=['meta'] * 2),
                 ValueError, id='lazy-batchnorm'),
    pytest.param(with_layer(StashOnly()), dict(balance=[3, 3]), TypeError, id='skippables'),
    # Refused before the BatchNorm layers of the first partition are replaced.
    pytest.param(with_layer(nn.Linear(2, 2, device='meta')),
                 dict(balance=[3, 3], devices=['cpu', 'cpu']), ValueError, id='meta-layer'),
    pytest.param(lambda model: model.append(model[0]), dict(balance=[3, 3]), ValueError,
                 id='duplicate-children'),
]


def snapshot(model: nn.Module) -> list:
    """Every submodule (name, identity, class, training flag), then every
    parameter and buffer (name, identity, device, dtype, requires_grad, a copy
    of the values; none for an uninitialized lazy tensor or one on the meta device)."""
    modules = [(name, id(m), type(m), m.training) for name, m in model.named_modules()]
    tensors = [(name, id(t), t.device, t.dtype, t.requires_grad,
                None if isinstance(t, UninitializedTensorMixin) or t.is_meta
                else t.detach().clone())
               for name, t in [*model.named_parameters(), *model.named_buffers()]]
    return [modules, tensors]


def assert_same_snapshot(actual: list, expected: list) -> None:
    assert actual[0] == expected[0]
    assert [t[:5] for t in actual[1]] == [t[:5] for t in expected[1]]
    for a, e in zip(actual[1], expected[1]):
        assert (a[5] is None and e[5] is None) or torch.equal(a[5], e[5]), a[0]


@pytest.mark.parametrize('change, arguments, error', CONSTRUCTOR_ERRORS)
def test_failed_constructor_leaves_module_untouched(change: Any, arguments: dict,
                                                   error: type) -> None:
    model = batchnorm_model()
    if change is not None:
        change(model)
    before = snapshot(model)

    kwargs: dict = dict(balance=[2, 3], devices=['meta', 'meta'], deferred_batch_norm=True)
    kwargs.update(arguments)
    with pytest.raises(error):
        GPipe(model, kwargs.pop('balance'), **kwargs)

    assert_same_snapshot(snapshot(model), before)


def test_a_model_on_the_meta_device_is_refused_with_the_fix() -> None:
    """Wherever its layers would be placed or measured, before anything changes."""
    with torch.device('meta'):
        model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2))
    sample = torch.randn(4, 2)
    calls = [lambda: GPipe(model, [2, 1], devices=CPU2),
             lambda: split_module(model, [2, 1], [torch.device('cpu')] * 2),
             lambda: balance_by_time(2, model, sample, device='cpu'),
             lambda: balance_by_size(2, model, sample, device='cpu'),
             lambda: torchgpipe.plan(model, sample, devices=['cpu:0', 'cpu:1'])]
    for call in calls:
        with pytest.raises(ValueError) as caught:
            call()
        assert str(caught.value) == (
            "the layers must hold data to be placed on a device ('0.weight' on the meta "
            'device); materialize it first: model.to_empty(device=...), then initialize it '
            '(reset_parameters() or load_state_dict()), or build it on a real device')
    # Shapes alone are enough where nothing is placed elsewhere; a step says what to change.
    shapes = GPipe(model, [2, 1], devices=['meta'] * 2, chunks=2)
    assert shapes[0].weight.is_meta
    with pytest.raises(ValueError) as caught:
        shapes.train_step(sample, sample, nn.functional.mse_loss)
    assert str(caught.value) == (
        "the layers must hold data to run a step ('0.weight' on the meta device); place the "
        'pipeline on real devices: build the GPipe from layers holding data, with '
        'devices=[...] (the meta device is for shapes alone)')


def test_successful_constructor_on_the_same_model() -> None:
    # The failures above are the arguments', not the model's.
    model = batchnorm_model()
    gpipe = GPipe(model, [2, 3], devices=['meta', 'meta'], deferred_batch_norm=True)
    assert isinstance(model[1], DeferredBatchNorm)
    assert all(p.device.type == 'meta' for p in gpipe.parameters())


# ---------------------------------------------------------------------------
# Error messages name the parameter, the value received and the fix


def suggested(name: str, message: str) -> Any:
    """The value the message suggests for ``name``, from ``name=<literal>``."""
    match = re.search(rf'\b{name}=(\[[^\]]*\])', message)
    assert match, f'no correct {name}=... in: {message}'
    return ast.literal_eval(match.group(1))


@pytest.mark.parametrize('balance', [[1.5, 1.5], [2.0, 1.5], '21', 3, [True, 2], [1, None]])
def test_balance_of_the_wrong_type_shows_a_correct_call(balance: object) -> None:
    with pytest.raises(TypeError, match=r'^balance must be a list of ints') as excinfo:
        GPipe(model3(), balance, devices=CPU2)  # type: ignore[arg-type]
    message = str(excinfo.value)
    assert f'(balance: {balance!r})' in message
    # The call the message shows works.
    GPipe(model3(), suggested('balance', message), devices=CPU2)


@pytest.mark.parametrize('devices', ['cpu', torch.device('cpu'), 'cpu:0'])
def test_a_single_device_shows_a_correct_call(devices: object) -> None:
    with pytest.raises(TypeError, match=r'^devices must be a list of devices') as excinfo:
        GPipe(model3(), [2, 1], devices=devices)  # type: ignore[arg-type]
    message = str(excinfo.value)
    assert f'(devices: {devices!r})' in message
    gpipe = GPipe(model3(), [2, 1], devices=suggested('devices', message))
    assert gpipe.devices == [torch.device(devices)] * 2  # type: ignore[arg-type]


@pytest.mark.parametrize('devices', ['gpu', 3.5, True])
def test_devices_that_are_no_list_suggest_cpu_devices(devices: object) -> None:
    with pytest.raises(TypeError, match=r'^devices must be a list of devices') as excinfo:
        GPipe(model3(), [2, 1], devices=devices)  # type: ignore[arg-type]
    assert suggested('devices', str(excinfo.value)) == CPU2


@pytest.mark.parametrize('balance, devices', [([1, 1, 1], CPU2), ([2, 1], [])])
def test_too_few_devices_shows_a_correct_call(balance: list, devices: list) -> None:
    with pytest.raises(IndexError, match='^too few devices to hold given partitions') as excinfo:
        GPipe(model3(), balance, devices=devices)
    GPipe(model3(), balance, devices=suggested('devices', str(excinfo.value)))


@pytest.mark.parametrize('balance', [None, [1, 1], [4, -1], [3, 0]])
def test_wrong_balance_values_show_a_correct_call(balance: object) -> None:
    with pytest.raises(ValueError) as excinfo:
        GPipe(model3(), balance, devices=CPU2)  # type: ignore[arg-type]
    message = str(excinfo.value)
    assert f'(balance: {balance!r})' in message or f'sum of balance: {sum(balance)}' in message
    GPipe(model3(), suggested('balance', message), devices=CPU2)


@pytest.mark.parametrize('arguments, received', [
    (dict(chunks=0), '(chunks: 0)'),
    (dict(chunks=-1), '(chunks: -1)'),
    (dict(chunks=1.5), '(chunks: 1.5)'),
    (dict(chunks='2'), "(chunks: '2')"),
    (dict(chunks=True), '(chunks: True)'),
    (dict(devices=['cpu', 'gpu']), "(devices[1]: 'gpu')"),
    (dict(devices=['cpu', None]), '(devices[1]: None)'),
])
def test_constructor_messages_name_the_value_and_the_fix(arguments: dict, received: str) -> None:
    with pytest.raises((TypeError, ValueError)) as excinfo:
        GPipe(model3(), [2, 1], **{'devices': CPU2, **arguments})
    message = str(excinfo.value)
    assert received in message
    # The fix follows the value: a correct argument to copy.
    name = next(iter(arguments))
    assert re.search(rf'\); .*\b{name}=', message), message


def test_messages_users_match_on_stay_word_for_word() -> None:
    """torchgpipe 0.0.7's messages for the module and checkpoint are matched on
    whole by users' scripts; their fixes are on the troubleshooting page (and,
    for the first, in a note that str() leaves out)."""
    with pytest.raises(TypeError) as caught:
        GPipe(nn.ModuleList([nn.ReLU()]), [1], devices=['cpu'])  # type: ignore[arg-type]
    assert str(caught.value) == 'module must be nn.Sequential to be partitioned'
    layer = nn.Linear(2, 2)
    with pytest.raises(ValueError, match='^module with duplicate children is not supported$'):
        GPipe(nn.Sequential(layer, nn.ReLU(), layer), [1, 2], devices=CPU2)
    for checkpoint in ('sometimes', None):
        with pytest.raises(ValueError, match="^checkpoint is not one of 'always', "
                                             "'except_last', or 'never'$"):
            GPipe(model3(), [2, 1], devices=CPU2, checkpoint=checkpoint)  # type: ignore[arg-type]


@pytest.mark.parametrize('chunks, error', [
    (0, ValueError), (-3, ValueError), (1.5, ValueError), (2.0 ** 0.5, ValueError),
    (True, TypeError), ('2', TypeError), (None, TypeError),
])
def test_chunks_policy(chunks: object, error: type) -> None:
    # A wrong type is a TypeError, a wrong value a ValueError; non-integral
    # numbers are a ValueError (integral ones such as 2.0 are taken as ints,
    # as in torchgpipe 0.0.7: see test_compat.py).
    with pytest.raises(error, match='chunks'):
        GPipe(model3(), [3], devices=['cpu'], chunks=chunks)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Inputs that cannot be split are refused before any layer runs


class CountCalls(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, input: Any) -> Any:
        self.calls += 1
        return input


@pytest.mark.parametrize('threaded', [False, True])
@pytest.mark.parametrize('chunks', [1, 2, 4])
@pytest.mark.parametrize('input, error, message', [
    # 8 and 7 rows split into as many micro-batches for every chunks above.
    ((torch.zeros(8, 1), torch.zeros(7, 1)), ValueError,
     'tensors of the input tuple must have the same size in dimension 0 '
     '(input: sizes [8, 7] in dimension 0); '),
    ((torch.zeros(8, 1), torch.zeros(2, 1)), ValueError, '(input: sizes [8, 2] in dimension 0)'),
    ((), ValueError, 'input must hold at least one tensor to be split into micro-batches '
                     '(input: ()); '),
    (torch.tensor(1.0), ValueError, '(input: a 0-dimensional tensor); '),
    ((torch.zeros(8, 1), torch.tensor(1.0)), ValueError, '(input[1]: a 0-dimensional tensor)'),
    ([torch.zeros(8, 1)], TypeError, '(input: list); '),
    ((torch.zeros(8, 1), [1.0]), TypeError, '(input: a tuple holding list at index 1); '),
])
def test_unsplittable_input_is_refused_before_any_layer_runs(
        input: Any, error: type, message: str, chunks: int, threaded: bool) -> None:
    counter = CountCalls()
    devices = ['cpu:0', 'cpu:1'] if threaded else CPU2
    gpipe = GPipe(nn.Sequential(CountCalls(), counter), [1, 1], devices=devices, chunks=chunks)
    with pytest.raises(error, match=re.escape(message)):
        gpipe(input)
    assert gpipe[0].calls == counter.calls == 0


@pytest.mark.parametrize('style', ['gpipe', 'plain'])
def test_load_state_dict_goes_through_the_classes_between_gpipe_and_module(style: str) -> None:
    loads = []

    class Logging(nn.Module):
        def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
            loads.append(style)
            return super().load_state_dict(*args, **kwargs)

    class Logged(GPipe, Logging):
        pass

    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    gpipe = Logged(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), balance=[1, 1],
                   devices=['cpu', 'cpu'])
    state = model.state_dict() if style == 'plain' else \
        GPipe(model, balance=[1, 1], devices=['cpu', 'cpu']).state_dict()
    gpipe.load_state_dict(state)
    assert loads == [style]
    torch.testing.assert_close(gpipe[1].weight, model[1].weight)


# ---------------------------------------------------------------------------
# Placement never replaces a tensor the user holds


def tensors_and_grads(model: nn.Module) -> list:
    """Every parameter, gradient and buffer, with the address of its data."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers()]
    return [(t, t.data_ptr()) for t in tensors]


def test_placement_keeps_every_parameter_and_buffer(threaded: bool) -> None:
    """Every CPU device ('cpu', 'cpu:0', 'cpu:1', ...) is the one CPU memory:
    nothing is copied, so every tensor is the object it was, with its data."""
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.ReLU(),
                          nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model(torch.randn(5, 3)).sum().backward()  # gradients and statistics to keep
    before = tensors_and_grads(model)

    gpipe = GPipe(model, [2, 2, 2], devices=cpu_devices(3, threaded))

    after = tensors_and_grads(model)
    assert all(a is b and a_ptr == b_ptr for (a, a_ptr), (b, b_ptr) in zip(after, before))
    assert all(a is b for (a, _), (b, _) in zip(tensors_and_grads(gpipe), before))


class AddShift(nn.Module):
    """Adds a buffer it shares with another module (not in its state dict)."""

    def __init__(self, shift: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer('shift', shift, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shift


class Shifted(nn.Module):
    """A model whose buffer is held by a layer of its pipeline too."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer('shift', torch.zeros(4))
        self.body = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), AddShift(self.shift),
                                  nn.Linear(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def changed_state(model: nn.Module) -> dict:
    return {key: torch.randn_like(value) for key, value in model.state_dict().items()}


def test_loading_the_original_after_wrapping_reaches_the_pipeline(threaded: bool) -> None:
    model = Shifted()
    gpipe = GPipe(model.body, [2, 2], devices=cpu_devices(2, threaded), chunks=2)
    assert gpipe[2].shift is model.shift

    model.load_state_dict(changed_state(model))
    x = torch.randn(6, 4)
    # Exact against the original run on the same micro-batches: on the whole
    # batch, the CPU's matrix kernels may round 6 rows otherwise than 3.
    expected = torch.cat([model(micro_batch) for micro_batch in x.chunk(2)])
    torch.testing.assert_close(gpipe(x), expected, rtol=0, atol=0)


class GlueShift(nn.Module):
    """A buffer read by code between layers: to_sequential's generated child holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)
        self.fc3 = nn.Linear(4, 4)
        self.register_buffer('shift', torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(torch.tanh(self.fc2(self.fc1(x) + self.shift)))


@pytest.mark.parametrize('cut', [1, 2, 3])
def test_loading_the_original_reaches_a_generated_child(cut: int, threaded: bool) -> None:
    """A checkpoint loaded into the original model after wrapping its
    flattened sequential changes the pipeline as it changes the original,
    wherever the balance cuts."""
    model = GlueShift()
    seq = to_sequential(model)
    balance = [cut, len(seq) - cut]
    gpipe = GPipe(seq, balance, devices=cpu_devices(2, threaded), chunks=3)
    x = torch.randn(6, 4)
    torch.testing.assert_close(gpipe(x), model(x))

    model.load_state_dict(changed_state(model))
    torch.testing.assert_close(gpipe(x), model(x))


def test_a_tensor_that_moves_keeps_its_object(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor in another memory than its partition's device (CPU to CUDA)
    moves in place: every module holding it sees it moved. Here a copy to
    'cpu:1' stands in for a move, by denying that CPU devices share memory."""
    from torchgpipe.foundation import placement
    monkeypatch.setattr(placement, 'same_memory', lambda a, b: False)

    model = Shifted()
    model.body(torch.randn(2, 4)).sum().backward()
    before = tensors_and_grads(model)
    values = [t.clone() for t, _ in before]

    placement.place(model.body, torch.device('cpu:1'))

    after = tensors_and_grads(model)
    assert all(a is b for (a, _), (b, _) in zip(after, before))
    assert all(a_ptr != b_ptr for (_, a_ptr), (_, b_ptr) in zip(after, before))
    assert all(torch.equal(t, v) for (t, _), v in zip(after, values))
    assert model.body[2].shift is model.shift
    assert model.body[0].weight.grad is before[0][0].grad

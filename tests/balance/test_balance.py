"""Automatic balancing: profiling by time and by size, and the balances it yields.

Time-based expectations use layers that sleep for known times, with optimal
partitions whose bottleneck beats every other partition's by a whole sleeping
layer. The balances expected of them are computed on a virtual clock, which
only the sleeping layers move: on a loaded machine, a real sleep overruns by
more than a layer now and then. How profile_times reads real time is tested
on its own, with bounds that oversleeping cannot break. Size-based
expectations on CPU are exact: the bytes are counted, not sampled.
"""
import importlib
import math
import re
import sys
import time
from typing import Any, ClassVar, Generator, Iterator, List, Sequence, Tuple

import pytest
import torch
from torch import Tensor, nn

from torchgpipe import GPipe
from torchgpipe.balance import balance_by_size, balance_by_time, profile, timing
from torchgpipe.balance.profile import layerwise_sandbox, profile_sizes, profile_times
from torchgpipe.skip import Namespace, pop, skippable, stash

CPU = torch.device('cpu')
FLOAT = 4  # bytes per float32


class VirtualClock:
    """Time that passes only as layers sleep: a layer's sleep adds its
    seconds at once, and the profiler reads the sum as ``time.perf_counter``."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def virtual_clock(monkeypatch: pytest.MonkeyPatch) -> VirtualClock:
    """The profiler and the sleeping layers of this module on a :class:`VirtualClock`.

    A balance by time then depends on the layers' sleeps alone, on any
    machine: without it, one wake-up late by 10 ms (two cores, other jobs
    beside) moves the balance of a test whose margin is 10 ms.
    """
    clock = VirtualClock()
    monkeypatch.setattr(profile, 'time', clock)
    monkeypatch.setattr(timing, 'time', clock)
    monkeypatch.setattr(sys.modules[__name__], 'time', clock)
    return clock


class Sleep(nn.Module):
    """Sleeps a known time; its parameter makes the backward pass run."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(self.seconds)
        return x * self.weight


class SleepTuple(nn.Module):
    """Like :class:`Sleep` on a tuple (float tensor, integer tensor); a tensor
    input becomes such a tuple."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds
        self.weight = nn.Parameter(torch.ones(()))

    def forward(self, input: Any) -> Tuple[Tensor, Tensor]:
        time.sleep(self.seconds)
        if isinstance(input, Tensor):
            return input * self.weight, torch.arange(input.size(0))
        x, index = input
        return x * self.weight, index + 1


@skippable(stash=['skip'])
class StashSleep(Sleep):
    def forward(self, x: Tensor) -> Iterator[Any]:  # type: ignore[override]
        time.sleep(self.seconds)
        y = x * self.weight
        yield stash('skip', y)
        return y


@skippable(pop=['skip'])
class PopSleep(Sleep):
    def forward(self, x: Tensor) -> Iterator[Any]:  # type: ignore[override]
        time.sleep(self.seconds)
        skip = yield pop('skip')
        return x * self.weight + skip


@skippable(stash=['nothing'])
class StashNone(nn.Module):
    def forward(self, x: Tensor) -> Iterator[Any]:
        yield stash('nothing', None)
        return x * 2


@skippable(pop=['nothing'])
class PopNone(nn.Module):
    def forward(self, x: Tensor) -> Iterator[Any]:
        nothing = yield pop('nothing')
        assert nothing is None
        return x * 2


class Latent(nn.Module):
    """No parameters, big activations: saves a 16-times wider tensor."""

    def forward(self, x: Tensor) -> Tensor:
        wide = x.repeat(1, 16).exp()
        return wide.view(x.size(0), 16, -1).mean(1)


class Bulky(nn.Module):
    """Many parameters, small activations."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight[0]


class Scale(nn.Module):
    """One parameter per feature: as many parameter bytes as output bytes
    for a batch of one."""

    def __init__(self, features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(features))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight


class Double(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x * 2


class Record(nn.Module):
    """Records the sum of every input it sees (in a class attribute, which
    the profiler's deep copies share)."""

    seen: ClassVar[List[float]] = []

    def forward(self, x: Tensor) -> Tensor:
        Record.seen.append(x.sum().item())
        return x


class Explode(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        raise AssertionError('profiling must not start')


def assert_valid_balance(balance: Sequence[int], model: nn.Sequential, partitions: int,
                         sample: Any) -> None:
    """The balance is a list of positive ints summing to the number of layers,
    one per partition, and GPipe runs with it."""
    assert isinstance(balance, list) and all(type(b) is int for b in balance)
    assert len(balance) == partitions
    assert sum(balance) == len(model)
    assert all(b > 0 for b in balance)
    gpipe = GPipe(model, balance, devices=['cpu'] * partitions, chunks=2)
    gpipe(sample)


# ---------------------------------------------------------------------------
# balance_by_time


@pytest.mark.usefixtures('virtual_clock')
def test_balance_by_time_isolates_the_slow_layer() -> None:
    # Every partition but [2, 1, 2] puts 10 ms next to the 40 ms layer.
    model = nn.Sequential(Sleep(0.01), Sleep(0.01), Sleep(0.04), Sleep(0.01), Sleep(0.01))
    sample = torch.rand(4, 4)
    balance = balance_by_time(3, model, sample, timeout=0.05, device='cpu')
    assert balance == [2, 1, 2]
    assert_valid_balance(balance, model, 3, sample)


@pytest.mark.usefixtures('virtual_clock')
def test_balance_by_time_evens_out() -> None:
    # [40 20 | 20 20 20] is 60/60 ms; any other split has an 80 ms side.
    model = nn.Sequential(Sleep(0.04), Sleep(0.02), Sleep(0.02), Sleep(0.02), Sleep(0.02))
    balance = balance_by_time(2, model, torch.rand(4, 4), timeout=0.05, device=CPU)
    assert balance == [2, 3]


def test_profile_times_measures_every_layer() -> None:
    model = nn.Sequential(Sleep(0.01), Sleep(0.02))
    times = profile_times(model, torch.rand(2, 2), timeout=0, device=CPU)
    assert all(type(t) is int for t in times)
    # At least one timed pass, each layer sleeping at least its time.
    assert times[0] >= 10_000 and times[1] >= 20_000


def test_profile_times_repeats_passes_until_timeout() -> None:
    Record.seen.clear()
    model = nn.Sequential(Sleep(0.005), Record())
    started = time.perf_counter()
    profile_times(model, torch.ones(1), timeout=0.1, device=CPU)
    assert time.perf_counter() - started >= 0.1
    # A warm-up pass and at least one timed pass per 5 ms of sleep.
    assert len(Record.seen) >= 2
    assert len(Record.seen) <= 0.1 / 0.005 + 2


def test_every_pass_starts_from_the_sample() -> None:
    Record.seen.clear()
    model = nn.Sequential(Double(), Double(), Record())
    profile_times(model, torch.ones(2), timeout=0.02, device=CPU)
    assert len(Record.seen) >= 2
    assert Record.seen == [8.0] * len(Record.seen)


@pytest.mark.usefixtures('virtual_clock')
def test_tuples_between_layers() -> None:
    model = nn.Sequential(SleepTuple(0.01), SleepTuple(0.01), SleepTuple(0.04),
                          SleepTuple(0.01), SleepTuple(0.01))
    sample = torch.rand(4, 4)
    balance = balance_by_time(3, model, sample, timeout=0.05, device='cpu')
    assert balance == [2, 1, 2]
    assert_valid_balance(balance, model, 3, sample)

    sizes = profile_sizes(model, sample, chunks=1, param_scale=2.0, device=CPU)
    # The float output, the integer output, and the (scalar) parameter twice.
    assert sizes[0] == 4 * 4 * FLOAT + 4 * 8 + 2 * FLOAT


@pytest.mark.usefixtures('virtual_clock')
def test_skippable_layers() -> None:
    model = nn.Sequential(StashSleep(0.01), Sleep(0.01), Sleep(0.04), Sleep(0.01),
                          PopSleep(0.01))
    sample = torch.rand(4, 4)
    balance = balance_by_time(3, model, sample, timeout=0.05, device='cpu')
    assert balance == [2, 1, 2]
    assert_valid_balance(balance, model, 3, sample)

    balance = balance_by_size(2, model, sample, device='cpu')
    assert_valid_balance(balance, model, 2, sample)


def test_skippable_layers_in_namespaces() -> None:
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(StashSleep(0).isolate(ns1), StashSleep(0).isolate(ns2),
                          PopSleep(0).isolate(ns2), PopSleep(0).isolate(ns1))
    sample = torch.rand(4, 4)
    assert_valid_balance(balance_by_time(2, model, sample, timeout=0, device='cpu'),
                         model, 2, sample)
    assert_valid_balance(balance_by_size(2, model, sample, device='cpu'), model, 2, sample)


def test_skipping_none() -> None:
    model = nn.Sequential(StashNone(), Double(), PopNone())
    sample = torch.rand(4, 4)
    assert_valid_balance(balance_by_time(2, model, sample, timeout=0, device='cpu'),
                         model, 2, sample)
    assert profile_sizes(model, sample, 1, 2.0, CPU) == [4 * 4 * FLOAT] * 3


def test_tuple_sample() -> None:
    model = nn.Sequential(SleepTuple(0), SleepTuple(0), SleepTuple(0))
    sample = (torch.rand(4, 4), torch.arange(4))
    assert_valid_balance(balance_by_time(2, model, sample, timeout=0, device='cpu'),
                         model, 2, sample)
    assert_valid_balance(balance_by_size(2, model, sample, chunks=2, device='cpu'),
                         model, 2, sample)


# ---------------------------------------------------------------------------
# balance_by_size


def test_profile_sizes_counts_activations_and_parameters() -> None:
    model = nn.Sequential(nn.Linear(10, 100), nn.ReLU(), nn.Linear(100, 10))
    # 8 samples in 2 micro-batches: 4 per micro-batch.
    sizes = profile_sizes(model, torch.rand(8, 10), chunks=2, param_scale=2.0, device=CPU)
    assert sizes == [
        4 * 100 * FLOAT + 2 * (10 * 100 + 100) * FLOAT,  # output, weight and bias twice
        4 * 100 * FLOAT,  # the output, which ReLU also saves
        4 * 10 * FLOAT + 2 * (100 * 10 + 10) * FLOAT,
    ]


def test_profile_sizes_takes_the_largest_micro_batch() -> None:
    model = nn.Sequential(Double())
    # torch.chunk splits 10 into 3, 3, 3, 1: GPipe's largest micro-batch is 3.
    assert profile_sizes(model, torch.rand(10, 5), 4, 2.0, CPU) == [3 * 5 * FLOAT]
    # More chunks than samples: micro-batches of one.
    assert profile_sizes(model, torch.rand(2, 5), 8, 2.0, CPU) == [1 * 5 * FLOAT]


def latent_and_parameter_heavy_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(16, 16), Bulky(20_000), nn.Linear(16, 16), Latent(),
                         nn.Linear(16, 16))


def test_latent_heavy_batch() -> None:
    model = latent_and_parameter_heavy_model()
    input = torch.rand(1024, 16)
    sizes = profile_sizes(model, input, chunks=4, param_scale=2.0, device=CPU)
    assert max(range(5), key=sizes.__getitem__) == 3  # Latent
    assert sizes[3] == 256 * 16 * 16 * FLOAT + 256 * 16 * FLOAT
    balance = balance_by_size(2, model, input, chunks=4, device='cpu')
    assert balance == [3, 2]
    assert_valid_balance(balance, model, 2, input)


def test_parameter_heavy_batch() -> None:
    model = latent_and_parameter_heavy_model()
    input = torch.rand(4, 16)
    sizes = profile_sizes(model, input, chunks=4, param_scale=2.0, device=CPU)
    assert max(range(5), key=sizes.__getitem__) == 1  # Bulky
    assert sizes[1] == 16 * FLOAT + 2 * 20_000 * FLOAT
    balance = balance_by_size(2, model, input, chunks=4, device='cpu')
    assert balance == [2, 3]
    assert_valid_balance(balance, model, 2, input)


@pytest.mark.parametrize('param_scale, expected', [(0.5, [2, 2]), (4.0, [1, 3])])
def test_param_scale_moves_the_split(param_scale: float, expected: List[int]) -> None:
    # The costs are [(1 + param_scale) a, a, a, a] for a = 1000 floats.
    model = nn.Sequential(Scale(1000), Double(), Double(), Double())
    input = torch.rand(1, 1000)
    balance = balance_by_size(2, model, input, param_scale=param_scale, device='cpu')
    assert balance == expected


# ---------------------------------------------------------------------------
# The user's module is left alone


def test_sandbox_copies_layers_to_the_device_in_training_mode() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout())
    model.eval()
    copies = list(layerwise_sandbox(model, CPU))
    assert len(copies) == 2
    for layer, copy in zip(model, copies):
        assert copy is not layer and copy.training and not layer.training
        for p, q in zip(layer.parameters(), copy.parameters()):
            assert p is not q and torch.equal(p, q)


def test_module_is_unchanged() -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.ReLU(),
                          nn.Linear(8, 4))
    model.train()
    model[2].eval()
    modes = [m.training for m in model.modules()]
    parameters = list(model.parameters())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sample = torch.rand(16, 8)
    rng_state = torch.get_rng_state()

    balance_by_time(2, model, sample, timeout=0.01, device='cpu')
    balance_by_size(2, model, sample, chunks=2, device='cpu')

    assert [m.training for m in model.modules()] == modes
    assert list(model.parameters()) == parameters
    assert all(p.grad is None for p in model.parameters())
    assert all(p.device == CPU for p in model.parameters())
    for key, value in model.state_dict().items():
        assert torch.equal(value, state[key]), key  # BatchNorm statistics too
    assert torch.equal(torch.get_rng_state(), rng_state)


def test_sample_is_unchanged() -> None:
    sample = torch.rand(4, 4, requires_grad=True)
    original = sample.detach().clone()
    model = nn.Sequential(Sleep(0), Sleep(0))
    balance_by_time(2, model, sample, timeout=0, device='cpu')
    balance_by_size(2, model, sample, device='cpu')
    assert sample.grad is None
    assert torch.equal(sample, original)


def test_in_place_layers() -> None:
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.ReLU(inplace=True),
                          nn.Linear(4, 4))
    sample = torch.randn(8, 4)
    original = sample.clone()
    balance = balance_by_time(2, model, sample, timeout=0, device='cpu')
    sizes = profile_sizes(model, sample, chunks=1, param_scale=2.0, device=CPU)
    assert torch.equal(sample, original)
    # Rectifying in place takes no new memory.
    assert sizes[0] == sizes[2] == 0
    assert_valid_balance(balance, model, 2, sample)


def test_refuses_module_with_gradients() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    model(torch.rand(1, 2)).sum().backward()
    with pytest.raises(ValueError, match='^some parameter already has gradient$'):
        balance_by_time(2, model, torch.rand(1, 2), device='cpu')
    with pytest.raises(ValueError, match='^some parameter already has gradient$'):
        balance_by_size(2, model, torch.rand(1, 2), device='cpu')


# ---------------------------------------------------------------------------
# Validation, before any profiling


def exploding_model() -> nn.Sequential:
    return nn.Sequential(Explode(), Explode())


SAMPLE = torch.rand(2, 2)
INVALID_TIME_ARGUMENTS = [
    (dict(partitions=0), ValueError, 'partitions must be a positive integer'),
    (dict(partitions=-1), ValueError, 'partitions must be a positive integer'),
    (dict(partitions=1.0), TypeError, 'partitions must be an int'),
    (dict(partitions=True), TypeError, 'partitions must be an int'),
    (dict(partitions=3), ValueError, 'ask for at most 2 partitions'),
    (dict(module=nn.ModuleList([Explode()])), TypeError, 'module must be nn.Sequential'),
    (dict(module=nn.Sequential(*[Explode()] * 2)), ValueError, 'duplicate children'),
    (dict(sample=[SAMPLE]), TypeError, 'sample must be a tensor or a tuple of tensors'),
    (dict(timeout=-1.0), ValueError, 'timeout must be finite and non-negative'),
    (dict(timeout=math.nan), ValueError, 'timeout must be finite and non-negative'),
    (dict(timeout=math.inf), ValueError, 'timeout must be finite and non-negative'),
    (dict(timeout='1'), TypeError, 'timeout must be a real number'),
    (dict(device=object()), TypeError, 'device must be a torch.device'),
    (dict(device='nonsense'), ValueError, 'device is not a valid device'),
]


@pytest.mark.parametrize('arguments, error, message', INVALID_TIME_ARGUMENTS)
def test_balance_by_time_validates_arguments(arguments: dict, error: type,
                                             message: str) -> None:
    kwargs = dict(partitions=2, module=exploding_model(), sample=SAMPLE, timeout=0.0,
                  device='cpu')
    kwargs.update(arguments)
    with pytest.raises(error, match=message):
        balance_by_time(kwargs.pop('partitions'), kwargs.pop('module'), kwargs.pop('sample'),
                        **kwargs)


INVALID_SIZE_ARGUMENTS = [
    (dict(partitions=0), ValueError, 'partitions must be a positive integer'),
    (dict(partitions=3), ValueError, 'ask for at most 2 partitions'),
    (dict(module=nn.ModuleList([Explode()])), TypeError, 'module must be nn.Sequential'),
    (dict(input=[SAMPLE]), TypeError, 'input must be a tensor or a tuple of tensors'),
    (dict(input=torch.tensor(1.0)), ValueError, 'batch dimension'),
    (dict(chunks=0), ValueError, 'number of chunks must be positive integer'),
    (dict(chunks=1.5), ValueError, 'number of chunks must be positive integer'),
    (dict(chunks='2'), TypeError, 'chunks must be an int'),
    (dict(input=()), ValueError, 'input must hold at least one tensor'),
    (dict(input=(SAMPLE, SAMPLE[:1])), ValueError, 'must have the same size in dimension 0'),
    (dict(param_scale=-1.0), ValueError, 'param_scale must be finite and non-negative'),
    (dict(param_scale=math.nan), ValueError, 'param_scale must be finite and non-negative'),
    (dict(param_scale='2'), TypeError, 'param_scale must be a real number'),
    (dict(device=0.5), TypeError, 'device must be a torch.device'),
    (dict(device='nonsense'), ValueError, 'device is not a valid device'),
]


@pytest.mark.parametrize('arguments, error, message', INVALID_SIZE_ARGUMENTS)
def test_balance_by_size_validates_arguments(arguments: dict, error: type,
                                             message: str) -> None:
    kwargs = dict(partitions=2, module=exploding_model(), input=SAMPLE, chunks=1,
                  param_scale=2.0, device='cpu')
    kwargs.update(arguments)
    with pytest.raises(error, match=message):
        balance_by_size(kwargs.pop('partitions'), kwargs.pop('module'), kwargs.pop('input'),
                        **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason='CUDA is available')
def test_default_cuda_device_without_cuda() -> None:
    with pytest.raises(ValueError, match=re.escape(
            "device is cuda but CUDA is not available (device: 'cuda'); profile on the CPU with "
            "device='cpu'")):
        balance_by_time(2, exploding_model(), SAMPLE)
    with pytest.raises(ValueError, match='CUDA is not available'):
        balance_by_size(2, exploding_model(), SAMPLE)


def test_layer_output_must_be_tensors() -> None:
    class ReturnsList(nn.Module):
        def forward(self, x: Tensor) -> List[Tensor]:
            return [x]

    model = nn.Sequential(ReturnsList(), Double())
    with pytest.raises(TypeError, match='the output of layer 0 must be a tensor'):
        balance_by_time(2, model, SAMPLE, timeout=0, device='cpu')
    with pytest.raises(TypeError, match='the output of layer 0 must be a tensor'):
        balance_by_size(2, model, SAMPLE, device='cpu')


def test_torchgpipe_balancing_is_gone() -> None:
    sys.modules.pop('torchgpipe_balancing', None)
    with pytest.raises(ImportError, match='moved to torchgpipe.balance'):
        importlib.import_module('torchgpipe_balancing')


# ---------------------------------------------------------------------------
# CUDA


@pytest.mark.cuda
@pytest.mark.usefixtures('virtual_clock')
def test_balance_by_time_on_cuda() -> None:
    model = nn.Sequential(Sleep(0.01), Sleep(0.01), Sleep(0.04), Sleep(0.01), Sleep(0.01))
    balance = balance_by_time(3, model, torch.rand(4, 4), timeout=0.05,
                              device=torch.device('cuda'))
    assert balance == [2, 1, 2]
    # Profiled on a copy: the model stays on the CPU.
    assert all(p.device == CPU and p.grad is None for p in model.parameters())


@pytest.mark.cuda
def test_balance_by_size_on_cuda() -> None:
    model = latent_and_parameter_heavy_model()
    latent = profile_sizes(model, torch.rand(1024, 16), 4, 2.0, torch.device('cuda'))
    assert max(range(5), key=latent.__getitem__) == 3
    heavy = profile_sizes(model, torch.rand(4, 16), 4, 2.0, torch.device('cuda'))
    assert max(range(5), key=heavy.__getitem__) == 1
    assert balance_by_size(2, model, torch.rand(1024, 16), chunks=4) == [3, 2]
    assert all(p.device == CPU and p.grad is None for p in model.parameters())


@pytest.mark.cuda
@pytest.mark.usefixtures('virtual_clock')
def test_skippable_layers_on_cuda() -> None:
    model = nn.Sequential(StashSleep(0.01), Sleep(0.01), Sleep(0.04), Sleep(0.01),
                          PopSleep(0.01))
    assert balance_by_time(3, model, torch.rand(4, 4), timeout=0.05) == [2, 1, 2]
    balance = balance_by_size(2, model, torch.rand(4, 4))
    assert len(balance) == 2 and sum(balance) == 5


@skippable(stash=['residual'])
class KeepResidual(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, None, Tensor]:
        yield stash('residual', x)
        return x * 2


@skippable(pop=['residual'])
class AddIntoResidual(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Tensor, Tensor]:
        residual = yield pop('residual')
        return residual.add_(x)  # in place, as to_sequential's generated code may do


@pytest.mark.parametrize('balance_by', [balance_by_time, balance_by_size])
def test_profiling_a_layer_that_modifies_a_popped_skip_in_place(balance_by: Any) -> None:
    model = nn.Sequential(KeepResidual(), nn.Linear(4, 4), AddIntoResidual())
    sample = torch.randn(8, 4, requires_grad=True)
    kept = sample.detach().clone()
    if balance_by is balance_by_time:
        balance = balance_by(2, model, sample, timeout=0.05, device='cpu')
    else:
        balance = balance_by(2, model, sample, chunks=2, device='cpu')
    assert sum(balance) == 3
    assert torch.equal(sample, kept)

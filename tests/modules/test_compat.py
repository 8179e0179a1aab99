"""Drop-in fidelity to torchgpipe 0.0.7 beyond the main API.

What a script written for 0.0.7 passes or saves must work unchanged:
integral numbers that are not ints, mode objects, the old version module,
state dicts with 0.0.7's keys or with the unwrapped model's, and how many
micro-batches ``'except_last'`` checkpoints. Also getting the plain model
back from a trained GPipe. Every GPipe here runs on both execution paths.
"""
import copy
import enum
import importlib
import os
import subprocess
import sys
from collections import OrderedDict
from typing import Callable, Dict, List

import numpy as np
import pytest
import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

import torchgpipe
from helpers import assert_same_training_step, cpu_devices, mlp
from torchgpipe import GPipe
from torchgpipe.batchnorm import DeferredBatchNorm

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- integral numbers, mode objects ----------------------------------------------------

INTEGRAL_FOUR = [4.0, np.int64(4), np.float32(4.0), torch.tensor(4), torch.tensor(4.0)]


@pytest.mark.parametrize('chunks', INTEGRAL_FOUR, ids=repr)
def test_integral_chunks_are_stored_as_int(chunks: object, threaded: bool) -> None:
    def gpipe_factory(model: nn.Sequential) -> GPipe:
        return GPipe(model, [2, 1], devices=cpu_devices(2, threaded),
                     chunks=chunks)  # type: ignore[arg-type]

    gpipe = gpipe_factory(mlp(3, 4, 2, last_activation=False))
    assert type(gpipe.chunks) is int and gpipe.chunks == 4
    # Splits into 4 micro-batches and trains like the unwrapped model.
    assert_same_training_step(mlp(3, 4, 2, last_activation=False), gpipe_factory,
                              torch.randn(8, 3))

    deferred = DeferredBatchNorm(4, chunks=chunks)  # type: ignore[arg-type]
    assert type(deferred.chunks) is int and deferred.chunks == 4
    converted = DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm1d(4),
                                                              chunks)  # type: ignore[arg-type]
    assert type(converted.chunks) is int and converted.chunks == 4


@pytest.mark.parametrize('chunks, error', [
    (2.5, ValueError), (torch.tensor(2.5), ValueError), (float('nan'), ValueError),
    (0.0, ValueError), (True, TypeError), (torch.tensor(True), TypeError),
    (torch.tensor([4]), TypeError),
], ids=repr)
def test_non_integral_chunks_stay_errors(chunks: object, error: type) -> None:
    with pytest.raises(error, match='chunks'):
        GPipe(mlp(3, 4, 2, last_activation=False), [3], devices=['cpu'],
              chunks=chunks)  # type: ignore[arg-type]
    with pytest.raises(error, match='chunks'):
        DeferredBatchNorm(4, chunks=chunks)  # type: ignore[arg-type]


@pytest.mark.parametrize('balance', [
    [2.0, 1.0], [np.int64(2), np.int32(1)], np.array([2, 1]), [torch.tensor(2), 1.0],
    torch.tensor([2, 1]),
], ids=repr)
def test_integral_balance_entries_are_stored_as_ints(balance: object, threaded: bool) -> None:
    def gpipe_factory(model: nn.Sequential) -> GPipe:
        return GPipe(model, balance, devices=cpu_devices(2, threaded),  # type: ignore[arg-type]
                     chunks=2)

    gpipe = gpipe_factory(mlp(3, 4, 2, last_activation=False))
    assert gpipe.balance == [2, 1] and all(type(x) is int for x in gpipe.balance)
    assert [len(p) for p in gpipe.partitions] == [2, 1]
    assert_same_training_step(mlp(3, 4, 2, last_activation=False), gpipe_factory,
                              torch.randn(4, 3))


class Mode(enum.Enum):
    ALWAYS = 'always'
    EXCEPT_LAST = 'except_last'
    NEVER = 'never'

    def __str__(self) -> str:
        return str(self.value)


@pytest.mark.parametrize('mode', list(Mode))
def test_checkpoint_mode_object_is_stored_as_its_str(mode: Mode, threaded: bool) -> None:
    def gpipe_factory(model: nn.Sequential) -> GPipe:
        return GPipe(model, [2, 1], devices=cpu_devices(2, threaded), chunks=2,
                     checkpoint=mode)  # type: ignore[arg-type]

    gpipe = gpipe_factory(mlp(3, 4, 2, last_activation=False))
    assert type(gpipe.checkpoint) is str and gpipe.checkpoint == mode.value
    assert_same_training_step(mlp(3, 4, 2, last_activation=False), gpipe_factory,
                              torch.randn(4, 3))

    class Sometimes:
        def __str__(self) -> str:
            return 'sometimes'

    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', "
                                         "or 'never'"):
        GPipe(mlp(3, 4, 2, last_activation=False), [3], devices=['cpu'],
              checkpoint=Sometimes())  # type: ignore[arg-type]


# -- the version module ------------------------------------------------------------------


def run_python(code: str) -> None:
    """Runs ``code`` in a fresh interpreter, where no import happened yet."""
    subprocess.run([sys.executable, '-c', code], cwd=ROOT, check=True)


@pytest.mark.parametrize('first_import', [
    'from torchgpipe.__version__ import __version__',
    'import torchgpipe.__version__',
    'import torchgpipe',
])
def test_version_module_of_0_0_7(first_import: str) -> None:
    # The package attribute stays the string, whichever import comes first.
    run_python(f'{first_import}\n'
               'from torchgpipe.__version__ import __version__\n'
               'import torchgpipe\n'
               'from torchgpipe._version import __version__ as defined\n'
               'assert __version__ == torchgpipe.__version__ == defined, __version__\n'
               'assert isinstance(torchgpipe.__version__, str), torchgpipe.__version__\n')

    from torchgpipe.__version__ import __version__
    assert isinstance(torchgpipe.__version__, str)
    assert __version__ == torchgpipe.__version__


# -- 0.0.7's module paths --------------------------------------------------------------

#: Each module of 0.0.7 that now lives in a layer's folder, and that folder.
MOVED = {'batchnorm': 'runtime', 'checkpoint': 'runtime', 'copy': 'foundation',
         'dependency': 'foundation', 'gpipe': 'modules', 'microbatch': 'foundation',
         'phony': 'foundation', 'pipeline': 'engine', 'stream': 'foundation',
         'worker': 'runtime'}


@pytest.mark.parametrize('name', sorted(MOVED))
def test_the_paths_of_0_0_7_name_the_modules_of_the_folders(name: str) -> None:
    """``torchgpipe.checkpoint`` is ``torchgpipe.runtime.checkpoint``, the
    module itself: what a script patches by the old path, the library sees."""
    old = importlib.import_module(f'torchgpipe.{name}')
    new = importlib.import_module(f'torchgpipe.{MOVED[name]}.{name}')
    assert old is new and getattr(torchgpipe, name) is new
    assert sys.modules[f'torchgpipe.{name}'] is new


def test_the_paths_of_0_0_7_are_attributes_of_the_package_in_a_fresh_interpreter() -> None:
    """Every module of 0.0.7 is an attribute once the package is imported, as
    0.0.7's own import made it, and each imports by its old path too."""
    # One interpreter for all: each check before its own import reads only
    # what importing the package did.
    checks = ''.join(f'assert torchgpipe.{name} is torchgpipe.{folder}.{name}\n'
                     for name, folder in sorted(MOVED.items()))
    imports = ''.join(f'from torchgpipe.{name} import *\n'
                      f'import torchgpipe.{name} as old\n'
                      f'assert old is torchgpipe.{folder}.{name}\n'
                      for name, folder in sorted(MOVED.items()))
    run_python('import torchgpipe, torchgpipe.foundation, torchgpipe.runtime, torchgpipe.engine, '
               'torchgpipe.modules\n'
               + checks + imports)


def test_a_patch_by_the_path_of_0_0_7_reaches_the_library(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A test of 0.0.7's era that patches ``torchgpipe.pipeline.clock_cycles``
    or ``torchgpipe.checkpoint.is_checkpointing`` patches what runs."""
    import torchgpipe.checkpoint
    import torchgpipe.runtime.checkpoint
    monkeypatch.setattr(torchgpipe.checkpoint, 'is_checkpointing', lambda: 'patched')
    assert torchgpipe.runtime.checkpoint.is_checkpointing() == 'patched'


def test_the_classes_of_0_0_7_unpickle_from_their_old_paths() -> None:
    """A pickle written by 0.0.7 names its classes by the old paths."""
    import pickle
    gpipe = GPipe(nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)), [1, 1],
                  devices=['cpu', 'cpu'], chunks=2, deferred_batch_norm=True)
    # Protocol 2 names a class as text: module, newline, name.
    data = pickle.dumps(gpipe, protocol=2)
    old = data.replace(b'torchgpipe.runtime.batchnorm\n', b'torchgpipe.batchnorm\n') \
        .replace(b'torchgpipe.modules.gpipe\n', b'torchgpipe.gpipe\n')
    assert b'torchgpipe.batchnorm\nDeferredBatchNorm' in old
    assert b'torchgpipe.gpipe\nGPipe' in old
    loaded = pickle.loads(old)
    assert type(loaded) is GPipe and type(loaded[1]) is DeferredBatchNorm
    assert loaded[1].chunks == 2


# -- BatchNorm conversion ----------------------------------------------------------------


def test_batchnorm_without_running_stats_is_not_converted(threaded: bool) -> None:
    def make_model() -> nn.Sequential:
        return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, track_running_stats=False),
                             nn.Linear(4, 2))

    def gpipe_factory(model: nn.Sequential) -> GPipe:
        return GPipe(model, [2, 1], devices=cpu_devices(2, threaded), chunks=1,
                     deferred_batch_norm=True)

    model = make_model()
    bn = model[1]
    assert DeferredBatchNorm.convert_deferred_batch_norm(bn, 2) is bn
    gpipe = gpipe_factory(model)
    assert gpipe[1] is bn and type(bn) is nn.BatchNorm1d
    assert_same_training_step(make_model(), gpipe_factory, torch.randn(4, 3))


def test_deferred_batchnorm_with_the_same_chunks_is_returned_as_is() -> None:
    deferred = DeferredBatchNorm(4, chunks=3)
    state = copy.deepcopy(deferred.state_dict())
    assert DeferredBatchNorm.convert_deferred_batch_norm(deferred, 3) is deferred
    assert deferred.chunks == 3
    assert deferred.state_dict().keys() == state.keys()


# -- state dicts -------------------------------------------------------------------------


def bn_model() -> nn.Sequential:
    """Named children, a BatchNorm inside a partition and one at a boundary."""
    return nn.Sequential(OrderedDict([
        ('stem', nn.Linear(3, 4)),
        ('norm', nn.BatchNorm1d(4)),
        ('act', nn.ReLU()),
        ('head', nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))),
        ('out', nn.Linear(4, 2)),
    ]))


BALANCE = [2, 3]
CHUNKS = 3


def make_gpipe(model: nn.Sequential, threaded: bool, deferred: bool) -> GPipe:
    return GPipe(model, BALANCE, devices=cpu_devices(2, threaded), chunks=CHUNKS,
                 deferred_batch_norm=deferred)


def train(gpipe: GPipe, steps: int = 3) -> None:
    optimizer = torch.optim.SGD(gpipe.parameters(), lr=0.1)
    for _ in range(steps):
        optimizer.zero_grad()
        gpipe(torch.randn(12, 3) * 2 + 1).pow(2).mean().backward()
        optimizer.step()


def gpipe_key(key: str) -> str:
    """A key of bn_model() in GPipe's style."""
    partition = 0 if key.split('.')[0] in ('stem', 'norm') else 1
    return f'partitions.{partition}.{key}'


def test_deferred_state_dict_has_the_keys_of_0_0_7(threaded: bool) -> None:
    gpipe = make_gpipe(bn_model(), threaded, deferred=True)
    train(gpipe)
    state = gpipe.state_dict()

    # 0.0.7's deferred layer: a BatchNorm's buffers, then 'sum' and
    # 'sum_squares', zeros of the running statistics' shape between mini-batches.
    expected: List[str] = []
    for key in bn_model().state_dict():
        expected.append(gpipe_key(key))
        if key.endswith('num_batches_tracked'):
            expected += [gpipe_key(key.replace('num_batches_tracked', name))
                         for name in ('sum', 'sum_squares')]
    assert list(state) == expected
    for key in expected:
        if key.endswith(('.sum', '.sum_squares')):
            running_mean = state[key.rsplit('.', 1)[0] + '.running_mean']
            assert state[key].dtype == running_mean.dtype, key
            assert torch.equal(state[key], torch.zeros_like(running_mean)), key
    # Only in the state dict: the buffers, which DistributedDataParallel
    # broadcasts, stay the BatchNorm layers'.
    assert [name for name, _ in gpipe.named_buffers()] == \
        [gpipe_key(name) for name, _ in bn_model().named_buffers()]

    # A state dict of that shape loads strictly, with or without the sums.
    other = make_gpipe(bn_model(), threaded, deferred=True)
    other.load_state_dict(state)
    without_sums = {k: v for k, v in state.items() if not k.endswith(('.sum', '.sum_squares'))}
    other = make_gpipe(bn_model(), threaded, deferred=True)
    other.load_state_dict(without_sums)
    assert_same_state(other.state_dict(), state)
    assert other.partitions[0].norm.num_batches_tracked == 3


def assert_same_state(actual: Dict[str, Tensor], expected: Dict[str, Tensor]) -> None:
    assert list(actual) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(actual[key], value, msg=key)


def eval_output(module: nn.Module, x: Tensor) -> Tensor:
    module.eval()
    with torch.no_grad():
        return module(x)


@pytest.mark.parametrize('deferred', [False, True], ids=['plain-bn', 'deferred-bn'])
def test_unwrap_gives_the_plain_model_back(deferred: bool, threaded: bool) -> None:
    gpipe = make_gpipe(bn_model(), threaded, deferred)
    train(gpipe)
    gpipe_state = copy.deepcopy(gpipe.state_dict())

    plain = gpipe.unwrap('cpu')

    # The original structure: names, order, classes (no deferred layer).
    assert type(plain) is nn.Sequential
    assert [(name, type(m)) for name, m in plain.named_modules()] == \
        [(name, type(m)) for name, m in bn_model().named_modules()]
    assert plain.training and all(m.training for m in plain.modules())
    assert all(t.device == torch.device('cpu') for t in plain.state_dict().values())
    for name, bn in plain.named_modules():
        if isinstance(bn, _BatchNorm):
            layer = gpipe.get_submodule(gpipe_key(name))
            assert (bn.eps, bn.momentum, bn.affine) == (layer.eps, layer.momentum, layer.affine)

    # The same values, sharing no storage with the pipeline.
    gpipe_tensors = [*gpipe.parameters(), *gpipe.buffers()]
    assert not {t.data_ptr() for t in gpipe_tensors} & \
        {t.data_ptr() for t in [*plain.parameters(), *plain.buffers()]}
    for key, value in plain.state_dict().items():
        assert torch.equal(value, gpipe_state[gpipe_key(key)]), key

    # Loads strictly into the user's original model, which then computes
    # what the GPipe computes.
    x = torch.randn(6, 3)
    expected = eval_output(gpipe, x)
    fresh = bn_model()
    fresh.load_state_dict(plain.state_dict())
    torch.testing.assert_close(eval_output(fresh, x), expected)
    torch.testing.assert_close(eval_output(plain, x), expected)

    # Changing the copy changes nothing in the pipeline.
    with torch.no_grad():
        for t in [*plain.parameters(), *plain.buffers()]:
            t.add_(1)
    assert_same_state(gpipe.state_dict(), gpipe_state)

    # Round trip: the plain model's state loads strictly into a fresh GPipe,
    # which computes the same and has the same state.
    again = make_gpipe(bn_model(), threaded, deferred)
    again.load_state_dict(fresh.state_dict())
    torch.testing.assert_close(eval_output(again, x), expected)
    assert_same_state(again.state_dict(), gpipe.state_dict())
    assert_same_state(again.unwrap().state_dict(), fresh.state_dict())


def test_unwrap_keeps_training_modes_and_shared_layers() -> None:
    shared = nn.ReLU()
    model = nn.Sequential(nn.Sequential(nn.Linear(2, 2), shared), nn.Dropout(),
                          nn.Sequential(shared, nn.Linear(2, 2)))
    gpipe = GPipe(model, [2, 1], devices=['cpu', 'cpu'])
    gpipe.eval()
    gpipe[1].train()

    plain = gpipe.unwrap()

    assert not plain.training and plain[1].training and not plain[0].training
    assert plain[0][1] is plain[2][0] and plain[0][1] is not shared


@pytest.mark.parametrize('device, error', [('gpu', ValueError), (1.5, TypeError)])
def test_unwrap_device_is_checked(device: object, error: type) -> None:
    with pytest.raises(error, match=r"\(device: .*\); use a device such as device='cpu'"):
        GPipe(mlp(3, 4, 2, last_activation=False), [3],
              devices=['cpu']).unwrap(device)  # type: ignore[arg-type]


@pytest.mark.parametrize('style', ['plain', 'gpipe'])
def test_load_state_dict_reports_keys_in_the_style_given(style: str, threaded: bool) -> None:
    gpipe = make_gpipe(bn_model(), threaded, deferred=True)
    state = bn_model().state_dict()
    del state['out.bias']
    state['extra.weight'] = torch.zeros(1)
    state['stem.extra'] = torch.zeros(1)
    rename: Callable[[str], str] = (lambda key: key) if style == 'plain' else gpipe_key
    state = OrderedDict((rename(k), v) for k, v in state.items())

    with pytest.raises(RuntimeError) as excinfo:
        gpipe.load_state_dict(state)
    message = str(excinfo.value)
    assert f'Missing key(s) in state_dict: "{rename("out.bias")}"' in message
    unexpected = message.split('Unexpected key(s) in state_dict: ')[1]
    assert sorted(unexpected.strip(' .').split(', ')) == \
        sorted([f'"{rename("extra.weight")}"', f'"{rename("stem.extra")}"'])

    result = gpipe.load_state_dict(state, strict=False)
    assert result.missing_keys == [rename('out.bias')]
    assert sorted(result.unexpected_keys) == sorted([rename('extra.weight'),
                                                     rename('stem.extra')])


def test_load_state_dict_reads_batchnorm_versions_of_plain_keys(threaded: bool) -> None:
    # BatchNorm's loading reads the layer's version in the metadata of a
    # state dict: a current layer's state needs num_batches_tracked; one
    # saved before PyTorch counted batches (version 1) goes without.
    state = bn_model().state_dict()
    del state['norm.num_batches_tracked']
    gpipe = make_gpipe(bn_model(), threaded, deferred=True)
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: '
                                           r'"norm.num_batches_tracked"\.'):
        gpipe.load_state_dict(state)

    getattr(state, '_metadata')['norm']['version'] = 1
    gpipe.load_state_dict(state)


# -- how many micro-batches 'except_last' checkpoints -------------------------------------


def expected_checkpointed(mode: str, m: int, chunks: int) -> int:
    """As torchgpipe 0.0.7: 'except_last' spares the last of ``chunks``."""
    return {'always': m, 'except_last': min(m, chunks - 1), 'never': 0}[mode]


@pytest.mark.parametrize('batch', [8, 6, 2, 1], ids=lambda b: f'batch{b}')  # m = 4, 3, 2, 1
def test_number_of_checkpointed_micro_batches(checkpoint: str, batch: int,
                                              threaded: bool) -> None:
    chunks = 4
    # A plain BatchNorm updates its running statistics at every call: once
    # per micro-batch, and once more per recomputation.
    model = nn.Sequential(nn.BatchNorm1d(3), nn.Linear(5, 5))
    bn = copy.deepcopy(model[0])
    gpipe = GPipe(model, [1, 1], devices=cpu_devices(2, threaded), chunks=chunks,
                  checkpoint=checkpoint)

    x = torch.randn(batch, 3, 5) * 2 + 1
    micro_batches = x.chunk(chunks)
    m = len(micro_batches)
    gpipe(x).sum().backward()

    # The reference: the forward of every micro-batch in order, then the
    # recomputation of each checkpointed one, as the backward pass meets
    # them (m-1 down to 0).
    checkpointed = expected_checkpointed(checkpoint, m, chunks)
    for micro_batch in micro_batches:
        bn(micro_batch)
    for micro_batch in reversed(micro_batches[:checkpointed]):
        bn(micro_batch)

    actual = gpipe[0]
    assert actual.num_batches_tracked == m + checkpointed
    torch.testing.assert_close(actual.running_mean, bn.running_mean)
    torch.testing.assert_close(actual.running_var, bn.running_var)


def test_short_batch_is_fully_checkpointed_with_except_last(threaded: bool) -> None:
    # The same, seen by a layer: checkpointing is observable from inside.
    class Count(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.checkpointed = 0

        def forward(self, x: Tensor) -> Tensor:
            self.checkpointed += int(torchgpipe.is_checkpointing())
            return x

    counter = Count()
    gpipe = GPipe(nn.Sequential(nn.Linear(3, 3), counter), [1, 1],
                  devices=cpu_devices(2, threaded), chunks=4)
    gpipe(torch.randn(3, 3, requires_grad=True)).sum().backward()  # m = 3 < chunks
    assert counter.checkpointed == 3
    counter.checkpointed = 0
    gpipe(torch.randn(8, 3, requires_grad=True)).sum().backward()  # m = 4 == chunks
    assert counter.checkpointed == 3

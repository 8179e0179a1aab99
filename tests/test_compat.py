"""Drop-in fidelity to torchgpipe 0.0.7 beyond the main API.

What a script written for 0.0.7 passes or saves must work unchanged:
integral numbers that are not ints, mode objects, the old version module,
state dicts with 0.0.7's keys or with the unwrapped model's, and how many
micro-batches ``'except_last'`` checkpoints. Also getting the plain model
back from a trained GPipe. Every GPipe here runs on both execution paths.
"""
import copy
import enum
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from torch import nn

import torchgpipe
from helpers import assert_same_training_step, cpu_devices
from torchgpipe import GPipe
from torchgpipe.batchnorm import DeferredBatchNorm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


# -- integral numbers, mode objects ----------------------------------------------------

INTEGRAL_FOUR = [4.0, np.int64(4), np.float32(4.0), torch.tensor(4), torch.tensor(4.0)]


@pytest.mark.parametrize('chunks', INTEGRAL_FOUR, ids=repr)
def test_integral_chunks_are_stored_as_int(chunks: object, threaded: bool) -> None:
    def gpipe_factory(model: nn.Sequential) -> GPipe:
        return GPipe(model, [2, 1], devices=cpu_devices(2, threaded),
                     chunks=chunks)  # type: ignore[arg-type]

    gpipe = gpipe_factory(mlp())
    assert type(gpipe.chunks) is int and gpipe.chunks == 4
    # Splits into 4 micro-batches and trains like the unwrapped model.
    assert_same_training_step(mlp(), gpipe_factory, torch.randn(8, 3))

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
        GPipe(mlp(), [3], devices=['cpu'], chunks=chunks)  # type: ignore[arg-type]
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

    gpipe = gpipe_factory(mlp())
    assert gpipe.balance == [2, 1] and all(type(x) is int for x in gpipe.balance)
    assert [len(p) for p in gpipe.partitions] == [2, 1]
    assert_same_training_step(mlp(), gpipe_factory, torch.randn(4, 3))


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

    gpipe = gpipe_factory(mlp())
    assert type(gpipe.checkpoint) is str and gpipe.checkpoint == mode.value
    assert_same_training_step(mlp(), gpipe_factory, torch.randn(4, 3))

    class Sometimes:
        def __str__(self) -> str:
            return 'sometimes'

    with pytest.raises(ValueError, match="checkpoint is not one of 'always', 'except_last', "
                                         "or 'never'"):
        GPipe(mlp(), [3], devices=['cpu'], checkpoint=Sometimes())  # type: ignore[arg-type]


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

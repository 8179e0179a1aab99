"""torchgpipe.distributed.train_step: train_step on replicas under DistributedDataParallel.

Two processes of a gloo group train the same models two ways, side by side:
with :func:`torchgpipe.distributed.train_step` over
``DistributedDataParallel(GPipe(...))``, and with DDP the usual way (forward,
``loss.backward()``), over the unwrapped model, or, for BatchNorm, whose
statistics are per micro-batch in a pipeline, over the same GPipe. After every
step the gradients (and at the end the buffers) of both must agree on every
rank: then the gradients were averaged over the replicas, the buffers
broadcast from rank 0, as DDP does.
"""
import itertools
from contextlib import nullcontext
from typing import Any, Dict, Iterator, List, NamedTuple, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import torchgpipe.distributed
from helpers import CHECKPOINT_MODES, schedule_devices
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from test_distributed import BATCH, CHUNKS, FEATURES, TOLERANCE, build, global_batch
from torchgpipe import GPipe

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

STEPS = 2
SCHEDULES = ['1f1b', 'fill_drain', 'zb_h1']


class Config(NamedTuple):
    model: str
    schedule: str
    checkpoint: str
    threads: bool
    #: 'plain': the reference is DDP over the unwrapped model; 'gpipe': over
    #: the same GPipe, forward and backward.
    reference: str = 'plain'
    #: Two train_steps per step, the first inside no_sync().
    accumulate: bool = False
    #: Another balance than the model's own (four partitions, for a V).
    balance: Tuple[int, ...] = ()

    @property
    def id(self) -> str:
        devices = 'threads' if self.threads else 'one-thread'
        extra = (['no_sync'] if self.accumulate else []) + \
            ([str(list(self.balance))] if self.balance else [])
        return '-'.join([self.model, self.schedule, self.checkpoint, devices] + extra)


class Unused(nn.Module):
    """A linear layer with a parameter no sample ever uses."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)
        self.unused = nn.Parameter(torch.ones(FEATURES))

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


def model_and_balance(name: str) -> Tuple[nn.Sequential, List[int]]:
    if name == 'unused':
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh(), Unused()).double(), \
            [1, 1, 1]
    return build(name)


CONFIGS = [Config(model, schedule, checkpoint, threads, reference)
           for (model, reference), schedule, checkpoint, threads in itertools.product(
               [('unet', 'plain'), ('batchnorm', 'gpipe')], SCHEDULES, CHECKPOINT_MODES,
               [False, True])] + [
    Config('unused', '1f1b', 'except_last', True),
    Config('unused', 'zb_h1', 'except_last', True),
    Config('unet', 'interleaved_1f1b', 'except_last', True),
    Config('unet', 'zbv', 'always', True, balance=(3, 2, 2, 3)),
    Config('unet', 'interleaved_1f1b', 'never', True, balance=(3, 2, 2, 3)),
    Config('unet', 'zb_h1', 'always', True, accumulate=True),
    Config('unet', '1f1b', 'always', True, accumulate=True),
    Config('batchnorm', 'fill_drain', 'except_last', False, 'gpipe', accumulate=True),
]


def gpipe(config: Config) -> GPipe:
    model, balance = model_and_balance(config.model)
    balance = list(config.balance) or balance
    devices = schedule_devices(config.schedule, len(balance), config.threads)
    return GPipe(model, balance, devices=devices, chunks=CHUNKS, checkpoint=config.checkpoint,
                 deferred_batch_norm=True)


def plain_names(module: nn.Module, named: Iterator[Tuple[str, Tensor]]
                ) -> Iterator[Tuple[str, Tensor]]:
    # GPipe's 'partitions.<j>.' prefix dropped: the names of the unwrapped model.
    for name, t in named:
        yield (name.split('.', 2)[2] if isinstance(module, GPipe) else name), t


def train(rank: int, config: Config, ours: bool) -> Dict[str, Any]:
    """Trains for ``STEPS`` steps; returns the gradients of each step and the last buffers."""
    module: nn.Module
    if ours or config.reference == 'gpipe':
        module = gpipe(config)
    else:
        module = model_and_balance(config.model)[0]
    ddp = DistributedDataParallel(module, find_unused_parameters=config.model == 'unused')
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    shard = slice(rank * BATCH, (rank + 1) * BATCH)
    grads: List[Dict[str, Optional[List[Any]]]] = []
    for step in range(STEPS):
        x, y = global_batch(step)
        x, y = x[shard], y[shard]
        halves = [(x[:BATCH // 2], y[:BATCH // 2]), (x[BATCH // 2:], y[BATCH // 2:])] \
            if config.accumulate else [(x, y)]
        optimizer.zero_grad()
        for k, (input, target) in enumerate(halves):
            sync = k == len(halves) - 1
            with ddp.no_sync() if not sync else nullcontext():
                if ours:
                    torchgpipe.distributed.train_step(ddp, input, target, F.mse_loss,
                                                      schedule=config.schedule)
                else:
                    F.mse_loss(ddp(input), target).backward()
        grads.append({name: None if p.grad is None else p.grad.tolist()
                      for name, p in plain_names(module, module.named_parameters())})
        optimizer.step()
    return {'grads': grads, 'buffers': {name: b.tolist() for name, b in
                                        plain_names(module, module.named_buffers())}}


def train_all(rank: int, world_size: int) -> Dict[str, Dict[str, Any]]:
    return {config.id: {'ours': train(rank, config, True), 'ddp': train(rank, config, False)}
            for config in CONFIGS}


@pytest.fixture(scope='module')
def trained() -> List[Dict[str, Dict[str, Any]]]:
    return run_distributed(train_all, timeout=150)


def assert_close(actual: Any, expected: Any, what: str) -> None:
    if expected is None or actual is None:
        assert actual is None and expected is None, what
        return
    torch.testing.assert_close(torch.tensor(actual), torch.tensor(expected), **TOLERANCE,
                               msg=lambda m: f'{what}: {m}')


@pytest.mark.parametrize('config', CONFIGS, ids=lambda c: c.id)
def test_gradients_and_buffers_are_those_of_ddp(
        trained: List[Dict[str, Dict[str, Any]]], config: Config) -> None:
    for rank, results in enumerate(trained):
        ours, ddp = results[config.id]['ours'], results[config.id]['ddp']
        for step, (actual, expected) in enumerate(zip(ours['grads'], ddp['grads'])):
            assert actual.keys() == expected.keys()
            for name in expected:
                assert_close(actual[name], expected[name], f'rank {rank} step {step} {name}')
        for name in ddp['buffers']:
            assert_close(ours['buffers'][name], ddp['buffers'][name], f'rank {rank} {name}')
    # Averaged: both replicas hold the same gradients.
    for name, grad in trained[0][config.id]['ours']['grads'][-1].items():
        assert_close(trained[1][config.id]['ours']['grads'][-1][name], grad, name)


def test_the_unused_parameter_keeps_no_gradient(
        trained: List[Dict[str, Dict[str, Any]]]) -> None:
    config = next(c for c in CONFIGS if c.model == 'unused')
    for results in trained:
        assert results[config.id]['ours']['grads'][0]['2.unused'] is None
        assert results[config.id]['ours']['grads'][0]['2.linear.weight'] is not None


def test_a_plain_gpipe_train_step_is_refused_in_a_job_of_several_processes() -> None:
    with pytest.raises(Exception, match='torchgpipe.distributed.train_step'):
        run_distributed(plain_train_step, timeout=60)


def plain_train_step(rank: int, world_size: int) -> None:
    model = gpipe(CONFIGS[0])
    model.train_step(*global_batch(0), F.mse_loss)


def test_model_must_be_a_gpipe_under_ddp() -> None:
    model = gpipe(CONFIGS[0])
    x, y = global_batch(0)
    with pytest.raises(TypeError, match=r'model must be a GPipe or a DistributedGPipe wrapped '
                       r'in DistributedDataParallel \(model: GPipe\)'):
        torchgpipe.distributed.train_step(model, x, y, F.mse_loss)  # type: ignore[arg-type]


def many_threaded_steps(rank: int, world_size: int, steps: int) -> int:
    """Steps on 3 worker threads, each partition's all-reduce launched by whichever finishes."""
    model = DistributedDataParallel(gpipe(Config('unet', '1f1b', 'never', True)))
    for step in range(steps):
        x, y = global_batch(step)
        torchgpipe.distributed.train_step(model, x[:8], y[:8], F.mse_loss,
                                          schedule=SCHEDULES[step % 2])
    return steps


def test_the_all_reduce_lock_under_many_threaded_steps() -> None:
    # Bounded: a deadlock between the workers, the lock and the collectives
    # ends in the deadline instead of a result.
    assert run_distributed(many_threaded_steps, 120, timeout=90) == [120, 120]

"""DistributedDataParallel over GPipe: pipeline replicas in separate processes.

Every test spawns ``WORLD_SIZE`` processes (the ``spawn`` start method) that
join a gloo process group on 127.0.0.1, each wrapping its own
:class:`~torchgpipe.GPipe` (three CPU partitions) in
:class:`~torch.nn.parallel.DistributedDataParallel`. Replica ``r`` trains on
shard ``r`` of every global batch. The parent process trains the unwrapped
``nn.Sequential`` on the whole global batch and compares every parameter (and
BatchNorm buffer) of every replica with it.

Why a single process on the concatenated batch is the right reference: each
replica's loss is the mean over its ``BATCH`` samples, and DDP averages the
gradients of the ``WORLD_SIZE`` replicas, so the gradient every replica
applies is that of ``(1 / WORLD_SIZE) * sum_r mean_r = mean over all
WORLD_SIZE * BATCH samples``, the gradient of the same loss on the
concatenated batch. GPipe itself is transparent, so nothing else differs.

Children send their results to the parent as plain Python lists over a pipe
(tensors through multiprocessing queues need file-descriptor sharing, which
fails here). The parent never waits longer than a deadline, and whenever it
stops waiting (success, a child's error, a timeout or a pytest timeout) it
terminates and reaps every child, so no process outlives its test.

Having reported, a child ends as the example does (``end_job``), and the
parent checks that every child exited with status 0.

The successful configurations are all trained in one spawn (a module-scoped
fixture): starting processes that import torch costs a few seconds each,
training these tiny models costs milliseconds.
"""
import contextvars
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import weakref
from typing import Any, Callable, Dict, Generator, Iterator, List, NamedTuple, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel

import stress_ddp_exit
from helpers import CHECKPOINT_MODES, RaiseInBackward, mlp
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import GLOO_TIMEOUT, WORLD_SIZE, WorkerFailed, run_distributed
from torchgpipe import GPipe
from torchgpipe.skip import Namespace, pop, skippable, stash

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

BATCH = 16         # per replica
CHUNKS = 4         # micro-batches of 4 samples
STEPS = 3
FEATURES = 4
# Differences are rounding in float64 (about 1e-16): anything visible is a bug.
TOLERANCE = {'rtol': 1e-10, 'atol': 1e-12}

# Plain Python data a child sends back: {name: nested lists}.
Tensors = Dict[str, Any]


# --- models -------------------------------------------------------------------------------


@skippable(stash=['skip'])
class Stash(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash('skip', x)
        return x


@skippable(pop=['skip'])
class PopAdd(nn.Module):
    """Adds the popped skip, scaled by a parameter, so the popping layer learns too."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((FEATURES,), 0.5))

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop('skip')
        return x + skip * self.scale


def perceptron() -> Tuple[nn.Sequential, List[int]]:
    return mlp(FEATURES, 8, 8, FEATURES, last_activation=False), [2, 2, 1]


def unet() -> Tuple[nn.Sequential, List[int]]:
    """Two nested skips: ``a`` leaps over the whole middle partition, ``b`` crosses into the last.

    Partitions (balance [3, 2, 5]): 0-2 | 3-4 | 5-9.
    """
    a, b = Namespace(), Namespace()
    return nn.Sequential(
        nn.Linear(FEATURES, FEATURES),  # 0
        Stash().isolate(a),             # 1  a ───────┐
        nn.Tanh(),                      # 2           │
        nn.Linear(FEATURES, FEATURES),  # 3           │
        Stash().isolate(b),             # 4  b ──┐    │
        nn.Linear(FEATURES, FEATURES),  # 5      │    │
        PopAdd().isolate(b),            # 6  b ◄─┘    │
        nn.Tanh(),                      # 7           │
        PopAdd().isolate(a),            # 8  a ◄──────┘
        nn.Linear(FEATURES, FEATURES),  # 9
    ), [3, 2, 5]


def batchnorm() -> Tuple[nn.Sequential, List[int]]:
    """BatchNorm in the first two partitions, the second fed by normalized activations."""
    return nn.Sequential(
        nn.Linear(FEATURES, 8), nn.BatchNorm1d(8), nn.Tanh(),
        nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Tanh(),
        nn.Linear(8, FEATURES),
    ), [3, 3, 1]


MODELS: Dict[str, Callable[[], Tuple[nn.Sequential, List[int]]]] = {
    'mlp': perceptron, 'unet': unet, 'batchnorm': batchnorm,
}


def build(model_name: str) -> Tuple[nn.Sequential, List[int]]:
    """The model in float64, with the same initial weights in every process."""
    torch.manual_seed(0)
    model, balance = MODELS[model_name]()
    return model.double(), balance


def global_batch(step: int) -> Tuple[Tensor, Tensor]:
    """Input and target of the whole step, ``WORLD_SIZE * BATCH`` samples; rank r gets shard r."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(WORLD_SIZE * BATCH, FEATURES, generator=gen, dtype=torch.float64)
    y = torch.randn(WORLD_SIZE * BATCH, FEATURES, generator=gen, dtype=torch.float64)
    return x, y


def new_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def to_lists(named: Iterator[Tuple[str, Tensor]]) -> Tensors:
    return {name: t.detach().tolist() for name, t in named}


# --- training, in the children ------------------------------------------------------------


class Config(NamedTuple):
    """One DDP training run; ``accumulate`` splits each step in two backward passes."""

    model: str
    checkpoint: str
    ddp_options: Tuple[Tuple[str, bool], ...] = ()
    accumulate: bool = False

    @property
    def id(self) -> str:
        extras = [f'{key}={value}' for key, value in self.ddp_options]
        if self.accumulate:
            extras.append('no_sync')
        return '-'.join([self.model, self.checkpoint] + extras)


CONFIGS = [Config(model, checkpoint)
           for model in MODELS for checkpoint in CHECKPOINT_MODES] + [
    Config('unet', 'except_last', (('static_graph', True),)),
    Config('unet', 'always', (('find_unused_parameters', True),)),
    Config('mlp', 'always', accumulate=True),
    Config('unet', 'except_last', accumulate=True),
]


def train_replica(rank: int, world_size: int, config: Config) -> Dict[str, Tensors]:
    """Trains this rank's replica for ``STEPS`` steps; returns its parameters and buffers.

    Names are those of the unwrapped model (``partitions.<j>.`` stripped).
    """
    model, balance = build(config.model)
    gpipe = GPipe(model, balance, devices=['cpu'] * len(balance), chunks=CHUNKS,
                  checkpoint=config.checkpoint, deferred_batch_norm=True)
    ddp = DistributedDataParallel(gpipe, **dict(config.ddp_options))
    optimizer = new_optimizer(ddp)

    shard = slice(rank * BATCH, (rank + 1) * BATCH)
    for step in range(STEPS):
        x, y = global_batch(step)
        x, y = x[shard], y[shard]
        optimizer.zero_grad()
        if config.accumulate:
            # Gradient accumulation: no all-reduce for the first half, one for both.
            half = BATCH // 2
            with ddp.no_sync():
                (F.mse_loss(ddp(x[:half]), y[:half]) / 2).backward()
            (F.mse_loss(ddp(x[half:]), y[half:]) / 2).backward()
        else:
            F.mse_loss(ddp(x), y).backward()
        optimizer.step()

    def unwrapped(named: Iterator[Tuple[str, Tensor]]) -> Iterator[Tuple[str, Tensor]]:
        return ((name.split('.', 2)[2], t) for name, t in named)

    return {'parameters': to_lists(unwrapped(gpipe.named_parameters())),
            'buffers': to_lists(unwrapped(gpipe.named_buffers()))}


def train_all(rank: int, world_size: int, configs: List[Config]) -> Dict[str, Dict[str, Tensors]]:
    """Trains every configuration in turn, in one process group."""
    return {config.id: train_replica(rank, world_size, config) for config in configs}


# --- the single-process reference ---------------------------------------------------------


def batch_norm_statistics(inputs: List[Tensor]) -> Tuple[Tensor, Tensor]:
    """Per-channel mean and unbiased variance of the concatenation of ``inputs``."""
    x = torch.cat(inputs)
    channels = x.transpose(0, 1).reshape(x.size(1), -1)
    return channels.mean(dim=1), channels.var(dim=1, unbiased=True)


def reference(config: Config) -> Tuple[Tensors, List[Tensors]]:
    """Trains the unwrapped model in this process on the concatenated batches.

    Returns:
        its parameters, and the buffers each replica must hold at the end

    Without BatchNorm this is plain training on the global batch (see the
    module's docstring), and the buffers are empty.

    With BatchNorm, two things differ from plain training.

    *Parameters.* In training mode a BatchNorm layer normalizes its input
    with that input's own statistics, and GPipe runs every layer on one
    micro-batch at a time, so replica ``r`` computes ``cat_i M(x_{r,i})``
    over its ``CHUNKS`` micro-batches ``x_{r,i}`` (``torch.chunk``). The
    ``WORLD_SIZE * CHUNKS`` chunks of the concatenated batch are exactly
    those micro-batches in rank order (all chunks have ``BATCH / CHUNKS``
    samples), so the reference applies the unwrapped model to each chunk of
    the global batch separately; the mean loss over all of them again has
    the averaged gradient of the replicas.

    *Running statistics.* Deferred BatchNorm commits once per step, with
    the mean and unbiased variance of everything the layer saw on that
    replica: the concatenation of its ``CHUNKS`` micro-batch inputs (for a
    later BatchNorm layer, these are activations already normalized per
    micro-batch, so they are not the full-batch activations of the unwrapped
    model). Each replica commits its own shard's statistics; there is no
    all-reduce of buffers. Instead, with ``broadcast_buffers=True`` (the
    default), DDP copies rank 0's buffers to every rank at the start of each
    forward. So rank 0's statistics evolve from rank 0's shards alone, and
    after the last step replica ``r`` holds rank 0's statistics from before
    that step, updated once with the statistics of its own last shard:
    ``(1 - momentum) * running + momentum * statistic``, and
    ``num_batches_tracked`` is ``STEPS`` everywhere.

    The reference collects each BatchNorm layer's inputs per chunk with a
    forward pre-hook and applies those updates itself; the running buffers
    of its own (ordinary) BatchNorm layers, updated once per chunk, are
    ignored.
    """
    model, _ = build(config.model)
    optimizer = new_optimizer(model)
    bn_layers = {name: m for name, m in model.named_modules() if isinstance(m, _BatchNorm)}
    seen: Dict[str, List[Tensor]] = {name: [] for name in bn_layers}
    for name, layer in bn_layers.items():
        layer.register_forward_pre_hook(
            lambda _, input, name=name: seen[name].append(input[0].detach()))

    # The running statistics of rank 0, which DDP broadcasts before every forward.
    shared: Tensors = {}
    for name, layer in bn_layers.items():
        shared[f'{name}.running_mean'] = layer.running_mean.clone()
        shared[f'{name}.running_var'] = layer.running_var.clone()
        shared[f'{name}.num_batches_tracked'] = layer.num_batches_tracked.clone()
    final: List[Tensors] = [{} for _ in range(WORLD_SIZE)]

    for step in range(STEPS):
        x, y = global_batch(step)
        for inputs in seen.values():
            inputs.clear()
        optimizer.zero_grad()
        if bn_layers:
            output = torch.cat([model(chunk) for chunk in x.chunk(WORLD_SIZE * CHUNKS)])
        else:
            output = model(x)
        F.mse_loss(output, y).backward()
        optimizer.step()

        updated: List[Tensors] = []
        for rank in range(WORLD_SIZE):
            buffers: Tensors = {}
            for name, layer in bn_layers.items():
                assert layer.momentum is not None
                momentum = layer.momentum
                chunks = seen[name][rank * CHUNKS:(rank + 1) * CHUNKS]
                mean, var = batch_norm_statistics(chunks)
                buffers[f'{name}.running_mean'] = (
                    (1 - momentum) * shared[f'{name}.running_mean'] + momentum * mean)
                buffers[f'{name}.running_var'] = (
                    (1 - momentum) * shared[f'{name}.running_var'] + momentum * var)
                buffers[f'{name}.num_batches_tracked'] = (
                    shared[f'{name}.num_batches_tracked'] + 1)
            updated.append(buffers)
        shared = updated[0]
        final = updated

    parameters = to_lists(iter(model.named_parameters()))
    return parameters, [to_lists(iter(buffers.items())) for buffers in final]


def assert_same(actual: Tensors, expected: Tensors, what: str) -> None:
    assert actual.keys() == expected.keys(), what
    for name in expected:
        torch.testing.assert_close(torch.tensor(actual[name], dtype=torch.float64),
                                   torch.tensor(expected[name], dtype=torch.float64),
                                   **TOLERANCE, msg=lambda m: f'{what} {name}: {m}')


# --- tests --------------------------------------------------------------------------------


@pytest.fixture(scope='module')
def trained() -> List[Dict[str, Dict[str, Tensors]]]:
    """Every configuration trained by ``WORLD_SIZE`` replicas: one result per rank."""
    results: List[Dict[str, Dict[str, Tensors]]] = run_distributed(train_all, CONFIGS)
    return results


@pytest.mark.parametrize('config', CONFIGS, ids=lambda c: c.id)
def test_replicas_equal_single_process_on_concatenated_batch(
        trained: List[Dict[str, Dict[str, Tensors]]], config: Config) -> None:
    parameters, buffers = reference(config)
    initial, _ = build(config.model)
    for rank, result in enumerate(trained):
        replica = result[config.id]
        assert_same(replica['parameters'], parameters, f'rank {rank} parameter')
        assert_same(replica['buffers'], buffers[rank], f'rank {rank} buffer')
    # Training moved every parameter, so the comparison is not vacuous; except the
    # bias of a Linear layer right before a BatchNorm layer, which normalization
    # cancels: its gradient is zero.
    still = {name for name, p in initial.named_parameters()
             if torch.allclose(p.detach(), torch.tensor(parameters[name], dtype=torch.float64),
                               rtol=0, atol=1e-8)}
    assert still == {f'{i - 1}.bias' for i, layer in enumerate(initial)
                     if isinstance(layer, _BatchNorm)}

class InjectedFailure(Exception):
    """Raised on purpose by :class:`FailOnRank`."""


class FailOnRank(nn.Module):
    """The identity, except on ``rank`` at ``step``: raises in forward or in backward there."""

    def __init__(self, rank: int, step: int, where: str) -> None:
        super().__init__()
        self.rank = rank
        self.step = step
        self.where = where
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        # One call per micro-batch (recomputations excluded: checkpoint='never').
        step = self.calls // CHUNKS
        self.calls += 1
        if dist.get_rank() != self.rank or step != self.step:
            return x
        if self.where == 'forward':
            raise InjectedFailure(f'injected failure in forward on rank {self.rank}')
        return RaiseInBackward.apply(  # type: ignore[no-any-return]
            x, InjectedFailure(f'injected failure in backward on rank {dist.get_rank()}'))


def train_until_failure(rank: int, world_size: int, where: str) -> None:
    """Trains an MLP whose middle partition fails on rank 1 at the second step."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(FEATURES, 8), nn.Tanh(),
        FailOnRank(1, 1, where), nn.Linear(8, FEATURES),
    ).double()
    ddp = DistributedDataParallel(GPipe(model, [2, 2], devices=['cpu', 'cpu'], chunks=CHUNKS,
                                        checkpoint='never'))
    optimizer = new_optimizer(ddp)
    for step in range(STEPS):
        x, y = global_batch(step)
        optimizer.zero_grad()
        F.mse_loss(ddp(x[:BATCH]), y[:BATCH]).backward()
        optimizer.step()


@pytest.mark.parametrize('where', ['forward', 'backward'])
def test_failure_in_one_rank_ends_the_run_with_its_error(where: str) -> None:
    start = time.monotonic()
    with pytest.raises(WorkerFailed) as failed:
        run_distributed(train_until_failure, where)
    elapsed = time.monotonic() - start

    assert failed.value.rank == 1
    assert failed.value.type_name == 'InjectedFailure'
    assert isinstance(failed.value.__cause__, InjectedFailure)
    assert f'injected failure in {where} on rank 1' in str(failed.value)
    # Rank 0, blocked in a collective, was terminated, not left to time out:
    # that takes GLOO_TIMEOUT from the collective on, whereas half of it is
    # no bound for starting two processes on a loaded machine of two cores.
    assert elapsed < GLOO_TIMEOUT
    assert multiprocessing.active_children() == []


def test_run_distributed_reports_a_child_that_dies() -> None:
    """A rank that exits without a word (e.g. killed) is reported, not waited for."""
    with pytest.raises(WorkerFailed, match='rank 1 exited'):
        run_distributed(exit_on_rank_1)


def exit_on_rank_1(rank: int, world_size: int) -> None:
    if rank == 1:
        os._exit(3)
    dist.barrier()


# --- the end of a job ---------------------------------------------------------------------


def test_end_job_ends_every_rank_while_a_gloo_thread_needs_the_gil() -> None:
    """The example's ``end_job`` gives status 0 on every rank, even in the race that
    makes the usual ending abort or hang in a few runs out of a hundred: a gloo
    thread needing the GIL while the job ends. ``--hazard`` makes that race certain;
    with ``--ending bare`` the same run hangs every time, and with ``sys.exit`` in
    place of ``os._exit`` in ``end_job``, it dies of SIGABRT every time.

    One run of ``tests/stress_ddp_exit.py``: two fresh processes, as torchrun starts them.
    """
    command = [sys.executable, stress_ddp_exit.__file__, '--job', 'gpipe-threaded',
               '--ending', 'end_job', '--hazard', '--runs', '1', '--timeout', '60']
    result = subprocess.run(command, capture_output=True, text=True, timeout=90)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "rank outcomes {'ok': 2}" in result.stdout


# The context variable whose value tells how long copies of the backward's context live.
BACKWARD_MARK: 'contextvars.ContextVar[object]' = contextvars.ContextVar('backward_mark')


class Mark:
    """The value of :data:`BACKWARD_MARK` during one backward pass (weakly referenceable)."""


def backward_marked(loss: Tensor) -> 'weakref.ReferenceType[Mark]':
    """Runs ``loss.backward()`` with a fresh :class:`Mark` in :data:`BACKWARD_MARK`.

    PyTorch's backward pass stashes a copy of the current ``contextvars`` context
    in its thread-local state, which the copies of that state (in every
    collective launched meanwhile) keep. The mark is in no context but that copy
    once the variable is reset: it lives as long as a copy does.

    Returns:
        a weak reference to the mark
    """
    mark = Mark()
    ref = weakref.ref(mark)
    token = BACKWARD_MARK.set(mark)
    del mark
    try:
        loss.backward()
    finally:
        BACKWARD_MARK.reset(token)
    return ref


def test_a_gloo_work_launched_in_backward_keeps_the_backward_context() -> None:
    """The hazard at the end of a DDP job, and the control of the next test.

    A gloo all-reduce launched during a backward pass, as DDP's are, keeps the
    backward's context until the work object is freed: by a gloo thread, which
    then needs the GIL, when that thread holds the last reference. (If PyTorch
    stops keeping it, the end of a job may no longer need ``end_job``: see
    "Ending a job" in docs/scaling_out.rst.)
    """
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    works = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: works.append(group.allreduce([grad.clone()])))
    ref = backward_marked(y.sum())
    works[0].wait()
    assert ref() is not None
    works.clear()
    # The gloo thread may hold the work a moment more: the group's destructor,
    # at return, joins it, which must not happen while it waits for the GIL.
    freed = threading.Event()
    context = ref()
    if context is None:
        freed.set()
    else:
        weakref.finalize(context, freed.set)
        del context
    assert freed.wait(10)


@pytest.mark.parametrize('devices', [['cpu', 'cpu'], ['cpu:0', 'cpu:1']],
                         ids=['one-thread', 'worker-threads'])
def test_gpipe_keeps_no_copy_of_the_backward_context(devices: List[str],
                                                      checkpoint: str) -> None:
    """Once ``backward()`` returns, nothing of GPipe holds the backward's context.

    Only the collectives DDP launches keep it (previous test), as over the plain
    ``nn.Sequential``: GPipe adds nothing that a gloo thread, or Python's
    shutdown, would free late. Not the autograd graph it builds, the
    checkpoints' recomputation (a backward pass inside the backward pass), nor
    its worker threads.
    """
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    gpipe = GPipe(model, [2, 1], devices=devices, chunks=4, checkpoint=checkpoint)
    loss = gpipe(torch.randn(8, 4)).sum()
    ref = backward_marked(loss)
    assert ref() is None
    assert all(p.grad is not None for p in gpipe.parameters())

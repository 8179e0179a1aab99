"""DistributedGPipe: a pipeline whose partitions are processes of a gloo group (or NCCL).

Each test spawns its processes once (tests/process_group.py) and runs every
configuration in them: the ranks train a model in float64 for a few steps
and send back their losses, gradients, parameters and buffers, under the
unwrapped model's names. The parent trains the same model in one process,
with :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>` on both
execution paths (the cross-process pipeline must give the very same
numbers: same micro-batches, same order of additions) and unwrapped (equal
up to rounding: the unwrapped model adds the micro-batches' gradients in
another order). The tests taking ``backend`` run on NCCL too, a GPU per rank,
where one process on the CPU gives the same numbers up to rounding.
"""
import copy
import itertools
import os
import pickle
import random
import re
import signal
import time
import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import torchgpipe.distributed
from helpers import CHECKPOINT_MODES, RaiseInBackward
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import GLOO_TIMEOUT, rank_device, run_distributed
from test_distributed import FEATURES, TOLERANCE, PopAdd, Stash, build
from torchgpipe import GPipe
from torchgpipe.distributed import DistributedGPipe
from torchgpipe.processes.core import ranks_of_partitions
from torchgpipe.skip import Namespace

pytestmark = pytest.mark.timeout(180)

BATCH = 16
CHUNKS = 4
STEPS = 2
Result = Dict[str, Any]


class Pack(nn.Module):
    """Sends other values than tensors across the partition boundary after it.

    And a tensor the next partition does not use: its layer's parameters get
    no gradient (None), as in the unwrapped model.
    """

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(FEATURES, FEATURES)

    def forward(self, x: Tensor) -> Tuple[Any, ...]:
        return (x, None, 2.0, 'scale', self.unused(x))


class Unpack(nn.Module):
    def forward(self, packed: Tuple[Any, ...]) -> Tensor:
        x, nothing, factor, word, _ = packed
        assert nothing is None and word == 'scale'
        return x * factor


def packed() -> Tuple[nn.Sequential, List[int]]:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), Pack(), Unpack(),
                         nn.Linear(FEATURES, FEATURES)).double(), [2, 2]


class Config(NamedTuple):
    model: str
    balance: Tuple[int, ...]
    schedule: str
    checkpoint: str
    #: With more partitions than ranks: 'loop' or 'v'.
    placement: str = 'loop'
    #: Each rank is given only what its partitions use, and None for the rest.
    only_where_used: bool = False

    @property
    def id(self) -> str:
        where = f'-{self.placement}' if self.placement != 'loop' else ''
        given = '-only-where-used' if self.only_where_used else ''
        return f'{self.model}-{list(self.balance)}-{self.schedule}-{self.checkpoint}{where}{given}'

    def ranks(self, size: int) -> List[int]:
        """The rank of each partition."""
        return ranks_of_partitions(list(self.balance), size, self.placement)


def tied() -> nn.Sequential:
    """The first and the last layer share a weight (an embedding and its head, say).

    On two ranks, each holds a copy, and their gradients are summed.
    """
    torch.manual_seed(0)
    first, last = nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, FEATURES)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(FEATURES, FEATURES), nn.Tanh(),
                         nn.Linear(FEATURES, FEATURES), last).double()


def model(name: str) -> nn.Sequential:
    if ' ' in name:
        return layered(name)
    if name == 'tied':
        return tied()
    return packed()[0] if name == 'packed' else build(name)[0]


SCHEDULE_CHECKPOINTS = list(itertools.product(['1f1b', 'fill_drain', 'zb_h1'], CHECKPOINT_MODES))
# unet's two skips cross from partition 0 to 1 with [5, 5], popped in the
# reverse order of their stashes; with [3, 2, 5] one leaps over the middle rank.
TWO_RANKS = [Config(m, b, s, c) for (m, b), (s, c) in itertools.product(
    [('mlp', (3, 2)), ('unet', (5, 5)), ('batchnorm', (3, 4)), ('packed', (2, 2))],
    SCHEDULE_CHECKPOINTS)]
# The first and the last layer share a weight, on different ranks.
TWO_RANKS += [Config('tied', (3, 3), s, c) for s, c in zip(['1f1b', 'fill_drain', 'zb_h1'],
                                                           CHECKPOINT_MODES)]
# The fast tier trains a quarter of them: each model with two or three schedules, and
# checkpoint modes in turn (the slow tier trains the rest, in processes of their own).
FAST_TWO_RANKS = TWO_RANKS[::4]
THREE_RANKS = [Config('unet', (3, 2, 5), s, c) for s, c in SCHEDULE_CHECKPOINTS] + [
    Config('tied', (2, 2, 2), s, c) for s, c in zip(['1f1b', 'fill_drain', 'zb_h1'],
                                                     CHECKPOINT_MODES)] + [
    # The middle rank is given None for both, while a skip leaps over it.
    Config('unet', (3, 2, 5), '1f1b', 'except_last', only_where_used=True)]
# Two partitions per rank, in a loop or a V; unet's skips cross virtual stages.
# Each schedule meets each checkpoint mode once, with one model or another.
VIRTUAL = [Config(m, b, s, CHECKPOINT_MODES[(k + n) % 3], placement)
           for k, (m, b) in enumerate([('unet', (3, 2, 2, 3)), ('mlp', (2, 1, 1, 1)),
                                       ('batchnorm', (2, 2, 2, 1))])
           for n, (s, placement) in enumerate([('interleaved_1f1b', 'loop'), ('zbv', 'v'),
                                               ('1f1b', 'loop'), ('zb_h1', 'v')])] + [
    # A V puts the first and the last partition on rank 0: they may share a weight.
    Config('tied', (2, 1, 1, 2), s, c, 'v') for s, c in itertools.product(
        ['zbv', 'zb_h1'], CHECKPOINT_MODES)] + [
    # In a loop, they are on rank 0 and rank 1.
    Config('tied', (2, 1, 1, 2), 'interleaved_1f1b', c) for c in CHECKPOINT_MODES] + [
    # Given only what they use: in a V, rank 0 both, rank 1 neither; in a
    # loop, rank 0 the input alone, rank 1 the target alone.
    Config('unet', (3, 2, 2, 3), 'zbv', 'except_last', 'v', only_where_used=True),
    Config('mlp', (2, 1, 1, 1), 'interleaved_1f1b', 'always', only_where_used=True)]


def batch(step: int, size: int = BATCH) -> Tuple[Tensor, Tensor]:
    """An input and a target, on this rank's device."""
    gen = torch.Generator().manual_seed(2000 + step)
    return (torch.randn(size, FEATURES, generator=gen, dtype=torch.float64).to(rank_device()),
            torch.randn(size, FEATURES, generator=gen, dtype=torch.float64).to(rank_device()))


def snapshot(module: nn.Module, prefix: int = 0) -> Dict[str, Dict[str, Any]]:
    """Gradients, parameters and buffers under the unwrapped model's names.

    Under every key of the state dict: a tied parameter under each of its
    names, as the rank of each use holds it.
    """
    def name(n: str) -> str:
        return n.split('.', prefix)[prefix] if prefix else n
    state = module.state_dict(keep_vars=True)
    parameters = {name(n): p for n, p in state.items() if isinstance(p, nn.Parameter)}
    return {'grads': {n: None if p.grad is None else p.grad.tolist()
                      for n, p in parameters.items()},
            'params': {n: p.tolist() for n, p in parameters.items()},
            'buffers': {name(n): b.tolist() for n, b in state.items()
                        if not isinstance(b, nn.Parameter)}}


def train(pipe: nn.Module, config: Config, step_fn: Any, size: int = BATCH) -> Result:
    """Trains with SGD; returns the losses and, after each step, a snapshot (before the update)."""
    # A partition may hold no parameter (a stash alone, say).
    optimizer = torch.optim.SGD(list(pipe.parameters()) or [torch.zeros(1)], lr=0.1)
    losses, snapshots = [], []
    prefix = 2 if isinstance(pipe, GPipe) else 0
    for step in range(STEPS):
        optimizer.zero_grad()
        losses.append(float(step_fn(*batch(step, size), F.mse_loss, schedule=config.schedule)))
        snapshots.append(snapshot(pipe, prefix))
        optimizer.step()
    return {'losses': losses, 'snapshots': snapshots}


def pipeline(config: Config) -> DistributedGPipe:
    """This rank's DistributedGPipe of ``config``."""
    return DistributedGPipe(model(config.model), config.balance, chunks=CHUNKS,
                            checkpoint=config.checkpoint,
                            deferred_batch_norm=config.model == 'batchnorm',
                            placement=config.placement, device=rank_device())


def where_used(step_fn: Any, config: Config, rank: int, world_size: int) -> Any:
    """``step_fn`` of this rank, given the input only if it holds the first partition of
    ``config``, and the target only if the last (under ``config.only_where_used``)."""
    if not config.only_where_used:
        return step_fn
    ranks = config.ranks(world_size)

    def step(input: Tensor, target: Optional[Tensor] = None, *args: Any, **kwargs: Any) -> Any:
        return step_fn(input if ranks[0] == rank else None,
                       target if ranks[-1] == rank else None, *args, **kwargs)
    return step


def train_pipelines(rank: int, world_size: int, configs: List[Config]) -> Dict[str, Result]:
    results = {}
    for config in configs:
        pipe = pipeline(config)
        results[config.id] = train(pipe, config, where_used(pipe.train_step, config, rank,
                                                            world_size))
    return results


def one_process(config: Config, threads: bool, ranks: int = 0) -> Result:
    """GPipe on one thread, or on a device per rank of ``ranks`` (default: per partition)."""
    workers = config.ranks(ranks) if ranks else range(len(config.balance))
    devices = [f'cpu:{w}' if threads else 'cpu' for w in workers]
    gpipe = GPipe(model(config.model), list(config.balance), devices=devices, chunks=CHUNKS,
                  checkpoint=config.checkpoint,
                  deferred_batch_norm=config.model == 'batchnorm')
    return train(gpipe, config, gpipe.train_step)


def unwrapped(config: Config) -> Result:
    plain = model(config.model)

    def step(input: Tensor, target: Tensor, loss_fn: Any, schedule: str) -> Tensor:
        loss = loss_fn(plain(input), target)
        loss.backward()
        return loss.detach()
    return train(plain, config, step)


def merge(ranks: List[Result]) -> Result:
    """One result from the ranks': each holds its partition's tensors, and all the losses."""
    merged: Result = {'losses': ranks[-1]['losses'], 'snapshots': []}
    for step in range(len(merged['losses'])):
        joined: Dict[str, Dict[str, Any]] = {'grads': {}, 'params': {}, 'buffers': {}}
        for result in ranks:
            for kind in joined:
                joined[kind].update(result['snapshots'][step][kind])
        merged['snapshots'].append(joined)
    for result in ranks:  # every rank returns the last rank's loss
        assert result['losses'] == merged['losses']
    return merged


def assert_equal(actual: Result, expected: Result, exact: bool) -> None:
    tolerance = {'rtol': 0, 'atol': 0} if exact else TOLERANCE

    def tensor(values: Any) -> Tensor:  # float64: float32 would round a last bit away
        return torch.tensor(values, dtype=torch.float64)
    torch.testing.assert_close(tensor(actual['losses']), tensor(expected['losses']), **tolerance)
    for step, (a, e) in enumerate(zip(actual['snapshots'], expected['snapshots'])):
        for kind in e:
            assert a[kind].keys() == e[kind].keys(), kind
            for name in e[kind]:
                if e[kind][name] is None or a[kind][name] is None:  # no gradient
                    assert a[kind][name] is e[kind][name] is None, (step, kind, name)
                    continue
                torch.testing.assert_close(tensor(a[kind][name]), tensor(e[kind][name]),
                                           **tolerance,
                                           msg=lambda m: f'step {step} {kind} {name}: {m}')


@pytest.fixture(scope='module')
def two_ranks(backend: str) -> List[Dict[str, Result]]:
    return run_distributed(train_pipelines, FAST_TWO_RANKS, timeout=150, backend=backend)


@pytest.fixture(scope='module')
def two_ranks_rest(backend: str) -> List[Dict[str, Result]]:
    rest = [c for c in TWO_RANKS if c not in FAST_TWO_RANKS]
    return run_distributed(train_pipelines, rest, timeout=150, backend=backend)


@pytest.fixture(scope='module')
def three_ranks(backend: str) -> List[Dict[str, Result]]:
    return run_distributed(train_pipelines, THREE_RANKS, world_size=3, timeout=150,
                           backend=backend)


@pytest.fixture(scope='module')
def virtual(backend: str) -> List[Dict[str, Result]]:
    return run_distributed(train_pipelines, VIRTUAL, timeout=150, backend=backend)


# The grids run the lines of the smaller tests again and again: untraced.
@pytest.mark.unmeasured
@pytest.mark.parametrize('config', FAST_TWO_RANKS + [
    pytest.param(c, marks=pytest.mark.slow)
    for c in [c for c in TWO_RANKS if c not in FAST_TWO_RANKS] + THREE_RANKS + VIRTUAL],
    ids=lambda c: c.id)
def test_the_same_as_one_process_and_the_unwrapped_model(request: pytest.FixtureRequest,
                                                         config: Config, backend: str) -> None:
    # Only the group of this configuration runs (the fast tier runs a part of two ranks').
    ranks: List[Dict[str, Result]] = request.getfixturevalue(
        'virtual' if config in VIRTUAL else 'three_ranks' if len(config.balance) == 3 else
        'two_ranks' if config in FAST_TWO_RANKS else 'two_ranks_rest')
    actual = merge([r[config.id] for r in ranks])
    ranks_of = config.ranks(len(ranks))
    tied_across = config.model == 'tied' and ranks_of[0] != ranks_of[-1]
    if tied_across:
        # The copies of the two ranks are one parameter, bit for bit ...
        for step in actual['snapshots']:
            for kind in ('grads', 'params'):
                assert step[kind]['0.weight'] == step[kind]['5.weight']
    for threads in (False, True):
        # ... whose gradient is the one process's, bit for bit: both add the
        # partitions' shares in their order (torchgpipe.foundation.tied.shares_apart).
        # GPUs round as the CPU does not.
        assert_equal(actual, one_process(config, threads, len(ranks)), exact=backend == 'gloo')
    if config.model != 'batchnorm':  # statistics per micro-batch in a pipeline
        assert_equal(actual, unwrapped(config), exact=False)


# --- many layouts of skips ---------------------------------------------------------------


def random_layout(seed: int) -> Config:
    """A random stack of linear layers and skips (nested, crossed, anywhere), cut for 3 ranks."""
    rng = random.Random(seed)
    layers = ['linear'] * rng.randint(3, 6)
    for k in range(rng.randint(1, 3)):
        a = rng.randint(0, len(layers))
        layers.insert(a, f'stash{k}')
        layers.insert(rng.randint(a + 1, len(layers)), f'pop{k}')
    cuts = sorted(rng.sample(range(1, len(layers)), 2))
    balance = (cuts[0], cuts[1] - cuts[0], len(layers) - cuts[1])
    return Config(' '.join(layers), balance, rng.choice(['1f1b', 'fill_drain']),
                  rng.choice(CHECKPOINT_MODES))


def layered(spec: str) -> nn.Sequential:
    torch.manual_seed(0)
    namespaces: Dict[str, Namespace] = {}
    layers: List[nn.Module] = []
    for word in spec.split():
        ns = namespaces.setdefault(word[-1], Namespace())
        layers.append(nn.Linear(FEATURES, FEATURES) if word == 'linear' else
                      Stash().isolate(ns) if word.startswith('stash') else PopAdd().isolate(ns))
    return nn.Sequential(*layers).double()


LAYOUTS = [random_layout(seed) for seed in range(16)]


@pytest.fixture(scope='module')
def layouts(backend: str) -> List[Dict[str, Result]]:
    return run_distributed(train_pipelines, LAYOUTS, world_size=3, timeout=150, backend=backend)


@pytest.mark.slow
@pytest.mark.unmeasured
@pytest.mark.parametrize('config', LAYOUTS, ids=lambda c: c.id)
def test_any_layout_of_skips_across_three_ranks(layouts: List[Dict[str, Result]],
                                                config: Config, backend: str) -> None:
    assert_equal(merge([r[config.id] for r in layouts]), one_process(config, False),
                 exact=backend == 'gloo')


# --- messages at their exact sizes -----------------------------------------------------


def recorded_operations(rank: int, world_size: int) -> List[List[Any]]:
    """Each step's tensor operations (not words) of this rank: its kind, the
    other rank, each tensor's type and shape. Steps 0-2 have one batch size,
    3-4 another; the model passes skips across the ranks."""
    import torchgpipe.transport.channels as channels
    # The wire goes through torch alone: Tensor.numpy() needs numpy, which
    # torch does not require.
    def no_numpy(self: Tensor, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError('Tensor.numpy() called')
    torch.Tensor.numpy = no_numpy  # type: ignore[method-assign]
    steps: List[List[Any]] = []
    started = channels.operations

    def recorded(op: Any, tensors: List[Tensor], other: int, group: Any, tag: int) -> Any:
        if tag % 2 == 0:  # tensors, not words
            steps[-1].extend((op.__name__, other, str(t.dtype), list(t.shape)) for t in tensors)
        return started(op, tensors, other, group, tag)
    channels.operations = recorded  # type: ignore[assignment]
    pipe = DistributedGPipe(model('unet'), [5, 5], chunks=CHUNKS)
    for step, size in enumerate([BATCH] * 3 + [BATCH // 2] * 2):
        steps.append([])
        pipe.train_step(*batch(step, size), F.mse_loss)
    return steps


def test_tensors_go_at_their_exact_sizes_with_headers_only_for_new_shapes() -> None:
    ranks = run_distributed(recorded_operations, timeout=150)
    def headers(step: List[Any]) -> List[Any]:
        return [op for op in step if op[2] == 'torch.int64']  # a header's length

    def tensors(step: List[Any]) -> List[Any]:  # of the model (a step's end: uint8)
        return sorted(op for op in step if op[2] == 'torch.float64')
    for rank, steps in enumerate(ranks):
        # The first step of each batch size sends a header (its length and its
        # bytes) before each message; the next ones, the same tensors without.
        for first, later in ((0, 1), (0, 2), (3, 4)):
            assert headers(steps[first]) and not headers(steps[later]), rank
            assert tensors(steps[first]) == tensors(steps[later]), rank
        assert tensors(steps[1]) != tensors(steps[4])
    # Every tensor sent is received into a buffer of its type and shape.
    for step in range(5):
        for rank, other in ((0, 1), (1, 0)):
            sent = sorted(op[2:] for op in ranks[rank][step] if op[0] == 'isend')
            received = sorted(op[2:] for op in ranks[other][step] if op[0] == 'irecv')
            assert sent == received and sent, (step, rank)


class Signal(nn.Module):
    """The identity; once armed, sets ``'forward'`` in ``store`` as it runs."""

    def __init__(self, store: Any) -> None:
        super().__init__()
        self.store, self.armed = store, False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            self.store.set('forward', '')
        return x


def signalled() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), Signal(None),
                         nn.Linear(FEATURES, FEATURES)).double()


def first_rank_ahead(rank: int, world_size: int) -> List[float]:
    """Rank 1 calls its second step only once rank 0's first partition has run in it;
    returns the losses."""
    store = dist.TCPStore('127.0.0.1', 0, None, True, wait_for_workers=False) \
        if rank == 0 else None
    ports: List[Any] = [None] * world_size
    dist.all_gather_object(ports, store.port if store else None)
    store = store or dist.TCPStore('127.0.0.1', ports[0], None, False, wait_for_workers=False)
    layers = signalled()
    layers[1].store = store
    pipe = DistributedGPipe(layers, [2, 1], chunks=CHUNKS)
    losses = [float(pipe.train_step(*batch(0), F.mse_loss))]
    layers[1].armed = True
    if rank == 1:  # a timeout here: rank 0 waited for this rank's word to compute
        store.wait(['forward'], timedelta(seconds=20))
    return losses + [float(pipe.train_step(*batch(1), F.mse_loss))]


def test_the_first_rank_computes_before_the_others_call_the_step() -> None:
    plain = signalled()
    with torch.no_grad():
        expected = [float(F.mse_loss(plain(x), y)) for x, y in map(batch, (0, 1))]
    for losses in run_distributed(first_rank_ahead, timeout=GLOO_TIMEOUT):
        assert losses == pytest.approx(expected, rel=1e-12)


def refused_operations(rank: int, world_size: int) -> List[List[Any]]:
    """The tensor operations of a step the ranks refuse (rank 1 runs another schedule),
    where rank 0 computes before it reads rank 1's word, then of the step they agree on."""
    import torchgpipe.transport.channels as channels
    steps: List[List[Any]] = [[]]
    started = channels.operations

    def recorded(op: Any, tensors: List[Tensor], other: int, group: Any, tag: int) -> Any:
        if tag % 2 == 0:  # tensors, not words
            steps[-1].extend(op.__name__ for _ in tensors)
        return started(op, tensors, other, group, tag)
    channels.operations = recorded  # type: ignore[assignment]
    pipe = DistributedGPipe(model('mlp'), [3, 2], chunks=CHUNKS)
    pipe.train_step(*batch(0), F.mse_loss)  # a step of this signature run before
    steps[:] = [[]]
    with pytest.raises(torchgpipe.distributed.Mismatch, match='run different steps'):
        pipe.train_step(*batch(0), F.mse_loss, schedule='fill_drain' if rank else '1f1b')
    steps.append([])
    pipe.train_step(*batch(0), F.mse_loss)
    return steps


def test_a_refused_step_sends_no_message() -> None:
    for refused, agreed in run_distributed(refused_operations, timeout=GLOO_TIMEOUT):
        assert refused == [] and 'isend' in agreed and 'irecv' in agreed


def word_operations(rank: int, world_size: int) -> List[List[str]]:
    """The operations of each of three steps on the words' tag, in order."""
    import torchgpipe.transport.channels as channels
    steps: List[List[str]] = []
    started = channels.operations

    def recorded(op: Any, tensors: List[Tensor], other: int, group: Any, tag: int) -> Any:
        if tag == 1:
            steps[-1].extend(op.__name__ for _ in tensors)
        return started(op, tensors, other, group, tag)
    channels.operations = recorded  # type: ignore[assignment]
    pipe = DistributedGPipe(model('mlp'), [3, 2], chunks=CHUNKS)
    for step in range(3):
        steps.append([])
        pipe.train_step(*batch(step), F.mse_loss)
    return steps


@pytest.mark.slow
def test_a_step_starts_with_its_word_the_receives_of_the_next_posted_in_the_one_before() -> None:
    for first, *later in run_distributed(word_operations, timeout=GLOO_TIMEOUT):
        # The start's and the end's receives, the start, the next step's receives, the end.
        assert first == ['irecv', 'irecv', 'isend', 'irecv', 'irecv', 'isend']
        assert later == [['isend', 'irecv', 'irecv', 'isend']] * 2


# --- pipelines over the same group --------------------------------------------------------


def in_turn(rank: int, world_size: int, configs: List[Config]) -> Tuple[Dict[str, Result], int]:
    """Trains a pipeline of each config, all built first and stepped in turn; returns their
    results and how many process groups they added (torch.distributed keeps each until the
    process ends)."""
    before = len(dist.distributed_c10d._world.pg_names)
    pipes = [pipeline(config) for config in configs]
    optimizers = [torch.optim.SGD(pipe.parameters(), lr=0.1) for pipe in pipes]
    results: Dict[str, Result] = {c.id: {'losses': [], 'snapshots': []} for c in configs}
    for step in range(STEPS):
        for config, pipe, optimizer in zip(configs, pipes, optimizers):
            optimizer.zero_grad()
            loss = pipe.train_step(*batch(step), F.mse_loss, schedule=config.schedule)
            results[config.id]['losses'].append(float(loss))
            results[config.id]['snapshots'].append(snapshot(pipe))
            optimizer.step()
    return results, len(dist.distributed_c10d._world.pg_names) - before


def test_pipelines_over_the_same_group_share_two_process_groups() -> None:
    configs = [Config('mlp', (3, 2), '1f1b', 'except_last'),
               Config('unet', (5, 5), 'zb_h1', 'always'),
               Config('packed', (2, 2), 'fill_drain', 'never')]
    ranks = run_distributed(in_turn, configs)
    assert [added for _, added in ranks] == [2, 2]
    for config in configs:
        actual = merge([results[config.id] for results, _ in ranks])
        assert_equal(actual, one_process(config, threads=False, ranks=2), exact=True)


def one_rank_without_channels(rank: int, world_size: int) -> Tuple[bool, bool, float]:
    """Rank 0 finds the group's channels closed (as a rank whose step alone failed, or
    whose default group restarted), rank 1 whole: the next pipeline makes new ones on both,
    together (making a group is a collective call); one over another group has its own."""
    first = DistributedGPipe(linear_then_tanh(), [1, 1], device=rank_device())
    first.train_step(*batch(0), F.mse_loss)
    if rank == 0:
        first.core.channels.abandoned = True
    second = DistributedGPipe(linear_then_tanh(), [1, 1], device=rank_device())
    loss = float(second.train_step(*batch(0), F.mse_loss))
    other = DistributedGPipe(linear_then_tanh(), [1, 1], device=rank_device(),
                             group=dist.new_group([0, 1]))
    other.train_step(*batch(0), F.mse_loss)
    return (second.core.channels is not first.core.channels,
            other.core.channels is not second.core.channels, loss)


@pytest.mark.slow
def test_the_ranks_make_new_channels_together() -> None:
    ranks = run_distributed(one_rank_without_channels, timeout=GLOO_TIMEOUT)
    assert [renewed for renewed, _, _ in ranks] == [True, True]
    assert [apart for _, apart, _ in ranks] == [True, True]
    with torch.no_grad():
        expected = float(F.mse_loss(linear_then_tanh()(batch(0)[0]), batch(0)[1]))
    assert [loss for _, _, loss in ranks] == [expected, expected]


class StepsAnother(nn.Module):
    """Runs a step of another pipeline from inside its forward pass, on rank 0."""

    def __init__(self) -> None:
        super().__init__()
        self.other: List[DistributedGPipe] = []  # not a child

    def forward(self, x: Tensor) -> Tensor:
        if dist.get_rank() == 0:
            self.other[0].train_step(*batch(0), F.mse_loss)
        return x


def nested_step(rank: int, world_size: int) -> Tuple[str, str]:
    inner = StepsAnother()
    pipe = DistributedGPipe(nn.Sequential(inner, nn.Identity()), [1, 1], device=rank_device())
    inner.other.append(DistributedGPipe(linear_then_tanh(), [1, 1], device=rank_device()))
    try:
        pipe.train_step(*batch(0), F.mse_loss)
    except Exception as exc:
        return type(exc).__name__, str(exc)
    raise AssertionError('the step ran a step of another pipeline over its connections')


@pytest.mark.slow
def test_a_step_within_a_step_over_the_same_group_is_refused() -> None:
    # Its messages would take the outer step's: they share the connections.
    (kind, message), (other_kind, _) = run_distributed(nested_step, timeout=GLOO_TIMEOUT)
    assert kind == 'RuntimeError'
    assert message.startswith('another pipeline over the same group is running a step')
    assert other_kind == 'PeerFailed'


# --- pipeline x data parallelism ----------------------------------------------------------


GRID = Config('unet', (5, 5), '1f1b', 'except_last')


def train_grid(rank: int, world_size: int, config: Config = GRID) -> Result:
    """Ranks 0-1 and 2-3 are two pipelines; 0-2 and 1-3 the replicas of each partition."""
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipe = DistributedGPipe(model(config.model), config.balance, chunks=CHUNKS,
                            checkpoint=config.checkpoint, group=pipelines[rank // 2],
                            device=rank_device())
    ddp = DistributedDataParallel(pipe, process_group=replicas[rank % 2])
    shard = slice((rank // 2) * BATCH, (rank // 2 + 1) * BATCH)

    def step(input: Tensor, target: Tensor, loss_fn: Any, schedule: str) -> Tensor:
        return torchgpipe.distributed.train_step(ddp, input[shard], target[shard], loss_fn,
                                                 schedule=schedule)
    return train(pipe, config, step, 2 * BATCH)


def assert_grid_trains_as_unwrapped(ranks: List[Result], config: Config) -> None:
    """Every rank of :func:`train_grid` holds the unwrapped model's gradients and parameters.

    The reference: the unwrapped model on the whole global batch of both
    pipelines (the mean of the two shards' mean losses is its mean loss).
    """
    plain = model(config.model)
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(plain(batch(step, 2 * BATCH)[0]), batch(step, 2 * BATCH)[1]).backward()
        expected = snapshot(plain)
        for result in ranks:  # both replicas of a partition hold the averages
            for kind in ('grads', 'params'):
                for name, value in result['snapshots'][step][kind].items():
                    torch.testing.assert_close(torch.tensor(value),
                                               torch.tensor(expected[kind][name]), **TOLERANCE,
                                               msg=lambda m, name=name: f'{name}: {m}')
        optimizer.step()


@pytest.mark.slow
def test_pipelines_replicated_over_a_second_dimension_of_ranks(backend: str) -> None:
    assert_grid_trains_as_unwrapped(run_distributed(train_grid, world_size=4, timeout=150,
                                                    backend=backend), GRID)


# --- faults -------------------------------------------------------------------------------


class Boom(RuntimeError):
    pass


class Fault(nn.Module):
    """Fails on rank ``rank`` at its ``at``-th forward (or backward) pass, counted from 0.

    ``how``: ``'forward'`` or ``'backward'`` raises :class:`Boom`, ``'kill'``
    kills the process (SIGKILL) in the forward pass, ``'stop'`` stops it (SIGSTOP).
    """

    def __init__(self, rank: int, at: int, how: str) -> None:
        super().__init__()
        self.rank, self.at, self.how = rank, at, how
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        if self.rank < 0 or dist.get_rank() != self.rank:  # -1: never fails
            return x
        self.calls += 1
        if self.calls - 1 != self.at:
            return x
        if self.how in ('kill', 'stop'):
            os.kill(os.getpid(), signal.SIGKILL if self.how == 'kill' else signal.SIGSTOP)
        if self.how == 'forward':
            raise Boom('boom in a forward pass')
        return RaiseInBackward.apply(x, Boom('boom in a backward pass'))


def faulty(rank: int, at: int, how: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), Fault(rank, at, how),
                         nn.Linear(FEATURES, FEATURES), Fault(rank, at, how)).double()


def fail_once(rank: int, world_size: int, fault_rank: int, how: str,
              checkpoints: Optional[str]) -> Result:
    """Trains until a step fails (the second); returns what each rank raised, and then,
    alone and under DDP (each rank its own replica)."""
    alone = [dist.new_group([r]) for r in range(world_size)]
    # Over the same group: it shares the failing pipeline's connections.
    bystander = DistributedGPipe(linear_then_tanh(), [1, 1], device=rank_device())
    # The third micro-batch of the second step (no recomputation: one call each).
    pipe = DistributedGPipe(faulty(fault_rank, CHUNKS + 2, how), [2, 2], chunks=CHUNKS,
                            checkpoint='never', device=rank_device())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)

    def loss_fn(output: Tensor, target: Tensor) -> Tensor:
        if how == 'loss' and step == 1:
            raise Boom('boom in loss_fn')
        return F.mse_loss(output, target)

    for step in range(2):
        optimizer.zero_grad()
        if step == 1 and checkpoints:
            torch.save({'model': pipe.state_dict(), 'optimizer': optimizer.state_dict()},
                       Path(checkpoints) / f'rank{rank}.pt')
        try:
            pipe.train_step(*batch(step), loss_fn)
        except BaseException as exc:
            error = (type(exc).__name__, str(exc))
            break
        optimizer.step()
    else:
        raise AssertionError('no step failed')
    try:
        pipe.train_step(*batch(0), F.mse_loss)
    except RuntimeError as exc:
        after = str(exc)
    try:
        torchgpipe.distributed.train_step(DistributedDataParallel(pipe, process_group=alone[rank]),
                                          *batch(0), F.mse_loss)
    except RuntimeError as exc:
        after_ddp = str(exc)
    try:
        bystander.train_step(*batch(0), F.mse_loss)
    except RuntimeError as exc:
        after_bystander = str(exc)
    result = {'error': error, 'after': after, 'after_ddp': after_ddp,
              'after_bystander': after_bystander}
    if how not in ('kill', 'stop'):  # (every rank alive) a pipeline built next has
        # connections of its own, whole.
        fresh = DistributedGPipe(linear_then_tanh(), [1, 1], device=rank_device())
        result['fresh'] = float(fresh.train_step(*batch(0), F.mse_loss))
    return result


@pytest.mark.parametrize('fault_rank, how', [(1, 'forward')] + [  # (the fast tier: one)
    pytest.param(r, h, marks=pytest.mark.slow) for r, h in [(0, 'backward'), (1, 'loss')]])
def test_a_rank_that_fails_makes_every_rank_raise(fault_rank: int, how: str,
                                                  backend: str) -> None:
    results = run_distributed(fail_once, fault_rank, how, None, timeout=GLOO_TIMEOUT,
                              backend=backend)
    for rank, result in enumerate(results):
        kind, message = result['error']
        if rank == fault_rank:
            assert kind == 'Boom', message  # its own error, unchanged
        else:
            assert kind == 'PeerFailed'
            assert message.startswith(f'rank {fault_rank} (partition {fault_rank}) failed: '
                                      f'Boom: boom in ')
        # No second chance: the ranks no longer agree on the messages left.
        assert result['after'].startswith('an earlier step failed')
        assert result['after_ddp'] == result['after']
        assert result['after_bystander'].startswith('an earlier step failed (a step of a '
                                                    'pipeline over the same group')
        with torch.no_grad():
            expected = F.mse_loss(linear_then_tanh()(batch(0)[0]), batch(0)[1])
        # (GPUs round as the CPU does not.)
        assert result['fresh'] == pytest.approx(float(expected), abs=0 if backend == 'gloo'
                                                else 1e-12)


@pytest.mark.slow
def test_a_killed_rank_makes_the_others_raise() -> None:
    # The deadline is below gloo's timeout: the connection's end is noticed.
    results = run_distributed(fail_once, 1, 'kill', None, timeout=GLOO_TIMEOUT - 10, dies=[1])
    kind, message = results[0]['error']
    assert kind == 'PeerFailed'
    # Rank 1 dies in its forward pass of micro-batch 2, as rank 0 computes
    # 0B1 and 0F3: rank 0 meets the closed connection waiting for a gradient,
    # or sending the input of micro-batch 3, whichever comes first (gloo
    # refuses a send once it has seen the connection close).
    assert re.match(r'lost rank 1 \(partition 1\) while (waiting for the gradient of the '
                    r'output of micro-batch \d|sending it a message)', message), message
    assert results[1] is None


def killed_between_steps(rank: int, world_size: int) -> Result:
    """Rank 1 dies after a step; rank 0 then starts the next one, sending first."""
    pipe = DistributedGPipe(faulty(-1, 0, 'forward'), [2, 2], chunks=CHUNKS, checkpoint='never')
    pipe.train_step(*batch(0), F.mse_loss)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    # Not a condition of the test (the step must raise PeerFailed either way),
    # but what makes its first send, rather than a receive, meet the closed
    # connection: rank 1 dies within this second.
    time.sleep(1)
    try:
        pipe.train_step(*batch(1), F.mse_loss)
    except BaseException as exc:
        return {'error': (type(exc).__name__, str(exc))}
    raise AssertionError('the step ran without rank 1')


@pytest.mark.slow
def test_a_rank_killed_between_steps_makes_the_next_step_raise_peer_failed() -> None:
    results = run_distributed(killed_between_steps, timeout=GLOO_TIMEOUT - 10, dies=[1])
    kind, message = results[0]['error']
    assert kind == 'PeerFailed', message
    assert message.startswith('lost rank 1 (partition 1) while '), message
    assert results[1] is None


def linear_then_tanh() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh()).double()


def without_parameters_on_rank_1(rank: int, world_size: int) -> Result:
    """Rank 1 keeps only the Tanh: it is warned, and the documented recipe trains."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        pipe = DistributedGPipe(linear_then_tanh(), [1, 1], chunks=CHUNKS)
    parameters = list(pipe.parameters())
    optimizer = torch.optim.SGD(parameters, lr=0.1) if parameters else None
    for step in range(STEPS):
        if optimizer is not None:
            optimizer.zero_grad()
        pipe.train_step(*batch(step), F.mse_loss)
        if optimizer is not None:
            optimizer.step()
    return {'warnings': [str(w.message) for w in caught], **snapshot(pipe)}


@pytest.mark.slow
def test_a_rank_without_parameters_is_warned_and_the_recipe_trains() -> None:
    ranks = run_distributed(without_parameters_on_rank_1)
    assert ranks[0]['warnings'] == []
    warned, = ranks[1]['warnings']
    assert warned.startswith('rank 1 of the pipeline holds no parameters (its layers: 1): '
                             'torch.optim refuses an empty parameter list'), warned
    assert ranks[1]['params'] == {}
    plain = linear_then_tanh()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(plain(batch(step)[0]), batch(step)[1]).backward()
        optimizer.step()
    expected = snapshot(plain)['params']
    assert ranks[0]['params'].keys() == expected.keys()
    for name, value in expected.items():
        # Gradients summed micro-batch by micro-batch: float rounding apart.
        torch.testing.assert_close(torch.tensor(ranks[0]['params'][name]), torch.tensor(value),
                                   msg=name)


def resume(rank: int, world_size: int, checkpoints: str) -> Result:
    """Starts again from the checkpoint of every rank, as a restarted job would."""
    state: Dict[str, Any] = {}
    for path in sorted(Path(checkpoints).glob('rank*.pt')):
        state.update(torch.load(path)['model'])  # the unwrapped model's whole state dict
    pipe = DistributedGPipe(faulty(-1, 0, 'forward'), [2, 2], chunks=CHUNKS, checkpoint='never')
    pipe.load_state_dict(state)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    optimizer.load_state_dict(torch.load(Path(checkpoints) / f'rank{rank}.pt')['optimizer'])
    pipe.train_step(*batch(1), F.mse_loss)
    optimizer.step()
    return snapshot(pipe)


@pytest.mark.slow
def test_a_failed_job_restarts_from_its_checkpoint(tmp_path: Path) -> None:
    run_distributed(fail_once, 1, 'forward', str(tmp_path), timeout=GLOO_TIMEOUT)
    ranks = run_distributed(resume, str(tmp_path), timeout=GLOO_TIMEOUT)
    plain = faulty(-1, 0, 'forward')
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(2):
        optimizer.zero_grad()
        F.mse_loss(plain(batch(step)[0]), batch(step)[1]).backward()
        optimizer.step()
    expected = snapshot(plain)
    for kind in ('grads', 'params'):
        actual = {**ranks[0][kind], **ranks[1][kind]}
        assert actual.keys() == expected[kind].keys()
        for name in expected[kind]:
            torch.testing.assert_close(torch.tensor(actual[name]),
                                       torch.tensor(expected[kind][name]), **TOLERANCE)


# --- bad use ------------------------------------------------------------------------------


def test_torch_distributed_must_be_initialized_first() -> None:
    with pytest.raises(RuntimeError, match=r'DistributedGPipe needs torch.distributed: call '
                       r"torch.distributed.init_process_group\('gloo'\)"):
        DistributedGPipe(model('mlp'), [3, 2])


def refusals(rank: int, world_size: int) -> List[str]:
    # Two layers of two ranks sharing a buffer: parameters only may be tied.
    first, shared = nn.BatchNorm1d(FEATURES), nn.BatchNorm1d(FEATURES)
    shared.running_mean = first.running_mean
    attempts = [
        lambda: DistributedGPipe(model('mlp'), [1, 1, 3]),
        lambda: DistributedGPipe(nn.Sequential(first, nn.Tanh(), shared), [2, 1]),
        lambda: DistributedGPipe(model('mlp'), [3, 2], placement='v'),
        lambda: DistributedGPipe(model('mlp'), [3, 2], placement='ring'),
        lambda: DistributedGPipe(model('mlp'), [3, 2], device='gpu'),
        lambda: DistributedGPipe(model('mlp'), [3, 2], checkpoint='sometimes'),
        lambda: DistributedGPipe(model('mlp'), [3, 2], timeout=0),
        lambda: DistributedGPipe(model('mlp'), [3, 2], timeout='1h'),  # type: ignore[arg-type]
    ]
    alone = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group
    attempts.append(lambda: DistributedGPipe(model('mlp'), [5], group=alone[1 - rank]))
    pipe = DistributedGPipe(model('mlp'), [3, 2])
    attempts += [lambda: pipe(batch(0)[0]), lambda: copy.deepcopy(pipe),
                 lambda: pickle.dumps(pipe)]
    # A V's schedule on partitions laid out in a loop: refused before any message.
    looped = DistributedGPipe(model('mlp'), [2, 1, 1, 1])
    attempts.append(lambda: looped.train_step(*batch(0), F.mse_loss, schedule='zbv'))
    messages = []
    for attempt in attempts:
        try:
            attempt()
        except (TypeError, ValueError) as exc:
            messages.append(f'{type(exc).__name__}: {exc}')
    return messages


def test_bad_arguments_are_refused_before_any_message() -> None:
    messages = run_distributed(refusals, timeout=GLOO_TIMEOUT)[0]
    assert messages == [
        'ValueError: balance must give each rank of the group as many partitions (balance: '
        '[1, 1, 3], ranks: 2); give 2 numbers of layers (or a multiple of 2), or run 3 '
        'processes',
        'ValueError: a buffer, or a layer with parameters or buffers, cannot be in two '
        "partitions ('0.running_mean' of partition 0 is '2.running_mean' of partition 1); "
        'change the balance to put the layers sharing it in one partition; across '
        'partitions, layers can share parameters only',
        "ValueError: placement='v' needs two partitions per rank of the group (balance: "
        "[3, 2], ranks: 2); give 4 numbers of layers",
        "ValueError: placement must be 'loop' or 'v' (placement: 'ring'); use "
        "placement='loop' (partition j on rank j % size), or 'v' (rank r keeps partitions r "
        "and 2 size - 1 - r)",
        "ValueError: device is not a valid device (device: 'gpu'); give this process's "
        "device, such as device='cpu'",
        "ValueError: checkpoint is not one of 'always', 'except_last', or 'never'",
        "ValueError: timeout must be positive (timeout: 0); give seconds, e.g. timeout=600, "
        "or None for the process group's",
        "TypeError: timeout must be a number of seconds, or None (timeout: '1h'); give "
        "seconds, e.g. timeout=600",
        'ValueError: this process must be in group (rank 0); build the DistributedGPipe only '
        'on the ranks of its group, giving each rank its own pipeline group',
        'TypeError: a DistributedGPipe is not called: train it with train_step(input, '
        'target, loss_fn), and evaluate it with eval_step(input), on every rank',
    ] + ['TypeError: a DistributedGPipe belongs to its processes and cannot be copied or '
         'pickled; save its state_dict() instead, which has the keys of the unwrapped '
         'module'] * 2 + [
        "ValueError: schedule 'zbv' runs partitions [0, 3] on one worker, but they are on "
        "['rank 0', 'rank 1']; lay the partitions over the ranks as it does: placement='v' "
        "for 'zbv', 'loop' for the others"]


def on_meta(rank: int, world_size: int) -> Tuple[str, str, float, float, float]:
    """A model built on the meta device: a step refused until this rank materializes its
    layers, another device refused; trained once loaded. Trained too where only other
    ranks' layers are there (a rank never places theirs)."""
    with torch.device('meta'):
        shapes_only = model('mlp')
    real = model('mlp')
    input, target = batch(0)
    pipe = DistributedGPipe(shapes_only, [3, 2], chunks=2)
    try:
        pipe.train_step(input, target, F.mse_loss)
        refused = ''
    except ValueError as exc:
        refused = str(exc)
    try:
        pipe.to_empty(device='meta')
        elsewhere = ''
    except ValueError as exc:
        elsewhere = str(exc)
    pipe.to_empty()
    pipe.load_state_dict(real.state_dict())
    loaded = float(pipe.train_step(input, target, F.mse_loss))
    with torch.device('meta'):
        ends_tied = tied()
    v = DistributedGPipe(ends_tied, [2, 1, 1, 2], placement='v')  # both ends on rank 0
    v.to_empty()  # (Module.to_empty would give each end a weight of its own)
    assert rank == 1 or v.get_submodule('0').weight is v.get_submodule('5').weight
    mine = range(3) if rank == 0 else range(3, 5)
    with torch.device('meta'):
        shapes_only = model('mlp')
    for index in mine:
        shapes_only[index] = real[index]
    pipe = DistributedGPipe(shapes_only, [3, 2], chunks=2)
    loss = pipe.train_step(input, target, F.mse_loss)
    return refused, elsewhere, loaded, float(loss), float(F.mse_loss(real(input), target))


@pytest.mark.slow
def test_a_model_on_the_meta_device_trains_once_each_rank_materializes_its_layers() -> None:
    ranks = run_distributed(on_meta, timeout=GLOO_TIMEOUT)
    first_layer = {0: '0', 1: '4'}  # the first with parameters of each rank's partition
    for rank, (refused, elsewhere, loaded, loss, expected) in enumerate(ranks):
        assert refused == (
            'the layers must hold data to run a step '
            f"('{first_layer[rank]}.weight' on the meta device); materialize this rank's "
            'layers first: pipe.to_empty(), then initialize them (reset_parameters(), or '
            'load a state dict or a DCP checkpoint)')
        assert elsewhere == ("a pipeline's layers are materialized on its device (device: "
                             "'meta', the pipeline on cpu); leave device out")
        assert loaded == pytest.approx(expected, rel=1e-12)
        assert loss == pytest.approx(expected, rel=1e-12)

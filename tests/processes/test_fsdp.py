"""FSDP2 units in the partitions of a DistributedGPipe: the pipeline over one dimension of a
DeviceMesh, ``fully_shard`` over the other. Each step reduces each unit's gradients once and
gathers its parameters once (counted), and the gradients are the unwrapped model's on the
global batch."""
import itertools
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import rank_device, run_distributed
from torchgpipe.distributed import DistributedGPipe

pytest.importorskip('torch.distributed.fsdp', reason='FSDP2 (fully_shard) needs torch 2.4')

FEATURES = 8
BATCH = 16
CHUNKS = 4
STEPS = 2
#: A schedule of a user's: every weight's gradient (W) after every input's (I).
USERS = ('0F0 0F1 0F2 0F3 0I0 0I1 0I2 0I3 0W3 0W2 0W1 0W0\n'
         '1F0 1I0 1F1 1I1 1F2 1I2 1F3 1I3 1W0 1W1 1W2 1W3')
#: (schedule, checkpoint, balance, placement, the norm to clip by after the second step)
CONFIGS = [(s, c, [2, 2], 'loop', n) for (s, c), n in zip(
    itertools.product(['1f1b', 'fill_drain', 'zb_h1'], ['always', 'except_last', 'never']),
    itertools.cycle([2.0, 1.0, float('inf')]))] + [
    # Two partitions a rank, in a loop or a V: each partition's units reduce after its own
    # last backward pass.
    ('interleaved_1f1b', 'except_last', [1, 1, 1, 1], 'loop', 2.0),
    ('zbv', 'always', [1, 1, 1, 1], 'v', float('inf')),
    (USERS, 'never', [2, 2], 'loop', 1.0)]
COLLECTIVES = ('reduce_scatter_single', 'all_gather_single')
MAX_NORM = 0.1


def model(nested: bool = False) -> nn.Sequential:
    """Four linear layers, or (``nested``) two blocks of two."""
    torch.manual_seed(0)
    linears = [nn.Linear(FEATURES, FEATURES) for _ in range(4)]
    if nested:
        return nn.Sequential(nn.Sequential(*linears[:2]), nn.Sequential(*linears[2:])).double()
    return nn.Sequential(*linears).double()


def batch(step: int) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, FEATURES, generator=gen, dtype=torch.float64))


@contextmanager
def counting(counts: Dict[str, int]) -> Iterator[None]:
    """Counts the collectives FSDP2 reduces and gathers with, into ``counts``."""
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counted(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return real[name](*args, **kwargs)
        return call
    for name in COLLECTIVES:
        setattr(dist, name, counted(name))
    try:
        yield
    finally:
        for name in COLLECTIVES:
            setattr(dist, name, real[name])


def sharded_steps(rank: int, world_size: int) -> Dict[str, Any]:
    """Every configuration on a mesh of pp 2 x dp 2: each step's collectives, counted, and
    the gradients of this rank's layers after each step, whole; the second step's clipped
    by their norm, and that norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    device = rank_device()
    mesh = init_device_mesh(device.type, (2, 2), mesh_dim_names=('pp', 'dp'))
    here = mesh.get_local_rank('dp')
    shard = slice(here * BATCH // 2, (here + 1) * BATCH // 2)
    results: Dict[str, Any] = {}
    for n, (schedule, checkpoint, balance, placement, norm_type) in enumerate(CONFIGS):
        pipe = DistributedGPipe(model(), balance, chunks=CHUNKS, checkpoint=checkpoint,
                                placement=placement, group=mesh['pp'].get_group(),
                                device=device)
        for layer in pipe.children():
            fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
        steps = []
        for step in range(STEPS):
            pipe.zero_grad()
            counts: Dict[str, int] = {}
            input, target = (x.to(device) for x in batch(step))
            with counting(counts):
                pipe.train_step(input[shard], target[shard], F.mse_loss, schedule=schedule)
            norm = float(pipe.clip_grad_norm_(MAX_NORM, norm_type)) if step else None
            steps.append({'counts': counts, 'norm': norm, 'grads': {
                name: p.grad.full_tensor().tolist() for name, p in pipe.named_parameters()}})
        results[str(n)] = steps
    return results


@pytest.mark.slow  # four processes
@pytest.mark.parametrize('backend', ['gloo', pytest.param('nccl', marks=pytest.mark.cuda)])
def test_each_unit_reduces_and_gathers_once_per_step_with_the_unwrapped_gradients(
        backend: str) -> None:
    # On NCCL (skipped without 4 GPUs), the same calls on a 'cuda' mesh, a GPU per rank.
    ranks = run_distributed(sharded_steps, world_size=4, timeout=200, backend=backend)
    for n, (schedule, checkpoint, _, _, norm_type) in enumerate(CONFIGS):
        for step in range(STEPS):
            plain = model()
            F.mse_loss(plain(batch(step)[0]), batch(step)[1]).backward()
            norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM, norm_type) \
                if step else None
            assert norm is None or norm > MAX_NORM  # so the clipping changes the gradients
            expected = {name: p.grad for name, p in plain.named_parameters()}
            for rank, results in enumerate(ranks):
                got = results[str(n)][step]
                where = (schedule, checkpoint, rank, step)
                # Two units (layers) a rank: one reduction and one gathering each, not one
                # per micro-batch (8 of each, left alone).
                assert got['counts'] == {name: 2 for name in COLLECTIVES}, where
                if norm is not None:
                    torch.testing.assert_close(torch.tensor(got['norm'], dtype=torch.float64), norm,
                                               rtol=1e-12, atol=0)
                for name, grad in got['grads'].items():
                    torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64),
                                               expected[name], rtol=1e-12, atol=1e-15,
                                               msg=lambda m: f'{where} {name}: {m}')


def mixed_precision(rank: int, world_size: int) -> Dict[str, Any]:
    """A step of float32 layers sharded with bfloat16 parameters and float32 reduction: the
    dtype the layers computed in, the collectives, and the gradients, whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    here = mesh.get_local_rank('dp')
    shard = slice(here * BATCH // 2, (here + 1) * BATCH // 2)
    pipe = DistributedGPipe(model().float(), [2, 2], chunks=CHUNKS,
                            group=mesh['pp'].get_group())
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    computed = set()
    for layer in pipe.children():
        fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False, mp_policy=policy)
        layer.register_forward_hook(lambda m, i, o: computed.add(str(o.dtype)))
    input, target = batch(0)
    counts: Dict[str, int] = {}
    with counting(counts):
        pipe.train_step(input[shard].float(), target[shard].float(), F.mse_loss)
    return {'computed': computed, 'counts': counts, 'grads': {
        name: (str(p.grad.dtype), p.grad.full_tensor().tolist())
        for name, p in pipe.named_parameters()}}


@pytest.mark.slow  # four processes
def test_mixed_precision_computes_in_bfloat16_and_reduces_once(
        scenarios: List[Dict[str, Any]]) -> None:
    plain = model().float()
    input, target = batch(0)
    F.mse_loss(plain(input.float()), target.float()).backward()
    for got in (ranks['mixed'] for ranks in scenarios):
        assert got['computed'] == {'torch.bfloat16'}
        assert got['counts'] == {name: 2 for name in COLLECTIVES}
        for name, (dtype, grad) in got['grads'].items():
            assert dtype == 'torch.float32'
            # bfloat16 keeps 8 bits of mantissa: close to float32's, not equal.
            torch.testing.assert_close(torch.tensor(grad), plain.get_parameter(name).grad,
                                       rtol=2e-2, atol=2e-3)


#: (schedule, checkpoint, balance) of units resharded after forward passes.
RESHARDED = [('1f1b', 'never', [2, 2]), ('1f1b', 'always', [2, 2]),
             ('fill_drain', 'except_last', [2, 2]), ('zb_h1', 'always', [2, 2]),
             ('interleaved_1f1b', 'never', [1, 1, 1, 1]), ('zbv', 'except_last', [1, 1, 1, 1])]


def resharded_after_forward(rank: int, world_size: int) -> List[Dict[str, Any]]:
    """Units resharded after forward passes, a step of each of :data:`RESHARDED`: its
    collectives, counted; whether the parameters are resharded after it; the gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    shard = slice(mesh.get_local_rank('dp') * BATCH // 2,
                  (mesh.get_local_rank('dp') + 1) * BATCH // 2)
    results = []
    for schedule, checkpoint, balance in RESHARDED:
        pipe = DistributedGPipe(model(), balance, chunks=CHUNKS, checkpoint=checkpoint,
                                placement='v' if schedule == 'zbv' else 'loop',
                                group=mesh['pp'].get_group())
        for layer in pipe.children():
            fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=True)
        counts: Dict[str, int] = {}
        input, target = batch(0)
        with counting(counts):
            pipe.train_step(input[shard], target[shard], F.mse_loss, schedule=schedule)
        results.append({
            'counts': counts,
            'resharded': all(isinstance(p, DTensor) for p in pipe.parameters()),
            'grads': {name: p.grad.full_tensor().tolist() for name, p in pipe.named_parameters()}})
    return results


@pytest.mark.slow  # four processes
def test_units_resharded_after_forward_gather_again_only_for_another_partition(
        scenarios: List[Dict[str, Any]]) -> None:
    # A rank's units free their parameters after a forward pass only where the rank runs
    # another partition next, as the parameters would be gathered again at once otherwise:
    # with a partition a rank, one gathering a unit per step, checkpointed or not.
    plain = model()
    F.mse_loss(plain(batch(0)[0]), batch(0)[1]).backward()
    for n, config in enumerate(RESHARDED):
        got = [ranks['resharded'][n] for ranks in scenarios]
        gathers = [rank['counts'].pop('all_gather_single') for rank in got]
        if len(config[2]) == 4:
            # Two one-unit partitions a rank (a loop, a V), alternating: gathered again
            # where the rank switches (left alone, once a forward pass and once for the
            # backward passes: 5 a unit), but at most once a micro-batch.
            assert max(gathers) > 2 and all(g <= 2 * CHUNKS for g in gathers), gathers
        else:
            assert gathers == [2] * len(got), (config, gathers)  # left alone: 10, 18, 16
        for rank in got:
            assert rank['counts'] == {'reduce_scatter_single': 2}, config
            assert rank['resharded'], config
            for name, grad in rank['grads'].items():
                torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64),
                                           plain.get_parameter(name).grad,
                                           rtol=1e-12, atol=1e-15)


VOCABULARY = 11


def language_model() -> nn.Sequential:
    """A causal language model in miniature: ids to logits, one position at a time."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCABULARY, FEATURES), nn.Linear(FEATURES, FEATURES),
                         nn.Tanh(), nn.Linear(FEATURES, VOCABULARY)).double()


def tokens() -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return (torch.randint(0, VOCABULARY, (BATCH, 5), generator=gen),
            torch.randint(0, VOCABULARY, (BATCH, 5), generator=gen))


def cross_entropy(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.flatten(0, 1), target.flatten())


def whole_loop(rank: int, world_size: int) -> Dict[str, Any]:
    """A user's loop on pp 2 x dp 2: a step with loss scaling, clipping and Adam; a step
    whose gradients hold an infinity on rank 0 alone; evaluation and generation."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from torchgpipe import generate
    from torchgpipe.distributed import GradScaler
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    shard = slice(mesh.get_local_rank('dp') * BATCH // 2,
                  (mesh.get_local_rank('dp') + 1) * BATCH // 2)
    pipe = DistributedGPipe(language_model(), [2, 2], chunks=2, group=mesh['pp'].get_group())
    for layer in pipe.children():
        if any(True for _ in layer.parameters()):  # not Tanh
            fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
    optimizer = torch.optim.Adam(pipe.parameters(), lr=0.01)
    scaler = GradScaler('cpu', init_scale=2.0 ** 10)
    ids, target = tokens()
    norms = []
    for step in range(2):
        optimizer.zero_grad()
        pipe.train_step(ids[shard], target[shard],
                        lambda out, tgt: scaler.scale(cross_entropy(out, tgt)))
        if step and rank == 0:
            next(pipe.parameters()).grad.to_local().view(-1)[0] = float('inf')
        scaler.unscale_(optimizer)
        norms.append(float(pipe.clip_grad_norm_(0.1)))
        scaler.step(optimizer)  # skipped on every rank at the second step
        scaler.update()

    def whole(t: torch.Tensor) -> Any:
        return (t.full_tensor() if hasattr(t, 'full_tensor') else t).tolist()
    return {'norms': norms, 'scale': scaler.get_scale(),
            'params': {name: whole(p) for name, p in pipe.named_parameters()},
            'loss': float(pipe.eval_step(ids[shard], target[shard], cross_entropy)),
            'output': whole(pipe.eval_step(ids[shard], everywhere=True)),
            'generated': generate(pipe, ids[:2, :3], 4).tolist()}


@pytest.mark.slow  # four processes
def test_the_whole_loop_on_sharded_stages(scenarios: List[Dict[str, Any]]) -> None:
    plain = language_model()
    optimizer = torch.optim.Adam(plain.parameters(), lr=0.01)
    ids, target = tokens()
    cross_entropy(plain(ids), target).backward()
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1)
    optimizer.step()
    halves = [slice(0, BATCH // 2), slice(BATCH // 2, BATCH)]
    with torch.no_grad():
        generated = ids[:2, :3]
        for _ in range(4):
            generated = torch.cat([generated, plain(generated)[:, -1:].argmax(-1)], 1)
        for rank, got in enumerate(ranks['loop'] for ranks in scenarios):
            torch.testing.assert_close(torch.tensor(got['norms'][0], dtype=torch.float64),
                                       norm, rtol=1e-12, atol=0)
            assert got['norms'][1] == float('inf')
            assert got['scale'] == 2.0 ** 9  # backed off once, on every rank
            for name, value in got['params'].items():  # one step taken, not two
                torch.testing.assert_close(torch.tensor(value, dtype=torch.float64),
                                           plain.get_parameter(name), rtol=1e-12, atol=1e-15)
            half = halves[rank % 2]
            torch.testing.assert_close(
                torch.tensor(got['loss'], dtype=torch.float64),
                cross_entropy(plain(ids[half]), target[half]), rtol=1e-12, atol=0)
            torch.testing.assert_close(torch.tensor(got['output'], dtype=torch.float64),
                                       plain(ids[half]), rtol=1e-12, atol=1e-15)
            assert got['generated'] == generated.tolist()


def built_on_meta(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """A model no rank builds whole: built on the meta device, sharded, and each rank
    materializing its own layers' shards alone, from a DCP checkpoint of the unwrapped
    model; then two steps of SGD."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                         set_model_state_dict)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    shard = slice(mesh.get_local_rank('dp') * BATCH // 2,
                  (mesh.get_local_rank('dp') + 1) * BATCH // 2)
    with torch.device('meta'):
        whole = model()
    pipe = DistributedGPipe(whole, [2, 2], chunks=CHUNKS, group=mesh['pp'].get_group())
    for layer in pipe.children():
        fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
    pipe.to_empty()
    state = get_model_state_dict(pipe)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(pipe, state)
    held = sum(p.to_local().numel() for p in pipe.parameters())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        input, target = batch(step)
        pipe.train_step(input[shard], target[shard], F.mse_loss)
        optimizer.step()
    return {'held': held, 'others': [p.is_meta for p in whole.parameters()].count(True),
            'params': {name: p.full_tensor().tolist() for name, p in pipe.named_parameters()}}


@pytest.mark.slow  # four processes
def test_a_model_built_on_the_meta_device_each_rank_holding_its_shard(
        scenarios: List[Dict[str, Any]]) -> None:
    plain = model()
    optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
    for step in range(STEPS):
        optimizer.zero_grad()
        F.mse_loss(plain(batch(step)[0]), batch(step)[1]).backward()
        optimizer.step()
    layer = FEATURES * FEATURES + FEATURES
    for got in (ranks['meta'] for ranks in scenarios):
        # Two layers a rank, each sharded in two: a quarter of the model.
        assert got['held'] == 2 * layer // 2
        assert got['others'] == 4  # the other rank's two layers' weights and biases
        for name, value in got['params'].items():
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64),
                                       plain.get_parameter(name), rtol=1e-12, atol=1e-15)


class FailsOnRank2(nn.Module):
    """Raises at its second micro-batch on rank 2."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if dist.get_rank() == 2 and self.calls == 2:
            raise ValueError('injected failure on rank 2')
        return x


def failing(rank: int, world_size: int) -> Tuple[str, str, Any]:
    """Two pipelines of two ranks ({0, 2} and {1, 3}), their layers FSDP2 units over
    data-parallel groups ({0, 1} and {2, 3}) that time out in seconds; rank 2 fails. What
    each rank raises."""
    from datetime import timedelta

    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard
    pipelines = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    replicas = [dist.new_group(r, timeout=timedelta(seconds=3)) for r in ([0, 1], [2, 3])]
    torch.manual_seed(0)
    layers = [nn.Linear(FEATURES, FEATURES) for _ in range(4)]
    pipe = DistributedGPipe(nn.Sequential(*layers[:2], FailsOnRank2(), *layers[2:]).double(),
                            [2, 3], chunks=CHUNKS, group=pipelines[rank % 2])
    for layer in pipe.children():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=DeviceMesh.from_group(replicas[rank // 2], 'cpu'),
                        reshard_after_forward=False)
    try:
        pipe.train_step(*batch(0), F.mse_loss)
    except Exception as exc:
        return type(exc).__name__, str(exc), getattr(exc, 'rank', None)
    return 'nothing', '', None


@pytest.mark.slow  # four processes, and a collective's timeout
def test_a_rank_failing_is_named_on_every_rank_of_every_pipeline() -> None:
    # Rank 0 hears it from rank 2, its pipeline's; ranks 1 and 3, of the other pipeline,
    # wait for it (or for rank 0) in a reduce-scatter until it times out, then read its word.
    said = run_distributed(failing, world_size=4, timeout=150)
    assert said[2] == ('ValueError', 'injected failure on rank 2', None)
    for rank in (0, 1, 3):
        assert said[rank] == ('PeerFailed', 'rank 2 (partition 1) failed: ValueError: '
                              'injected failure on rank 2', 2), rank


def nested_units(rank: int, world_size: int) -> Dict[str, int]:
    """A rank's one block a unit, each of its two layers a unit inside: the collectives of
    a step, counted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    pipe = DistributedGPipe(model(nested=True), [1, 1], chunks=CHUNKS,
                            group=mesh['pp'].get_group())
    for block in pipe.children():
        for layer in block:
            fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
        fully_shard(block, mesh=mesh['dp'], reshard_after_forward=False)
    counts: Dict[str, int] = {}
    with counting(counts):
        pipe.train_step(*batch(0), F.mse_loss)
    return counts


@pytest.mark.slow  # four processes
def test_nested_units_reduce_once_each(scenarios: List[Dict[str, Any]]) -> None:
    # The inner units hold the parameters; the outer one reduces them, not again each.
    for counts in (ranks['nested'] for ranks in scenarios):
        assert counts == {name: 2 for name in COLLECTIVES}


def gathered_first(rank: int, world_size: int) -> Dict[str, Any]:
    """A step of units that keep their parameters after forward passes: the order of its
    all-gathers and the layers' forward passes, and whether the units reshard after it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    pipe = DistributedGPipe(model(), [2, 2], chunks=CHUNKS, group=mesh['pp'].get_group())
    events: List[str] = []
    for layer in pipe.children():
        fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
        layer.register_forward_pre_hook(lambda *_: events.append('forward'))
    gather = dist.all_gather_single

    def logged(*args: Any, **kwargs: Any) -> Any:
        events.append('gather')
        return gather(*args, **kwargs)
    dist.all_gather_single = logged
    try:
        pipe.train_step(*batch(0), F.mse_loss)
    finally:
        dist.all_gather_single = gather
    return {'events': events[:3],
            'resharded': all(isinstance(p, DTensor) for p in pipe.parameters())}


@pytest.mark.slow  # four processes
def test_units_gather_their_parameters_as_the_step_starts(
        scenarios: List[Dict[str, Any]]) -> None:
    # Both units of a rank gather before its first forward pass, which the second's
    # gathering overlaps; they reshard after the step.
    for got in (ranks['gathered'] for ranks in scenarios):
        assert got == {'events': ['gather', 'gather', 'forward'], 'resharded': True}


def nested_by_default(rank: int, world_size: int) -> List[Dict[str, int]]:
    """Nested units on FSDP's default (the inner ones reshard after forward passes, their
    root not): the collectives of each of two steps, counted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    pipe = DistributedGPipe(model(nested=True), [1, 1], chunks=CHUNKS,
                            group=mesh['pp'].get_group())
    for block in pipe.children():
        for layer in block:
            fully_shard(layer, mesh=mesh['dp'])
        fully_shard(block, mesh=mesh['dp'])
    steps = []
    for _ in range(2):
        counts: Dict[str, int] = {}
        with counting(counts):
            pipe.train_step(*batch(0), F.mse_loss)
        steps.append(counts)
    return steps


@pytest.mark.slow  # four processes
def test_nested_units_by_default_gather_once_a_step_from_the_first(
        scenarios: List[Dict[str, Any]]) -> None:
    # The inner units, which reshard after forward passes, are not gathered ahead as the
    # first step starts (then again for its first forward pass); with one partition a
    # rank they stay gathered through the step.
    for steps in (ranks['nested_default'] for ranks in scenarios):
        assert steps == [{name: 2 for name in COLLECTIVES}] * 2


def resharded_to_a_smaller_group(rank: int, world_size: int) -> Dict[str, Any]:
    """Two partitions on one rank of each of four pipelines, their units sharded over four
    ranks and resharded to two after forward passes (``reshard_after_forward=2``): the
    gradients of a step of each schedule, whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh('cpu', (1, 4), mesh_dim_names=('pp', 'dp'))
    here = mesh.get_local_rank('dp')
    shard = slice(here * BATCH // 4, (here + 1) * BATCH // 4)
    grads = {}
    for schedule in ('interleaved_1f1b', 'fill_drain'):
        pipe = DistributedGPipe(model(), [2, 2], chunks=2, checkpoint='except_last',
                                group=mesh['pp'].get_group())
        for layer in pipe.children():
            fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=2)
        input, target = batch(0)
        pipe.train_step(input[shard], target[shard], F.mse_loss, schedule=schedule)
        grads[schedule] = {name: p.grad.full_tensor().tolist()
                           for name, p in pipe.named_parameters()}
    return grads


@pytest.mark.slow  # four processes
def test_units_resharded_to_a_smaller_group_give_the_unwrapped_gradients(
        scenarios: List[Dict[str, Any]]) -> None:
    # A pass kept gathered after a forward pass that resharded to the smaller group: FSDP
    # gathers from that group (keeping such a unit broke its gathering).
    plain = model()
    F.mse_loss(plain(batch(0)[0]), batch(0)[1]).backward()
    for got in (ranks['smaller'] for ranks in scenarios):
        for schedule, grads in got.items():
            for name, grad in grads.items():
                torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64),
                                           plain.get_parameter(name).grad,
                                           rtol=1e-12, atol=1e-15,
                                           msg=lambda m: f'{schedule} {name}: {m}')


class Gate(nn.Module):
    """A linear layer that runs only while ``on``."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(FEATURES, FEATURES)
        self.on = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x) if self.on else x


def gated_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), Gate(),
                         nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, FEATURES)).double()


def gated_steps(model: nn.Module, step: Any) -> List[float]:
    """Two steps' losses: the first with the gate's layer left out, the second with it,
    its weight doubled in between."""
    gates = [m for m in model.modules() if isinstance(m, Gate)]
    losses = []
    for on in (False, True):
        for gate in gates:
            gate.on = on
        model.zero_grad()
        losses.append(float(step(*batch(0)).detach()))
        with torch.no_grad():
            for gate in gates:
                gate.inner.weight.mul_(2.0)
    return losses


def unit_left_out(rank: int, world_size: int) -> List[float]:
    """A unit that does not run in a step, then runs in the next, its shards changed."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    pipe = DistributedGPipe(gated_model(), [2, 2], chunks=CHUNKS, group=mesh['pp'].get_group())
    for layer in pipe.modules():
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
    return gated_steps(pipe, lambda x, y: pipe.train_step(x, y, F.mse_loss))


@pytest.mark.slow  # four processes
def test_a_unit_left_out_of_a_step_runs_in_the_next_with_its_own_values(
        scenarios: List[Dict[str, Any]]) -> None:
    # Its gathering, started with the step, is not taken by the next step's forward pass:
    # it would hold the values from before the change. Nor is it reduced without running.
    plain = gated_model()
    expected = gated_steps(plain, lambda x, y: F.mse_loss(plain(x), y))
    for got in (ranks['left_out'] for ranks in scenarios):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected),
                                   rtol=1e-12, atol=0)


def all_scenarios(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """The smaller scenarios above, one after the other in one start of the processes."""
    return {'mixed': mixed_precision(rank, world_size),
            'resharded': resharded_after_forward(rank, world_size),
            'loop': whole_loop(rank, world_size), 'nested': nested_units(rank, world_size),
            'gathered': gathered_first(rank, world_size),
            'left_out': unit_left_out(rank, world_size),
            'nested_default': nested_by_default(rank, world_size),
            'smaller': resharded_to_a_smaller_group(rank, world_size),
            'meta': built_on_meta(rank, world_size, path)}


@pytest.fixture(scope='module')
def scenarios(tmp_path_factory: pytest.TempPathFactory) -> List[Dict[str, Any]]:
    import torch.distributed.checkpoint as dcp
    path = str(tmp_path_factory.mktemp('fsdp') / 'checkpoint')
    with warnings.catch_warnings():
        # DCP says, writing without a process group, that it writes in one process: the
        # intent here (the unwrapped model's checkpoint, which the meta build loads).
        warnings.filterwarnings('ignore', 'torch.distributed is disabled, unavailable or '
                                'uninitialized')
        dcp.save(model().state_dict(), checkpoint_id=path)
    return run_distributed(all_scenarios, path, world_size=4, timeout=300)

"""FSDP2 units in the partitions of a DistributedGPipe: the pipeline over one dimension of a
DeviceMesh, ``fully_shard`` over the other. Each step reduces each unit's gradients once and
gathers its parameters once (counted), and the gradients are the unwrapped model's on the
global batch."""
import itertools
from typing import Any, Dict, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from torchgpipe.distributed import DistributedGPipe

pytest.importorskip('torch.distributed.fsdp', reason='FSDP2 (fully_shard) needs torch 2.4')

FEATURES = 8
BATCH = 16
CHUNKS = 4
STEPS = 2
CONFIGS = list(itertools.product(['1f1b', 'fill_drain', 'zb_h1'],
                                 ['always', 'except_last', 'never']))
COLLECTIVES = ('reduce_scatter_single', 'all_gather_single')


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


def sharded_steps(rank: int, world_size: int) -> Dict[str, Any]:
    """Every configuration on a mesh of pp 2 x dp 2: each step's collectives, counted, and
    the gradients of this rank's layers after each step, whole."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    here = mesh.get_local_rank('dp')
    shard = slice(here * BATCH // 2, (here + 1) * BATCH // 2)
    counts: Dict[str, int] = {}
    real = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return real[name](*args, **kwargs)
        return call
    results: Dict[str, Any] = {}
    for schedule, checkpoint in CONFIGS:
        pipe = DistributedGPipe(model(), [2, 2], chunks=CHUNKS, checkpoint=checkpoint,
                                group=mesh['pp'].get_group())
        for layer in pipe.children():
            fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
        steps = []
        for step in range(STEPS):
            pipe.zero_grad()
            counts.clear()
            input, target = batch(step)
            for name in COLLECTIVES:
                setattr(dist, name, counting(name))
            try:
                pipe.train_step(input[shard], target[shard], F.mse_loss, schedule=schedule)
            finally:
                for name in COLLECTIVES:
                    setattr(dist, name, real[name])
            steps.append({'counts': dict(counts), 'grads': {
                name: p.grad.full_tensor().tolist() for name, p in pipe.named_parameters()}})
        results[f'{schedule} {checkpoint}'] = steps
    return results


@pytest.mark.slow  # four processes
def test_each_unit_reduces_and_gathers_once_per_step_with_the_unwrapped_gradients() -> None:
    ranks = run_distributed(sharded_steps, world_size=4, timeout=150)
    expected = []
    for step in range(STEPS):
        plain = model()
        F.mse_loss(plain(batch(step)[0]), batch(step)[1]).backward()
        expected.append({name: p.grad for name, p in plain.named_parameters()})
    for schedule, checkpoint in CONFIGS:
        for rank, results in enumerate(ranks):
            for step, got in enumerate(results[f'{schedule} {checkpoint}']):
                # Two units (layers) a rank: one reduction and one gathering each, not one
                # per micro-batch (8 of each, left alone).
                assert got['counts'] == {name: 2 for name in COLLECTIVES}, \
                    (schedule, checkpoint, rank, step)
                for name, grad in got['grads'].items():
                    torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64),
                                               expected[step][name], rtol=1e-12, atol=1e-15)


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
    real = {name: getattr(dist, name) for name in COLLECTIVES}
    for name in COLLECTIVES:
        setattr(dist, name, lambda *a, name=name, **k: (
            counts.__setitem__(name, counts.get(name, 0) + 1), real[name](*a, **k))[1])
    try:
        pipe.train_step(*batch(0), F.mse_loss)
    finally:
        for name in COLLECTIVES:
            setattr(dist, name, real[name])
    return counts


@pytest.mark.slow  # four processes
def test_nested_units_reduce_once_each() -> None:
    # The inner units hold the parameters; the outer one reduces them, not again each.
    for counts in run_distributed(nested_units, world_size=4, timeout=150):
        assert counts == {name: 2 for name in COLLECTIVES}

"""Tensor parallel in the partitions of a DistributedGPipe: ``parallelize_module`` with
column- and row-wise plans on a transformer's attention and MLP, over the ``tp`` dimension
of a DeviceMesh whose ``pp`` dimension the pipeline runs over; with FSDP2 over a ``dp``
dimension too (8 processes); a weight tied across pipeline ranks whose ends are sharded.
The gradients, and their clipped values, are the unwrapped model's on the global batch."""
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from test_distributed import FEATURES
from test_distributed_pipe import tied
from torchgpipe.distributed import DistributedGPipe

pytest.importorskip('torch.distributed.tensor.parallel',
                    reason='tensor parallel with DTensor needs torch 2.4')
pytestmark = pytest.mark.slow  # four or eight processes

DIM = 8
HEADS = 4
TOKENS = 6
BATCH = 16
CHUNKS = 4
MAX_NORM = 0.1
#: (schedule, checkpoint, balance, placement, the norm to clip by)
CONFIGS = [('1f1b', 'except_last', [2, 2], 'loop', 2.0),
           ('zb_h1', 'always', [2, 2], 'loop', float('inf')),
           ('interleaved_1f1b', 'never', [1, 1, 1, 1], 'loop', 1.0)]


class Attention(nn.Module):
    """Causal self-attention with a residual; its heads are those its projections hold, so
    column-wise projections give a rank its share of the heads."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape

        def heads(y: Tensor) -> Tensor:
            return y.view(b, t, -1, DIM // HEADS).transpose(1, 2)
        out = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)),
                                             heads(self.v(x)), is_causal=True)
        return x + self.o(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """A transformer's feed-forward block with a residual."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(x)))


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Attention(), MLP(), Attention(), MLP()).double()


def batch(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(300 + step)
    return (torch.randn(BATCH, TOKENS, DIM, generator=gen, dtype=torch.float64),
            torch.randn(BATCH, TOKENS, DIM, generator=gen, dtype=torch.float64))


def parallelize(layer: nn.Module, mesh: Any) -> None:
    """Megatron's plan: the first projections column-wise, the last row-wise."""
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    if isinstance(layer, Attention):
        plan: Dict[str, Any] = {'q': ColwiseParallel(), 'k': ColwiseParallel(),
                                'v': ColwiseParallel(), 'o': RowwiseParallel()}
    else:
        plan = {'up': ColwiseParallel(), 'down': RowwiseParallel()}
    parallelize_module(layer, mesh, plan)


def steps_on_mesh(rank: int, world_size: int, dims: Tuple[str, ...]) -> List[Dict[str, Any]]:
    """Each configuration's step on a mesh of ``dims`` (each of size 2; ``pp`` first):
    this rank's gradients after the step and after clipping, whole, and the norm."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh('cpu', (2,) * len(dims), mesh_dim_names=dims)
    data = [d for d in dims if d.startswith('dp')]
    here = 0  # this data-parallel rank's place among all of them
    for d in data:
        here = 2 * here + mesh.get_local_rank(d)
    share = BATCH // 2 ** len(data)  # this data-parallel rank's part of the batch
    results = []
    for schedule, checkpoint, balance, placement, norm_type in CONFIGS:
        pipe = DistributedGPipe(model(), balance, chunks=CHUNKS, checkpoint=checkpoint,
                                placement=placement, group=mesh['pp'].get_group())
        for layer in pipe.children():
            if 'tp' in dims:
                parallelize(layer, mesh['tp'])
            if data:
                fully_shard(layer, mesh=mesh[tuple(data)], reshard_after_forward=False)
        input, target = batch(0)
        pipe.train_step(input[here * share:(here + 1) * share],
                        target[here * share:(here + 1) * share], F.mse_loss,
                        schedule=schedule)
        grads = {name: p.grad.full_tensor().tolist() for name, p in pipe.named_parameters()}
        norm = float(pipe.clip_grad_norm_(MAX_NORM, norm_type))
        results.append({'grads': grads, 'norm': norm, 'clipped': {
            name: p.grad.full_tensor().tolist() for name, p in pipe.named_parameters()}})
    return results


def check(ranks: List[List[Dict[str, Any]]]) -> None:
    """Each rank's gradients, norm and clipped gradients equal the unwrapped model's."""
    for n, (schedule, _, _, _, norm_type) in enumerate(CONFIGS):
        plain = model()
        F.mse_loss(plain(batch(0)[0]), batch(0)[1]).backward()
        grads = {name: p.grad.clone() for name, p in plain.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM, norm_type)
        assert norm > MAX_NORM  # so the clipping changes the gradients
        for rank, results in enumerate(ranks):
            got = results[n]
            torch.testing.assert_close(torch.tensor(got['norm'], dtype=torch.float64), norm,
                                       rtol=1e-12, atol=0)
            for name in got['grads']:
                for key, expected in (('grads', grads[name]),
                                      ('clipped', plain.get_parameter(name).grad)):
                    torch.testing.assert_close(
                        torch.tensor(got[key][name], dtype=torch.float64), expected,
                        rtol=1e-12, atol=1e-15,
                        msg=lambda m: f'{schedule} rank {rank} {key} {name}: {m}')


def test_tensor_parallel_stages() -> None:
    check(run_distributed(steps_on_mesh, ('pp', 'tp'), world_size=4, timeout=150))


THREE_DIMENSIONS = [('pp', 'dp', 'tp'), ('pp', 'dp_replicate', 'dp_shard')]  # the last HSDP's


def steps_on_meshes(rank: int, world_size: int) -> List[List[Dict[str, Any]]]:
    """:func:`steps_on_mesh` on each mesh of three dimensions, in one start of 8 processes."""
    return [steps_on_mesh(rank, world_size, dims) for dims in THREE_DIMENSIONS]


def test_three_dimensions() -> None:
    ranks = run_distributed(steps_on_meshes, world_size=8, timeout=300)
    for k in range(len(THREE_DIMENSIONS)):
        check([meshes[k] for meshes in ranks])



TIED_BATCH = 8


def tied_batch(step: int) -> Tuple[Tensor, Tensor]:
    gen = torch.Generator().manual_seed(400 + step)
    return (torch.randn(TIED_BATCH, FEATURES, generator=gen, dtype=torch.float64),
            torch.randn(TIED_BATCH, FEATURES, generator=gen, dtype=torch.float64))


def tied_ends(rank: int, world_size: int, sharding: str) -> Dict[str, Any]:
    """A model whose first and last layers share a weight, on two pipeline ranks, the two
    ends sharded alike (FSDP2 over ``dp``) or not (row- and column-wise over ``tp``): two
    steps' accumulated gradients, whole; and the error of a step whose copies differ."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', sharding))
    here = mesh.get_local_rank(sharding) if sharding == 'dp' else 0
    share = TIED_BATCH // 2 if sharding == 'dp' else TIED_BATCH

    def pipeline() -> DistributedGPipe:
        pipe = DistributedGPipe(tied(), [3, 3], chunks=2, group=mesh['pp'].get_group())
        for name, layer in pipe.named_children():
            if sharding == 'dp' and name in ('0', '2', '4', '5'):
                fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
            elif name == '0':  # the weight split by its columns ...
                parallelize_module(layer, mesh['tp'], RowwiseParallel(input_layouts=Replicate()))
            elif name == '5':  # ... and by its rows
                parallelize_module(layer, mesh['tp'], ColwiseParallel(output_layouts=Replicate()))
        return pipe
    pipe = pipeline()
    for step in range(2):  # accumulated, without zero_grad
        input, target = tied_batch(step)
        pipe.train_step(input[here * share:(here + 1) * share],
                        target[here * share:(here + 1) * share], F.mse_loss)
    grads = {name: p.grad.full_tensor().tolist() if hasattr(p.grad, 'full_tensor')
             else p.grad.tolist() for name, p in pipe.named_parameters()}
    # Under tensor parallel, layers 2 and 4 are not sharded: plain and sharded gradients.
    norm = float(pipe.clip_grad_norm_(MAX_NORM))
    unequal = pipeline()
    if rank == 0:  # a copy of rank 0's pipeline ranks changed
        next(unequal.parameters()).data.to_local().add_(1.0)
    try:
        unequal.train_step(*tied_batch(0), F.mse_loss)
        refused = ''
    except ValueError as exc:
        refused = str(exc)
    return {'grads': grads, 'norm': norm, 'refused': refused}


@pytest.mark.parametrize('sharding', ['dp', 'tp'])
def test_a_weight_tied_across_ranks_whose_ends_are_sharded(sharding: str) -> None:
    plain = tied()
    for step in range(2):
        F.mse_loss(plain(tied_batch(step)[0]), tied_batch(step)[1]).backward()
    expected = {name: p.grad.clone()
                for name, p in plain.named_parameters(remove_duplicate=False)}
    norm = torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM)
    for rank, got in enumerate(run_distributed(tied_ends, sharding, world_size=4,
                                               timeout=150)):
        torch.testing.assert_close(torch.tensor(got['norm'], dtype=torch.float64), norm,
                                   rtol=1e-12, atol=0)
        for name, grad in got['grads'].items():
            torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64),
                                       expected[name], rtol=1e-12, atol=1e-15,
                                       msg=lambda m: f'rank {rank} {name}: {m}')
        assert 'the copies of a parameter tied across ranks must be equal' in got['refused']

"""Checkpoints through torch.distributed.checkpoint (DCP), which the ecosystem reads.

Two ranks train a model whose first and last layers share a weight, with
Adam (state per parameter), and save model and optimizer with DCP, each
rank writing its own part. Three ranks of another balance load it and
train on; so does the unwrapped model, in one process. Both must give what
training without the interruption gives. So too for a transformer trained
with FSDP2 on pp 2 x dp 2, resumed with tensor parallel on pp 2 x tp 2 and
another balance, or unwrapped.
"""
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)

from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import rank_device, run_distributed
from test_distributed import TOLERANCE
from test_distributed_pipe import CHUNKS, batch, model
from test_tensor_parallel import batch as tokens
from test_tensor_parallel import model as transformer
from test_tensor_parallel import parallelize
from torchgpipe.distributed import DistributedGPipe

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

# Optimizer states under the parameters' names, which any balance shares.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)
SAVED, TOTAL = 2, 4


def adam(module: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(module.parameters(), lr=0.01)


def steps(module: nn.Module, optimizer: torch.optim.Optimizer, step_fn: Any,
          first: int, last: int) -> List[float]:
    losses = []
    for step in range(first, last):
        optimizer.zero_grad()
        losses.append(float(step_fn(*batch(step), F.mse_loss)))
        optimizer.step()
    return losses


def plain_step(module: nn.Module) -> Any:
    def step(input: torch.Tensor, target: torch.Tensor, loss_fn: Any) -> torch.Tensor:
        loss = loss_fn(module(input), target)
        loss.backward()
        return loss.detach()
    return step


def load(module: nn.Module, optimizer: torch.optim.Optimizer, path: str) -> None:
    """As a script loads a DCP checkpoint: into its own state dicts, then into the objects."""
    model_state, optimizer_state = get_state_dict(module, optimizer, options=OPTIONS)
    state = {'model': model_state, 'optimizer': optimizer_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, optimizer, model_state_dict=state['model'],
                   optim_state_dict=state['optimizer'], options=OPTIONS)


def save_on_two(rank: int, world_size: int, path: str) -> List[float]:
    pipe = DistributedGPipe(model('tied'), [3, 3], chunks=CHUNKS, device=rank_device())
    optimizer = adam(pipe)
    losses = steps(pipe, optimizer, pipe.train_step, 0, SAVED)
    model_state, optimizer_state = get_state_dict(pipe, optimizer, options=OPTIONS)
    dcp.save({'model': model_state, 'optimizer': optimizer_state}, checkpoint_id=path)
    return losses


def load_on_three(rank: int, world_size: int, path: str) -> Tuple[List[float], Dict[str, Any]]:
    pipe = DistributedGPipe(model('tied'), [2, 2, 2], chunks=CHUNKS, device=rank_device())
    optimizer = adam(pipe)
    load(pipe, optimizer, path)
    losses = steps(pipe, optimizer, pipe.train_step, SAVED, TOTAL)
    return losses, {k: v.tolist() for k, v in pipe.state_dict().items()}


# DCP says, reading without a process group, that it reads in one process: the intent here.
@pytest.mark.filterwarnings('ignore:torch.distributed is disabled, unavailable or uninitialized')
def test_saved_on_two_ranks_loaded_on_three_or_unwrapped_trains_on_as_without_a_stop(
        tmp_path: Path, backend: str) -> None:
    path = str(tmp_path / 'checkpoint')
    # Not measured: nothing of torchgpipe runs here that other tests do not measure.
    saved = run_distributed(save_on_two, path, timeout=90, measured=False, backend=backend)
    resumed = run_distributed(load_on_three, path, world_size=3, timeout=90, measured=False,
                              backend=backend)
    plain = model('tied')
    optimizer = adam(plain)
    expected = steps(plain, optimizer, plain_step(plain), 0, TOTAL)
    torch.testing.assert_close(torch.tensor(saved[0] + resumed[0][0]),
                               torch.tensor(expected), **TOLERANCE)
    state = {k: v for _, ranks in resumed for k, v in ranks.items()}
    assert state.keys() == plain.state_dict().keys()
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(torch.tensor(state[key], dtype=value.dtype), value,
                                   **TOLERANCE, msg=lambda m, key=key: f'{key}: {m}')
    # The unwrapped model, in one process, reads it too.
    unwrapped = model('tied')
    optimizer = adam(unwrapped)
    load(unwrapped, optimizer, path)
    torch.testing.assert_close(
        torch.tensor(steps(unwrapped, optimizer, plain_step(unwrapped), SAVED, TOTAL)),
        torch.tensor(expected[SAVED:]), **TOLERANCE)


def train_sharded(rank: int, world_size: int, path: str) -> None:
    """Two steps of a transformer on pp 2 x dp 2 (FSDP2), each dp rank on its half; saved."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    half = slice(mesh.get_local_rank('dp') * 8, (mesh.get_local_rank('dp') + 1) * 8)
    pipe = DistributedGPipe(transformer(), [2, 2], chunks=CHUNKS, group=mesh['pp'].get_group())
    for layer in pipe.children():
        fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
    optimizer = adam(pipe)
    for step in range(SAVED):
        optimizer.zero_grad()
        input, target = tokens(step)
        pipe.train_step(input[half], target[half], F.mse_loss)
        optimizer.step()
    model_state, optimizer_state = get_state_dict(pipe, optimizer, options=OPTIONS)
    dcp.save({'model': model_state, 'optimizer': optimizer_state}, checkpoint_id=path)


def resume_tensor_parallel(rank: int, world_size: int, path: str) -> Dict[str, Any]:
    """The checkpoint loaded on pp 2 x tp 2 with another balance; two steps more."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'tp'))
    pipe = DistributedGPipe(transformer(), [1, 3], chunks=CHUNKS, group=mesh['pp'].get_group())
    for layer in pipe.children():
        parallelize(layer, mesh['tp'])
    optimizer = adam(pipe)
    load(pipe, optimizer, path)
    for step in range(SAVED, TOTAL):
        optimizer.zero_grad()
        pipe.train_step(*tokens(step), F.mse_loss)
        optimizer.step()
    return {name: p.full_tensor().tolist() for name, p in pipe.named_parameters()}


@pytest.mark.filterwarnings('ignore:torch.distributed is disabled, unavailable or uninitialized')
def test_sharded_saved_loads_into_tensor_parallel_or_unwrapped(tmp_path: Path) -> None:
    path = str(tmp_path / 'checkpoint')
    run_distributed(train_sharded, path, world_size=4, timeout=90, measured=False)
    resumed = run_distributed(resume_tensor_parallel, path, world_size=4, timeout=90,
                              measured=False)
    plain = transformer()
    optimizer = adam(plain)
    for step in range(TOTAL):
        optimizer.zero_grad()
        F.mse_loss(plain(tokens(step)[0]), tokens(step)[1]).backward()
        optimizer.step()
    unwrapped = transformer()
    optimizer = adam(unwrapped)
    load(unwrapped, optimizer, path)
    for step in range(SAVED, TOTAL):
        optimizer.zero_grad()
        F.mse_loss(unwrapped(tokens(step)[0]), tokens(step)[1]).backward()
        optimizer.step()
    for rank, got in enumerate(resumed):
        for name, value in got.items():
            torch.testing.assert_close(torch.tensor(value, dtype=torch.float64),
                                       plain.get_parameter(name), rtol=1e-10, atol=1e-13,
                                       msg=lambda m: f'rank {rank} {name}: {m}')
    for name, p in unwrapped.named_parameters():
        torch.testing.assert_close(p, plain.get_parameter(name), rtol=1e-10, atol=1e-13)

"""Checkpoints through torch.distributed.checkpoint (DCP), which the ecosystem reads.

Two ranks train a model whose first and last layers share a weight, with
Adam (state per parameter), and save model and optimizer with DCP, each
rank writing its own part. Three ranks of another balance load it and
train on; so does the unwrapped model, in one process. Both must give what
training without the interruption gives.
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

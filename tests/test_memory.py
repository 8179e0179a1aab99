"""Property 5: with checkpointing, a partition keeps only its boundary activations.

Bytes saved for backward are counted with saved_tensors_hooks, which are
thread-local, so the hooks are also installed in the worker threads. Both
execution paths are measured (the ``threaded`` fixture of conftest.py).
"""
import threading
from typing import Any, Dict, Iterator

import pytest
import torch
from torch import Tensor, nn

import torchgpipe.runtime.worker
from helpers import cpu_devices, mlp
from torchgpipe import GPipe


#: The size of the CPU generator's state, which each checkpointed task keeps
#: to replay its random numbers (a fixed cost, whatever the activations).
RNG_STATE_BYTES = torch.get_rng_state().nbytes


class SavedBytes:
    """Counts the distinct storages saved for backward, in every thread.

    Generator states are counted apart from activations.
    """

    def __init__(self) -> None:
        self.storages: Dict[int, int] = {}
        self.rng_states = 0
        self.lock = threading.Lock()

    def pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        with self.lock:
            if tensor.dtype == torch.uint8 and storage.nbytes() == RNG_STATE_BYTES:
                self.rng_states += 1
            else:
                self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)

    @property
    def total(self) -> int:
        return sum(self.storages.values())

    def clear(self) -> None:
        self.storages.clear()
        self.rng_states = 0


@pytest.fixture
def saved(monkeypatch: pytest.MonkeyPatch) -> Iterator[SavedBytes]:
    counter = SavedBytes()
    original = torchgpipe.runtime.worker.worker

    def worker(*args: Any) -> None:
        with counter.hooks():
            original(*args)

    monkeypatch.setattr(torchgpipe.runtime.worker, 'worker', worker)
    yield counter


def saved_bytes_of_forward(saved: SavedBytes, checkpoint: str, threaded: bool) -> int:
    balance = [8, 8, 8, 8]
    gpipe = GPipe(mlp(64, depth=16, activation=nn.ReLU), balance,
                  devices=cpu_devices(len(balance), threaded), chunks=4, checkpoint=checkpoint)
    input = torch.randn(64, 64)
    with saved.hooks():
        output = gpipe(input)
    total = saved.total
    output.sum().backward()
    return total


def test_checkpointing_keeps_only_partition_boundaries(saved: SavedBytes,
                                                       threaded: bool) -> None:
    total = saved_bytes_of_forward(saved, 'always', threaded)
    # Each of the 4 partitions keeps its input micro-batches: 64 x 64 floats.
    # (The model's parameters are saved too: the weights of the recomputed
    # layers are not saved in the first pass, so they may not count.)
    boundary_bytes = 4 * 64 * 64 * 4
    assert 0 < total <= boundary_bytes
    # One generator state per checkpointed task: 4 micro-batches x 4 partitions.
    assert saved.rng_states == 16


def test_checkpointing_saves_far_less_than_never(saved: SavedBytes, threaded: bool) -> None:
    never = saved_bytes_of_forward(saved, 'never', threaded)
    saved.clear()
    except_last = saved_bytes_of_forward(saved, 'except_last', threaded)
    saved.clear()
    always = saved_bytes_of_forward(saved, 'always', threaded)
    assert always < except_last < never
    # 32 layers per micro-batch kept without checkpointing, 4 boundaries with.
    assert always * 4 < never

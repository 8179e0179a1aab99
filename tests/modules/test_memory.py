"""Property 5: with checkpointing, a partition keeps only its boundary activations.

Bytes saved for backward are counted with saved_tensors_hooks, which are
thread-local, so the hooks are also installed in the worker threads. Both
execution paths are measured (the ``threaded`` fixture of conftest.py).
"""
import threading
import weakref
from typing import Any, Dict, Generator, Iterator, List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgpipe.runtime.checkpoint
import torchgpipe.runtime.worker
from helpers import cpu_devices, mlp
from torchgpipe import GPipe
from torchgpipe.skip import pop, skippable, stash


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


def test_checkpointing_keeps_only_partition_boundaries(saved: SavedBytes, threaded: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    contexts: List[Any] = []
    context_class = torchgpipe.runtime.checkpoint.Context

    def context(*args: Any) -> Any:
        contexts.append(context_class(*args))
        return contexts[-1]

    monkeypatch.setattr(torchgpipe.runtime.checkpoint, 'Context', context)
    total = saved_bytes_of_forward(saved, 'always', threaded)
    # Each of the 4 partitions keeps its input micro-batches: 64 x 64 floats.
    # (The model's parameters are saved too: the weights of the recomputed
    # layers are not saved in the first pass, so they may not count.)
    boundary_bytes = 4 * 64 * 64 * 4
    assert 0 < total <= boundary_bytes
    # A generator state per checkpointed task that may draw (each partition's first, until
    # known not to), kept in its context for the replay, never among the saved tensors.
    assert saved.rng_states == 0
    assert len(contexts) == 16
    states = [c.first_pass.rng[0] for c in contexts if c.first_pass.rng[0] is not None]
    assert len(states) == 4 and all(s.nbytes == RNG_STATE_BYTES for s in states)


def test_checkpointing_saves_far_less_than_never(saved: SavedBytes, threaded: bool) -> None:
    never = saved_bytes_of_forward(saved, 'never', threaded)
    saved.clear()
    except_last = saved_bytes_of_forward(saved, 'except_last', threaded)
    saved.clear()
    always = saved_bytes_of_forward(saved, 'always', threaded)
    assert always < except_last < never
    # 32 layers per micro-batch kept without checkpointing, 4 boundaries with.
    assert always * 4 < never


#: Weak references to the skip tensors stashed in checkpointed first passes,
#: and how many of them were alive at each recomputation of the popping
#: partition (when every first pass has sent its skip, and it has come).
first_passes: List['weakref.ref[Tensor]'] = []
alive_at_recomputation: List[int] = []


@skippable(stash=['skip'])
class StashDoubled(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        doubled = x * 2
        if not torch.is_grad_enabled():  # a first pass
            first_passes.append(weakref.ref(doubled))
        yield stash('skip', doubled)
        return x


@skippable(pop=['skip'])
class PopAdded(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop('skip')
        if torch.is_grad_enabled():  # a recomputation: how many first passes' skips live?
            alive_at_recomputation.append(sum(r() is not None for r in first_passes))
        return x + skip


def test_a_checkpointed_micro_batch_keeps_no_skip_it_sent_until_its_recomputation(
        threaded: bool) -> None:
    """Its recomputation stashes the skip again: the first pass's, held until then, would
    keep every micro-batch's at once (in another device's or rank's memory, a copy).
    Fill-drain: every message of the forward passes is taken before any recomputation."""
    first_passes.clear()
    alive_at_recomputation.clear()
    model = nn.Sequential(nn.Linear(8, 8), StashDoubled(), nn.Linear(8, 8), PopAdded())
    gpipe = GPipe(model, [2, 2], devices=cpu_devices(2, threaded), chunks=4,
                  checkpoint='always')
    gpipe.train_step(torch.randn(8, 8), torch.randn(8, 8), F.mse_loss, schedule='fill_drain')
    assert len(first_passes) == 4 and alive_at_recomputation == [0, 0, 0, 0]

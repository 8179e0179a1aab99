"""Shared memory between the ranks of one host: payloads past the sockets, results unchanged.

From the second step on, a message between two ranks that read each other's
``/dev/shm`` is its header alone, its payload in an arena; the steps give the
same losses and gradients, bit for bit, as over the process group only (no
``/dev/shm``), and as with a limit that sends the larger payloads on the wire
anyway. What a peer's header names is checked before anything is read.
"""
import gc
import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Dict, List, Tuple, cast

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchgpipe.distributed.shared as shared
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from torchgpipe.distributed.channels import Channels, Receiving
from torchgpipe.distributed.codec import Unreadable
from torchgpipe.distributed.shared import Shared

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A folder of its own in place of /dev/shm: what a test leaves there is seen."""
    monkeypatch.setattr(shared, 'ROOT', str(tmp_path))
    return tmp_path


def acquainted() -> Tuple[Shared, Shared]:
    """Rank 0's and rank 1's shared memory, past a first step: each reads the other's."""
    a, b = Shared(), Shared()
    b.test(0, a.probe_word())
    a.test(1, b.probe_word())
    a.end_step({1: 0 in b.seen})
    b.end_step({0: 1 in a.seen})
    return a, b


def test_payloads_go_through_an_arena_that_starts_over_every_step(root: Path) -> None:
    a, b = acquainted()
    assert (a.readers, a.sources, b.readers, b.sources) == ({1}, {1}, {0}, {0})
    assert not list(root.iterdir())  # both probes removed once the step ended
    for step in range(3):
        sent = []
        for k, size in enumerate([1000, 3 << 20, 5]):  # the second outgrows the first arena
            placed = a.place(1, size)
            assert placed is not None
            name, offset, room = placed
            data = torch.randint(0, 256, (size,), dtype=torch.uint8)
            room.copy_(data)
            sent.append((name, offset, data))
        for name, offset, data in sent:
            assert torch.equal(b.read(0, name, offset, data.numel()), data)
        # Each arena's file is gone once its reader mapped it.
        assert not list(root.iterdir())
        names, offsets = [n for n, _, _ in sent], [o for _, o, _ in sent]
        if step == 0:
            assert names[0] != names[1] == names[2] and offsets == [0, 0, align(3 << 20)]
            grown = names[1]
        else:  # the grown arena, from its start
            assert names == [grown] * 3 and offsets == [0, 1024, 1024 + align(3 << 20)]
        b.end_step({0: True})
        a.end_step({1: True})
        assert list(b.mapped[0]) == [grown]
        assert not a.outgrown


def align(n: int) -> int:
    return -(-n // 64) * 64


def test_a_rank_that_ends_its_step_and_its_pipeline_leaves_the_ends_arena_to_its_reader(
        root: Path) -> None:
    """The end of a step may come through an arena made in that step, and its sender
    may end the step, and drop its pipeline, before the reader maps it (the reader's
    end comes first): the arena stays for the reader, who removes it. A step that
    never ends leaves no reader for its arenas: those go with their maker."""
    a, b = acquainted()
    name, offset, room = a.place(1, 100)  # type: ignore[misc]
    room.fill_(7)
    a.end_step({1: True})
    del a, room
    gc.collect()
    assert torch.equal(b.read(0, name, offset, 100), torch.full((100,), 7, dtype=torch.uint8))
    assert not list(root.iterdir())  # removed by its reader, once mapped
    c, _ = acquainted()
    c.place(1, 100)
    del c, _
    gc.collect()
    assert not list(root.iterdir())  # a step that did not end: its maker removed it


def test_a_rank_that_did_not_read_the_probe_gets_payloads_on_the_wire(root: Path) -> None:
    a, b = Shared(), Shared()
    word = a.probe_word()
    assert word is not None
    b.test(0, [word[0], 'another token'])
    b.test(0, ['../../etc/passwd', word[1]])
    b.test(0, 'not a probe')
    assert not b.seen
    a.end_step({1: False})
    b.end_step({0: False})
    assert a.place(1, 10) is None and not b.sources


def test_without_a_shared_folder_nothing_is_shared(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared, 'ROOT', '/nonexistent/folder')
    a = Shared()
    assert a.probe_word() is None
    a.readers = {1}
    assert a.place(1, 10) is None


def test_the_files_of_a_process_gone_for_an_hour_are_removed(root: Path) -> None:
    gone = f'torchgpipe-{(1 << 22) + 1}-0123456789abcdef-'  # beyond any PID Linux gives
    mine = f'torchgpipe-{os.getpid()}-0123456789abcdef-0'
    huge = 'torchgpipe-9999999999-0123456789abcdef-0'  # no PID at all
    old, recent, mine, huge = root / f'{gone}0', root / f'{gone}1', root / mine, root / huge
    an_hour_ago = time.time() - shared.STALE - 1
    for path in (old, recent, mine, huge):
        path.write_bytes(b'')
        if path is not recent:
            os.utime(path, (an_hour_ago, an_hour_ago))
    Shared().probe_word()
    assert not old.exists() and recent.exists() and mine.exists() and huge.exists()


def test_beyond_the_limit_a_payload_goes_on_the_wire(root: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shared, 'LIMIT', 4 << 20)
    a, _ = acquainted()
    assert a.place(1, 1 << 20) is not None
    assert a.place(1, 3 << 20) is None  # its arena would be 8 MiB


@pytest.mark.parametrize('name, offset, size, why', [
    ('../probe', 0, 8, 'no arena of rank 0'),
    (7, 0, 8, 'no arena of rank 0'),
    ('{prefix}-9', 0, 8, 'cannot be read'),  # named as the sender's, but none
    (None, 32, 8, 'misaligned'),
    (None, 0, 1 << 30, 'beyond it'),
    (None, -64, 8, 'beyond it'),
    (None, '0', 8, 'beyond it'),
])
def test_a_payload_no_rank_placed_is_refused(root: Path, name: Any, offset: Any, size: int,
                                            why: str) -> None:
    a, b = acquainted()
    placed = a.place(1, 64)
    assert placed is not None
    with pytest.raises(Unreadable, match=why):
        if isinstance(name, str):
            name = name.format(prefix=a.prefix)
        b.read(0, placed[0] if name is None else name, offset, size)
    with pytest.raises(Unreadable, match='no arena of rank 2'):
        b.read(2, placed[0], 0, 8)  # a rank that never said it shares


def test_a_file_that_is_not_the_senders_arena_is_neither_read_nor_removed(root: Path) -> None:
    a, b = acquainted()
    third = Shared()  # another process's, say (kept: its files go with it)
    other = third.make(64)
    assert other is not None and b.seen == {0}
    with pytest.raises(Unreadable, match='no arena of rank 0'):
        b.read(0, other.name, 0, 8)
    own = b.make(64)
    assert own is not None
    with pytest.raises(Unreadable, match='no arena of rank 0'):
        b.read(0, own.name, 0, 8)
    assert (root / other.name).exists()
    # A link named as the sender's arena: not followed.
    target = root / 'elsewhere'
    target.write_bytes(bytes(64))
    link = f'{a.prefix}-99'
    (root / link).symlink_to(target)
    with pytest.raises(Unreadable, match='cannot be read'):
        b.read(0, link, 0, 8)


def test_a_payload_is_bounded_by_its_arena_before_a_buffer_is_taken(root: Path) -> None:
    """A header cannot make its receiver allocate what it likes."""
    a, b = acquainted()
    placed = a.place(1, 64)
    assert placed is not None

    def buffer(size: int) -> torch.Tensor:
        assert size <= 1 << 20, 'a buffer sized by the header alone'
        return torch.empty(size, dtype=torch.uint8)
    receiver = cast(Any, SimpleNamespace(shared=b, pending={}, buffer=buffer))
    with pytest.raises(Unreadable, match='beyond it'):
        Channels.unwired(receiver, 0, Receiving(None, torch.empty(0)), 1 << 40,
                         [placed[0], 0])


def train(rank: int, world_size: int, sizes: Tuple[int, int], root: str) -> Dict[str, Any]:
    """Three steps of a pipeline of two ranks, with shared memory in ``root``
    (none if it is no folder), arenas of the ``sizes`` (smallest, limit);
    the losses, gradients, and the operations each step posted."""
    import torchgpipe.distributed.channels as channels
    from torchgpipe.distributed import DistributedGPipe
    shared.ROOT, (shared.SMALLEST, shared.LIMIT) = root, sizes
    posted: List[int] = []
    post = channels.Channels.post

    def counted(self: Any, to: int, message: Tuple[Any, ...]) -> None:
        posted[-1] += len(message)
        post(self, to, message)
    channels.Channels.post = counted  # type: ignore[method-assign]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 16)).double()
    pipe = DistributedGPipe(model, [2, 1], chunks=4)
    losses, ops = [], []
    for step in range(3):
        posted.append(0)
        x = torch.randn(32, 16, dtype=torch.double, generator=torch.Generator().manual_seed(step))
        losses.append(pipe.train_step(x, x.sin(), F.mse_loss).item())
        ops.append(posted[-1])
    left = [n for n in os.listdir(root) if n.startswith(f'torchgpipe-{os.getpid()}-')] \
        if os.path.isdir(root) else []
    return {'losses': losses, 'ops': ops, 'left': left,
            'grads': {k: p.grad.tolist() for k, p in pipe.named_parameters()}}


def test_across_ranks_shared_memory_changes_nothing_but_the_operations(tmp_path: Path) -> None:
    folder = str(tmp_path)
    sizes = (shared.SMALLEST, shared.LIMIT)
    wire = run_distributed(train, sizes, '/nonexistent/folder')
    arenas = run_distributed(train, sizes, folder)
    # An arena of 8 KiB: two 4 KiB payloads fit, the others go on the wire.
    mixed = run_distributed(train, (1024, 8192), folder)
    for ranks in (arenas, mixed):
        for mine, theirs in zip(ranks, wire):
            assert mine['losses'] == theirs['losses'] and mine['grads'] == theirs['grads']
    for rank in range(2):
        # The wire posts a header and a payload per message; from the
        # second step on, with arenas, the header alone.
        first, *later = arenas[rank]['ops']
        assert wire[rank]['ops'] == [first] * 3
        assert later == [first // 2] * 2, arenas[rank]['ops']
        assert first // 2 < mixed[rank]['ops'][2] < first
        assert arenas[rank]['left'] == mixed[rank]['left'] == []

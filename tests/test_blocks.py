"""Blocks, the wire's pool of CPU memory: a block is reused once no tensor uses it, never before."""
import threading
from typing import Dict, List, Set, Tuple

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from torchgpipe.distributed.blocks import Blocks


def test_a_block_comes_back_when_its_last_view_dies() -> None:
    blocks = Blocks()
    t = blocks.take(64)
    first = t.data_ptr()
    v = t[8:].view(torch.float64)[1:]
    del t
    # Only a view of a view is left: still in use.
    u = blocks.take(64)
    assert u.data_ptr() != first
    del v
    assert blocks.take(64).data_ptr() == first
    assert u.data_ptr() != first


def test_a_tensor_saved_for_backward_keeps_its_block() -> None:
    blocks = Blocks()
    x = blocks.take(64).view(torch.float64).requires_grad_()
    first = x.data_ptr()
    y = (x * x).sum()  # x is saved for the backward pass
    del x
    assert blocks.take(64).data_ptr() != first
    y.backward()
    del y
    assert blocks.take(64).data_ptr() == first


def test_a_tensor_dying_in_another_thread_gives_its_block_back() -> None:
    blocks = Blocks()
    held = [blocks.take(128)]
    first = held[0].data_ptr()
    thread = threading.Thread(target=held.clear)
    thread.start()
    thread.join()
    assert blocks.take(128).data_ptr() == first


def test_trim_drops_the_sizes_not_taken_since_the_last_trim() -> None:
    blocks = Blocks()
    blocks.take(64)
    blocks.take(128)
    blocks.trim()
    assert set(blocks.free) == {64, 128}
    blocks.take(64)  # taken and freed again: 64 stays, 128 goes
    blocks.trim()
    assert set(blocks.free) == {64}
    assert len(blocks.free[64]) == 1


SIZES = [64, 256]


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(['take', 'view', 'drop']),
                          st.integers(0, 1000)), max_size=60))
def test_no_block_is_lent_twice_and_freed_blocks_are_reused(ops: List[Tuple[str, int]]) -> None:
    """Random takes, views and drops: every live tensor keeps what was written into its block."""
    blocks = Blocks()
    live: List[torch.Tensor] = []
    marks: List[int] = []  # the value written into each live tensor's block
    in_use: Dict[int, Set[int]] = {size: set() for size in SIZES}
    seen: Dict[int, Set[int]] = {size: set() for size in SIZES}
    peak = {size: 0 for size in SIZES}
    for k, (op, n) in enumerate(ops):
        if op == 'take':
            size = SIZES[n % len(SIZES)]
            live.append(blocks.take(size).fill_(k % 256))
            marks.append(k % 256)
        elif op == 'view' and live:
            j = n % len(live)
            live.append(live[j][n % 8:])
            marks.append(marks[j])
        elif op == 'drop' and live:
            j = n % len(live)
            del live[j], marks[j]
        # (No variable of the test may hold a dropped tensor.)
        assert all(bool((t == mark).all()) for t, mark in zip(live, marks)), \
            'a block was lent while a tensor used it'
        # Count the blocks in use by each size (a view's storage is its block's).
        for size in SIZES:
            in_use[size] = {t.untyped_storage().data_ptr() for t in live
                            if t.untyped_storage().nbytes() == size}
            seen[size] |= in_use[size]
            peak[size] = max(peak[size], len(in_use[size]))
    for size in SIZES:
        # No more blocks were ever made than were in use at once.
        assert len(seen[size]) <= peak[size]


def test_two_threads_taking_and_dropping_never_share_a_block() -> None:
    """A bounded stress: blocks go back from whichever thread drops the last tensor."""
    blocks = Blocks()
    failures: List[str] = []
    handed: List[torch.Tensor] = []  # tensors one thread takes and the other drops

    def work(mark: int) -> None:
        kept: List[torch.Tensor] = []
        for k in range(2000):
            kept.append(blocks.take(64).fill_(mark))
            if k % 3 == 0:
                handed.append(kept.pop(0))  # list.append is atomic
            if len(kept) > 3:
                kept.pop(0)
            if handed and k % 2 == mark % 2:
                try:
                    handed.pop()
                except IndexError:
                    pass  # the other thread took it
            if not all(bool((t == mark).all()) for t in kept):
                failures.append(f'thread {mark}: a kept block was lent again')
                return

    threads = [threading.Thread(target=work, args=(mark,), daemon=True) for mark in (1, 2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not any(thread.is_alive() for thread in threads), 'the stress did not finish'
    assert not failures, failures
    handed.clear()
    # Everything was given back: far fewer blocks were made than taken.
    assert 0 < len(blocks.free[64]) < 100


def test_every_block_starts_at_a_multiple_of_64_bytes() -> None:
    """As PyTorch's own CPU allocator gives (a bytearray's bytes start 16
    bytes past a boundary): received activations are views of blocks, and
    kernels may be slower on unaligned tensors (see docs/scaling_out.rst)."""
    blocks = Blocks()
    lent = [blocks.take(size) for size in (1, 63, 64, 1000, 1 << 20) for _ in range(3)]
    assert all(t.data_ptr() % 64 == 0 for t in lent)
    assert [t.numel() for t in lent[::3]] == [1, 63, 64, 1000, 1 << 20]

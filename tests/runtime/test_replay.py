"""Replay: a checkpointed micro-batch's recomputation computes as its first pass.

Both engines run their two passes in :func:`first_pass` and
:func:`recomputation`; the engines' own tests (test_checkpoint.py,
test_train_step.py, test_rng.py) check the same through GPipe.
"""
import threading
from typing import List

import torch
import torch.nn.functional as F

from torchgpipe import is_checkpointing, is_recomputing
from torchgpipe.runtime.replay import first_pass, recomputation

CPU = torch.device('cpu')


def test_recomputation_draws_the_first_pass_numbers_and_puts_the_generator_back() -> None:
    with first_pass(CPU) as states:
        mask = F.dropout(torch.ones(64), 0.5)
    after_first = torch.get_rng_state()
    with recomputation(CPU, states, exclusive=True):
        again = F.dropout(torch.ones(64), 0.5)
    assert torch.equal(mask, again)
    # The rest of the program draws as if no recomputation ran.
    assert torch.equal(torch.get_rng_state(), after_first)


def test_without_exclusive_use_the_cpu_generator_is_left_alone() -> None:
    """A partition known to draw nothing replays nothing: others may be drawing meanwhile."""
    with first_pass(CPU, exclusive=False) as states:
        pass
    torch.rand(1)
    before = torch.get_rng_state()
    with recomputation(CPU, states, exclusive=False):
        assert torch.equal(torch.get_rng_state(), before)


def test_each_pass_has_its_grad_mode_and_flag() -> None:
    x = torch.ones(2, requires_grad=True)
    with first_pass(CPU) as states:
        assert is_checkpointing() and not is_recomputing()
        assert not (x * 2).requires_grad
    with recomputation(CPU, states, exclusive=True):
        assert is_recomputing() and not is_checkpointing()
        assert (x * 2).requires_grad
    assert not is_checkpointing() and not is_recomputing()


def test_recomputation_in_another_thread_enters_the_first_pass_autocast() -> None:
    """The autograd engine recomputes in a thread of its own, where autocast starts off."""
    with torch.autocast('cpu', dtype=torch.bfloat16):
        with first_pass(CPU) as states:
            first = (torch.ones(2, 2) @ torch.ones(2, 2)).dtype
    seen: List[torch.dtype] = []

    def recompute() -> None:
        with recomputation(CPU, states, exclusive=True):
            seen.append((torch.ones(2, 2) @ torch.ones(2, 2)).dtype)

    thread = threading.Thread(target=recompute)
    thread.start()
    thread.join(timeout=30)
    assert first == seen[0] == torch.bfloat16

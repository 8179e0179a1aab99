"""Random numbers: replayed by every recomputation, drawn in one order on any path.

With worker threads (``cpu:0``, ``cpu:1``, ...) tasks run at the same time,
but PyTorch has one CPU generator. Whatever the devices, a recomputation must
replay the random numbers of its own first pass, and the results must be
identical to the same pipeline run on one thread, and to the unwrapped model
run on the micro-batches in clock order.
"""
import copy
import os
import subprocess
import sys
import threading
from typing import List, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from benchmarks import untraced
from helpers import CHECKPOINT_MODES, assert_same_random_step, cpu_devices
from torchgpipe import GPipe
from torchgpipe.foundation.rng import cpu_generator_lock, restore_rng_states, save_rng_states



def test_stacked_dropout_gradient_is_output_over_input(checkpoint: str, threaded: bool) -> None:
    """Through dropout layers only, d(sum y)/dx = y / x exactly, if the backward
    uses the masks of the forward. A recomputation that drew other masks (as
    when another thread drew from the generator meanwhile) breaks it."""
    gpipe = GPipe(nn.Sequential(*[nn.Dropout(0.5) for _ in range(8)]), [2, 2, 2, 2],
                  devices=cpu_devices(4, threaded), chunks=4, checkpoint=checkpoint)
    for _ in range(5):
        x = torch.rand(16, 64, dtype=torch.double).add_(0.5).requires_grad_()
        y = gpipe(x)
        y.sum().backward()
        assert torch.equal(x.grad, y.detach() / x.detach())
        assert (y == 0).any() and (y != 0).any()


def dropout_model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.3),
                         nn.Tanh(), nn.Dropout(0.5), nn.Linear(8, 8)).double()


def step(model: nn.Module, input: Tensor, seed: int) -> Tuple[Tensor, List[Tensor]]:
    torch.manual_seed(seed)
    output = model(input)
    output.pow(2).sum().backward()
    after = torch.rand(1)  # the generator's stream after the step
    return torch.cat([output.detach().flatten(), after]), [p.grad for p in model.parameters()]


def test_threads_draw_what_one_thread_draws(checkpoint: str) -> None:
    """Outputs, gradients and the generator's state afterwards are identical on
    both paths, step after step (the first steps learn which partitions draw)."""
    torch.manual_seed(0)
    model = dropout_model()
    inline = GPipe(copy.deepcopy(model), [2, 3, 2], devices=cpu_devices(3, False), chunks=4,
                   checkpoint=checkpoint)
    threads = GPipe(copy.deepcopy(model), [2, 3, 2], devices=cpu_devices(3, True), chunks=4,
                    checkpoint=checkpoint)
    for seed in range(4):
        input = torch.randn(8, 8, dtype=torch.double)
        expected, expected_grads = step(inline, input, seed)
        actual, actual_grads = step(threads, input, seed)
        assert torch.equal(actual, expected)
        for g, h in zip(actual_grads, expected_grads):
            assert torch.equal(g, h)


LAYERS = ['linear', 'dropout', 'tanh', 'alpha_dropout']


def make_layer(kind: str) -> nn.Module:
    return {'linear': lambda: nn.Linear(6, 6), 'dropout': lambda: nn.Dropout(0.4),
            'tanh': nn.Tanh, 'alpha_dropout': lambda: nn.AlphaDropout(0.3)}[kind]()


@settings(max_examples=40, deadline=None)
@given(st.lists(st.sampled_from(LAYERS), min_size=2, max_size=8), st.data())
def test_dropout_transparency_on_threads(kinds: List[str], data: st.DataObject) -> None:
    """GPipe with worker threads computes what the unwrapped model computes on the
    micro-batches in clock order (which draws the random numbers GPipe draws)."""
    n = data.draw(st.integers(2, min(4, len(kinds))), label='partitions')
    cuts = sorted(data.draw(st.sets(st.integers(1, len(kinds) - 1), min_size=n - 1,
                                    max_size=n - 1), label='cuts'))
    balance = [b - a for a, b in zip([0, *cuts], [*cuts, len(kinds)])]
    chunks = data.draw(st.integers(1, 5), label='chunks')
    checkpoint = data.draw(st.sampled_from(CHECKPOINT_MODES), label='checkpoint')
    torch.manual_seed(data.draw(st.integers(0, 2**16), label='seed'))

    model = nn.Sequential(*[make_layer(k) for k in kinds]).double()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, balance, devices=cpu_devices(n, True), chunks=chunks,
                  checkpoint=checkpoint)
    actual, expected = assert_same_random_step(reference, gpipe,
                                               torch.randn(10, 6, dtype=torch.double))
    assert torch.equal(actual, expected)


class Noise(nn.Module):
    """Adds noise from the CPU generator, not through an nn.Dropout."""

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.randn(x.shape, dtype=x.dtype)


def test_which_partitions_draw_is_learned_per_training_mode() -> None:
    gpipe = GPipe(nn.Sequential(nn.Linear(4, 4), nn.Dropout(), Noise(), nn.Linear(4, 4)),
                  [1, 1, 1, 1], devices=cpu_devices(4, True), chunks=2)
    traits = gpipe.core.state.traits
    gpipe(torch.randn(4, 4))
    assert [list(t.draws_random.values()) for t in traits] == [[False], [True], [True], [False]]
    gpipe.eval()
    gpipe(torch.randn(4, 4))
    assert [sorted(t.draws_random.values()) for t in traits] == \
        [[False, False], [False, True], [True, True], [False, False]]


def test_one_thread_learns_too() -> None:
    """On one thread too, the first task of each partition learns whether it draws:
    a checkpointed task of one known to draw nothing then skips the replay of the
    CPU generator."""
    gpipe = GPipe(nn.Sequential(nn.Dropout(), nn.Linear(4, 4)), [1, 1],
                  devices=cpu_devices(2, False), chunks=2)
    gpipe(torch.randn(4, 4))
    assert [set(t.draws_random.values()) for t in gpipe.core.state.traits] == \
        [{True}, {False}]


def test_restore_puts_the_generator_back() -> None:
    device = torch.device('cpu')
    states = save_rng_states(device)
    expected = torch.rand(3)
    outside = torch.get_rng_state()
    with restore_rng_states(device, states, exclusive=True):
        assert torch.equal(torch.rand(3), expected)
    assert torch.equal(torch.get_rng_state(), outside)


def test_a_replay_that_draws_nothing_leaves_the_cpu_generator_to_other_threads() -> None:
    """A recomputation known not to draw from the CPU generator does not swap its
    state: a thread drawing meanwhile, holding the generator as a recomputation
    that draws does (each CUDA device has its own backward thread), gets the
    numbers it would get alone."""
    device = torch.device('cpu')
    torch.manual_seed(1)
    other = save_rng_states(device)
    torch.manual_seed(0)
    expected = [torch.rand(1) for _ in range(3000)]
    stop = threading.Event()

    def replay_nothing() -> None:
        while not stop.is_set():
            with restore_rng_states(device, other, exclusive=False):
                pass

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    replayer = threading.Thread(target=replay_nothing)
    try:
        replayer.start()
        with cpu_generator_lock:
            torch.manual_seed(0)
            drawn = [torch.rand(1) for _ in range(3000)]
    finally:
        stop.set()
        replayer.join()
        sys.setswitchinterval(interval)
    assert all(torch.equal(a, b) for a, b in zip(drawn, expected))


@pytest.mark.cuda
def test_cuda_dropout_gradient_is_output_over_input_on_every_device() -> None:
    n = torch.cuda.device_count()
    gpipe = GPipe(nn.Sequential(*[nn.Dropout(0.5) for _ in range(2 * n)]), [2] * n,
                  devices=list(range(n)), chunks=4, checkpoint='always')
    x = torch.rand(16, 64, device='cuda:0').add_(0.5).requires_grad_()
    y = gpipe(x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, (y.detach() / x.detach()).to(x.device))


@pytest.mark.slow
def test_generator_state_calls_never_deadlock_under_stress() -> None:
    """Many threads reading and writing the CPU generator's state never wait for each
    other for ever: two Python threads train four pipelines with worker threads
    (train_step and the forward path), under conditions that make a collection
    yield the GIL inside a state call almost every time (tests/stress_generator_lock.py).
    Without one lock around every state call, this hung in 3 of 4 runs of 150
    steps (measured once; the suite runs 70, for its time)."""
    script = os.path.join(os.path.dirname(os.path.dirname(__file__)), 'stress_generator_lock.py')
    # Untraced: coverage.py's tracing would about double the steps' time,
    # and fewer steps in the same time would stress the lock less.
    with untraced():
        result = subprocess.run([sys.executable, script, '--steps', '70', '--deadline', '150'],
                                capture_output=True, text=True, timeout=200)
    # On a hang, faulthandler printed every thread's stack: show them.
    assert result.returncode == 0, result.stderr[-20000:]

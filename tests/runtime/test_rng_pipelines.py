"""Random numbers replayed exactly while several pipelines run in several threads.

PyTorch has one CPU generator per process. A recomputation replays its first
pass by restoring the generator's state saved at its start; if a task of
another pipeline drew in between, the recomputation draws other numbers (another
dropout mask) than its first pass did, and the gradients are silently wrong.
Every task that may draw holds :data:`torchgpipe.foundation.rng.cpu_generator_lock` while it
draws; here two pipelines train at once, in two Python threads, by each engine
(the forward path and ``train_step``) on each path (one thread, worker threads),
and every recomputation is checked against its first pass.
"""
import functools
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, Iterator, List, Sequence, Set, Tuple, cast

import pytest
import torch
from torch import Tensor, nn

from helpers import cpu_devices
from torchgpipe import GPipe, is_checkpointing, is_recomputing
from torchgpipe.foundation.rng import cpu_generator_lock

pytestmark = pytest.mark.slow

#: Two pipelines at once must finish well within this, or the test fails, with
#: every thread's stack, instead of hanging.
DEADLINE = 120.0
STEPS = 40
CHUNKS = 4
#: The checkpoint mode of each of the two pipelines.
CHECKPOINTS = ['always', 'except_last']


class RecordedDropout(nn.Module):
    """A linear layer, then dropout (p=0.5) whose masks are recorded and compared.

    The first pass remembers its mask under its input's bytes (every
    micro-batch's input differs); the recomputation, which runs on the same
    input, finds it there and compares. A recomputation whose input was not
    seen counts as a mismatch too (an earlier layer of its partition replayed
    another mask).
    """

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8).double()
        self.first: Dict[bytes, Tensor] = {}
        self.recomputed = 0
        self.mismatched = 0

    def forward(self, x: Tensor) -> Tensor:
        key = x.detach().numpy().tobytes()
        y = self.linear(x)
        # Lets another thread run between the checkpoint's save of the
        # generator's state and the draw below, as a slower layer would.
        time.sleep(0)
        # Drawn from PyTorch's CPU generator, as nn.Dropout draws.
        mask = torch.rand_like(y) < 0.5
        if is_recomputing():
            self.recomputed += 1
            first = self.first.pop(key, None)
            if first is None or not torch.equal(first, mask):
                self.mismatched += 1
        elif is_checkpointing():
            self.first[key] = mask
        return y * mask * 2


def model() -> nn.Sequential:
    return nn.Sequential(*[RecordedDropout() for _ in range(3)])


def forward_step(gpipe: GPipe, input: Tensor, target: Tensor) -> None:
    """A step of the drop-in path: GPipe's forward, then the caller's backward."""
    (gpipe(input) - target).pow(2).sum().backward()


def train_step(schedule: str) -> Callable[[GPipe, Tensor, Tensor], None]:
    """A step of ``train_step`` by ``schedule``."""
    def step(gpipe: GPipe, input: Tensor, target: Tensor) -> None:
        gpipe.train_step(input, target, lambda y, t: (y - t).pow(2).sum(), schedule=schedule,
                         reduction='sum')
    return step


def train(gpipe: GPipe, step: Callable[[GPipe, Tensor, Tensor], None], seed: int,
          stop: threading.Event) -> None:
    """Runs ``STEPS`` steps; the inputs come from a generator of the thread's own.

    Drawing them from PyTorch's CPU generator, outside any pipeline, would
    take numbers from under the other thread's pipeline (see docs/guide.rst).
    """
    generator = torch.Generator().manual_seed(seed)
    for _ in range(STEPS):
        if stop.is_set():
            return
        input = torch.randn(4 * CHUNKS, 8, dtype=torch.double, generator=generator)
        target = torch.randn(4 * CHUNKS, 8, dtype=torch.double, generator=generator)
        step(gpipe, input, target)


def run_threads(targets: Sequence[Callable[[threading.Event], None]]) -> None:
    """Runs each target in a thread of its own, all at once, until all are done.

    Each target gets an event, set when the others are given up on: it
    should return at its next step.

    Raises:
        AssertionError: the threads were not done by :data:`DEADLINE` (with
            every thread's stack): a deadlock
        BaseException: what the first failing target raised
    """
    stop = threading.Event()
    errors: List[BaseException] = []

    def run(target: Callable[[threading.Event], None]) -> None:
        try:
            target(stop)
        except BaseException as exc:
            errors.append(exc)

    # Daemons: a thread that hangs must not keep the test run from ending.
    threads = [threading.Thread(target=run, args=(target,), daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=DEADLINE)
    if any(thread.is_alive() for thread in threads):
        stop.set()
        pytest.fail(f'not done in {DEADLINE:.0f} s: a deadlock? Every thread\'s stack:\n'
                    f'{stacks()}')
    if errors:
        raise errors[0]


def stacks() -> str:
    """Every thread's stack, for the report of a hang."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    return '\n'.join(f'{names.get(ident, ident)}:\n' + ''.join(traceback.format_stack(frame))
                     for ident, frame in sys._current_frames().items())


@pytest.fixture
def often_switching_threads() -> Iterator[None]:
    # Python threads switch every 5 ms by default; every 10 µs, tasks of the two
    # pipelines interleave far more often, as on a busy machine.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(interval)


def run_side_by_side(steps: Tuple[Callable[[GPipe, Tensor, Tensor], None], ...],
                     threaded: bool) -> List[RecordedDropout]:
    """Trains one pipeline per step function, each in a thread of its own, all at once.

    Returns:
        the recording layers of every pipeline
    """
    # The second pipeline's last micro-batch is not checkpointed: it draws
    # without saving the state, and must not draw into the first's replays.
    gpipes = [GPipe(model(), [1, 1, 1], devices=cpu_devices(3, threaded), chunks=CHUNKS,
                    checkpoint=mode) for mode, _ in zip(CHECKPOINTS, steps)]
    run_threads([functools.partial(train, gpipe, step, seed)
                 for seed, (gpipe, step) in enumerate(zip(gpipes, steps))])
    return [layer for gpipe in gpipes for layer in gpipe.modules()
            if isinstance(layer, RecordedDropout)]


STEP_PAIRS = {
    'forward+forward': (forward_step, forward_step),
    'forward+train_step': (forward_step, train_step('1f1b')),
    'train_step+train_step': (train_step('1f1b'), train_step('fill_drain')),
}


@pytest.mark.usefixtures('often_switching_threads')
@pytest.mark.parametrize('pair', sorted(STEP_PAIRS))
def test_pipelines_in_two_threads_replay_every_dropout_mask(pair: str, threaded: bool) -> None:
    """Each recomputation draws the mask its first pass drew, while another pipeline
    draws in another thread. Before every task that may draw held the CPU generator,
    a tenth to over half of them drew another mask, in every pair but train_step +
    train_step on worker threads (whose forward actions already held it)."""
    layers = run_side_by_side(STEP_PAIRS[pair], threaded)
    recomputed = sum(layer.recomputed for layer in layers)
    mismatched = sum(layer.mismatched for layer in layers)
    # Every checkpointed micro-batch of every step is recomputed once.
    assert recomputed == STEPS * (CHUNKS + CHUNKS - 1) * 3
    assert mismatched == 0, f'{mismatched} of {recomputed} recomputations drew another mask'
    # Every first pass was matched by its recomputation.
    assert all(layer.first == {} for layer in layers)


class Holds(nn.Module):
    """Runs ``layer``, recording whether its task held the CPU generator, by pass."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.held: Dict[str, Set[bool]] = {'first': set(), 'recompute': set()}

    def forward(self, x: Tensor) -> Tensor:
        # Whether this thread holds the lock (CPython's RLock knows its owner).
        owned = cast(Any, cpu_generator_lock)._is_owned()
        self.held['recompute' if is_recomputing() else 'first'].add(owned)
        return self.layer(x)


@pytest.mark.parametrize('engine', ['forward', 'train_step'])
def test_only_partitions_known_to_draw_nothing_run_without_the_cpu_generator(
        engine: str, threaded: bool) -> None:
    """Every task that may draw holds the CPU generator, in its first pass and its
    recomputation; once a partition is known to draw nothing, its tasks run without
    it, never waiting for another pipeline. The first task of each partition learns
    it, holding the generator, on worker threads and on one thread alike."""
    gpipe = GPipe(nn.Sequential(Holds(nn.Linear(4, 4)), Holds(nn.Dropout()),
                                Holds(nn.Linear(4, 4))),
                  [1, 1, 1], devices=cpu_devices(3, threaded), chunks=2, checkpoint='always')
    layers = [cast(Holds, layer) for layer in gpipe]
    step = {'forward': forward_step, 'train_step': train_step('1f1b')}[engine]
    input, target = torch.randn(4, 4), torch.randn(4, 4)

    step(gpipe, input, target)
    # Not known yet at the first task of each partition: it may draw.
    assert all(True in layer.held['first'] for layer in layers)

    for layer in layers:
        layer.held = {'first': set(), 'recompute': set()}
    step(gpipe, input, target)
    held = {'first': {True}, 'recompute': {True}}
    free = {'first': {False}, 'recompute': {False}}
    last = free
    if engine == 'train_step':
        # The loss may be another function at every call: whether the last
        # partition draws, its loss included, is learned anew in every step.
        last = {'first': {True, False}, 'recompute': {False}}
    assert [layer.held for layer in layers] == [free, held, last]


@pytest.mark.parametrize('engine', ['forward', 'train_step'])
def test_a_pipeline_inside_a_partition_of_another_draws_under_its_hold(
        engine: str, threaded: bool) -> None:
    """A GPipe with worker threads inside a partition of another: its workers run
    while their caller's task holds the CPU generator, and must draw under that
    hold instead of waiting for it (for ever). Both pipelines' recomputations
    replay: through dropout alone, d(sum y)/dx = y / x exactly."""
    inner = GPipe(nn.Sequential(*[nn.Dropout() for _ in range(3)]), [1, 1, 1],
                  devices=cpu_devices(3, True), chunks=2)
    outer = GPipe(nn.Sequential(nn.Dropout(), inner, nn.Dropout()), [1, 1, 1],
                  devices=cpu_devices(3, threaded), chunks=2, checkpoint='always')
    outputs: List[Tensor] = []

    def loss_fn(y: Tensor, target: Tensor) -> Tensor:
        if not is_recomputing():
            outputs.append(y.detach())
        return y.sum()

    def steps(stop: threading.Event) -> None:
        generator = torch.Generator().manual_seed(0)
        for _ in range(3):
            if stop.is_set():
                return
            x = torch.rand(8, 16, dtype=torch.double, generator=generator).add_(0.5)
            x.requires_grad_()
            if engine == 'forward':
                y = outer(x)
                y.sum().backward()
            else:
                outputs.clear()
                outer.train_step(x, torch.zeros_like(x), loss_fn, reduction='sum')
                y = torch.cat(outputs)
            assert x.grad is not None and torch.equal(x.grad, y.detach() / x.detach())
            assert (y == 0).any() and (y != 0).any()

    run_threads([steps])

"""A thread that draws from the CPU generator during a step is caught, not silently wrong.

Another thread of the program drawing from PyTorch's one CPU generator
between a checkpointed micro-batch's first pass and its recomputation makes
the recomputation draw another dropout mask: the gradients would be wrong.
The recomputation finds the generator elsewhere than its first pass left it
and raises, on both execution paths, in both engines (the drop-in path's
backward and ``train_step``). A layer here makes the draw happen at the
moment each test needs, in a thread of its own, so the tests do not depend
on timing.
"""
import threading
from typing import Optional

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import cpu_devices
from torchgpipe import GPipe, is_checkpointing, is_recomputing

MESSAGE = 'a recomputation drew other random numbers than its first pass'


class DrawElsewhere(nn.Module):
    """Has another thread draw from the CPU generator (or from its own), during the
    first pass of a checkpointed micro-batch, during its recomputation, or
    always (``when``: ``'first'``, ``'recompute'``, ``'always'``; else never)."""

    def __init__(self, when: str, generator: Optional[torch.Generator] = None) -> None:
        super().__init__()
        self.when = when
        self.generator = generator

    def forward(self, x: Tensor) -> Tensor:
        if (self.when == 'first' and is_checkpointing()) or \
                (self.when == 'recompute' and is_recomputing()) or self.when == 'always':
            thread = threading.Thread(target=torch.rand, args=(8,),
                                      kwargs={'generator': self.generator})
            thread.start()
            thread.join()
        return x


def model(when: str, generator: Optional[torch.Generator] = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5), DrawElsewhere(when, generator),
                         nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 2)).double()


def step(gpipe: GPipe, how: str) -> None:
    input = torch.randn(8, 8, dtype=torch.float64)
    target = torch.randn(8, 2, dtype=torch.float64)
    if how == 'backward':
        F.mse_loss(gpipe(input), target).backward()
    else:
        gpipe.train_step(input, target, F.mse_loss, schedule=how)


HOWS = ['backward', '1f1b', 'zb_h1']


@pytest.mark.parametrize('how', HOWS)
@pytest.mark.parametrize('when', ['first', 'recompute'])
def test_a_draw_of_another_thread_is_an_error(threaded: bool, when: str, how: str) -> None:
    gpipe = GPipe(model(when), [3, 3], devices=cpu_devices(2, threaded), chunks=4,
                  checkpoint='always')
    with pytest.raises(RuntimeError, match=MESSAGE) as caught:
        step(gpipe, how)
    assert 'torch.Generator of its own' in str(caught.value)


def assert_trains_as_quiet(drawn: nn.Sequential, quiet: nn.Sequential, threaded: bool,
                           how: str) -> None:
    """A step of ``drawn``, whose layer has another thread draw, gives the gradients of
    ``quiet``, the same model without that thread, with the same seed."""
    pipes = [GPipe(m, [3, 3], devices=cpu_devices(2, threaded), chunks=4, checkpoint='always')
             for m in (drawn, quiet)]
    for gpipe in pipes:
        torch.manual_seed(5)
        step(gpipe, how)
    for a, b in zip(pipes[0].parameters(), pipes[1].parameters()):
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize('how', HOWS)
def test_a_thread_with_a_generator_of_its_own_changes_nothing(threaded: bool, how: str) -> None:
    """The fix the message gives: the gradients are those of a model without the thread."""
    own = torch.Generator().manual_seed(1)
    assert_trains_as_quiet(model('first', own), model('never'), threaded, how)


def test_without_checkpoints_nothing_is_replayed_and_nothing_raised(threaded: bool) -> None:
    # Another thread's draw only changes which numbers the pass draws, as it
    # would for the unwrapped model: nothing is recomputed from a saved state.
    gpipe = GPipe(model('always'), [3, 3], devices=cpu_devices(2, threaded), chunks=4,
                  checkpoint='never')
    step(gpipe, '1f1b')


@pytest.mark.parametrize('how', HOWS)
def test_a_partition_that_draws_nothing_is_left_alone(threaded: bool, how: str) -> None:
    """Another thread's draw changes no number of a pass that draws none (a model
    built in another thread while this one trains, say): nothing to raise."""
    def layers(when: str) -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 8), DrawElsewhere(when), nn.Tanh(),
                             nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    assert_trains_as_quiet(layers('first'), layers('never'), threaded, how)

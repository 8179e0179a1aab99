"""The layer timer: in a whole pass (the planner's), each layer's part of it is the work
its partition would run, wherever the engine runs it; apart (balance_by_time's), each
layer's own backward pass, a layer's copy at a time.

The clock is a stand-in that moves only inside the layers' backward passes, by
what each declares: the times asserted are those the timing attributes, not
the machine's.
"""
import copy
import weakref
from types import SimpleNamespace
from typing import Any, Generator, List, Tuple

import pytest
import torch
from torch import Tensor, nn

from torchgpipe.balance import timing
from torchgpipe.skip import pop, skippable, stash


class Clock:
    """The stand-in for :func:`time.perf_counter` (from 100: a stamp of 0 means none)."""

    now = 100.0

    @classmethod
    def perf_counter(cls) -> float:
        return cls.now


class Costly(torch.autograd.Function):
    """The identity, whose backward pass takes ``cost`` seconds of the stand-in clock."""

    @staticmethod
    def forward(ctx: Any, input: Tensor, cost: float) -> Tensor:
        ctx.cost = cost
        return input.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        Clock.now += ctx.cost
        return grad, None


@skippable(stash=['projection'])
class Shortcut(nn.Module):
    """Stashes a projection of its input, of a second's backward pass; passes the input on."""

    def forward(self, input: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash('projection', Costly.apply(input, 1.0))  # type: ignore[no-untyped-call]
        return input


class Step(nn.Module):
    """A layer whose backward pass takes ``cost`` seconds."""

    def __init__(self, cost: float) -> None:
        super().__init__()
        self.cost = cost

    def forward(self, input: Tensor) -> Tensor:
        return Costly.apply(input, self.cost)  # type: ignore[no-untyped-call,no-any-return]


@skippable(pop=['projection'])
class Add(nn.Module):
    def forward(self, input: Tensor) -> Generator[Any, Any, Tensor]:
        projection = yield pop('projection')
        return input + projection  # type: ignore[no-any-return]


@pytest.fixture
def layers(monkeypatch: pytest.MonkeyPatch) -> List[nn.Module]:
    monkeypatch.setattr(timing, 'time', SimpleNamespace(perf_counter=Clock.perf_counter))
    monkeypatch.setattr(Clock, 'now', 100.0)
    return [nn.Sequential(nn.Linear(4, 4), Step(0.1)), Shortcut(), Step(0.01), Add()]


@pytest.mark.parametrize('split', [False, True], ids=['B', 'I'])
def test_a_shortcuts_projection_is_timed_on_the_shortcut(layers: List[nn.Module],
                                                         split: bool) -> None:
    """The engine runs the projection's backward pass after the layer after the shortcut
    (it was made before it), before the boundary of the shortcut, whose output is its
    input: timed at the layers' boundaries alone, the layer after would take both. In a
    pipeline, the shortcut's partition runs it; the first layer's work (made before the
    shortcut ran, and under the projection) stays the first layer's, which ``I`` does
    not run (its output is the leaf ``I`` stops at)."""
    times = timing.layer_times(layers, torch.randn(2, 4), torch.device('cpu'), split)
    backward = times.input if split else times.backward
    assert backward[1] == pytest.approx(1.0)
    assert backward[2] == pytest.approx(0.01)
    assert backward[0] == pytest.approx(0.0 if split else 0.1)


def test_layer_by_layer_a_stash_is_timed_on_its_layer(layers: List[nn.Module]) -> None:
    """Apart, each layer's backward pass runs right after its forward pass, from its output
    and its stashed skips: the projection's second is the shortcut's."""
    times = timing.layer_times_apart(layers, torch.randn(2, 4), torch.device('cpu'))
    assert times.backward == pytest.approx([0.1, 1.0, 0.01, 0.0])
    assert times.forward == pytest.approx([0.0] * 4)


def test_layer_by_layer_holds_one_copy_at_a_time(layers: List[nn.Module]) -> None:
    """Given one layer's copy at a time, as balance_by_time gives them, the timer lets each
    go once the next has run: a model larger than the device is timed a layer at a time."""
    alive: List[List[int]] = []
    copies: List['weakref.ref[nn.Module]'] = []

    def one_at_a_time() -> Generator[nn.Module, None, None]:
        for layer in layers:
            alive.append([k for k, ref in enumerate(copies) if ref() is not None])
            made = copy.deepcopy(layer)
            copies.append(weakref.ref(made))
            yield made
    timing.layer_times_apart(one_at_a_time(), torch.randn(2, 4), torch.device('cpu'))
    # (The layer before the one made is still the loop's until that one's pass.)
    assert alive == [[], [0], [1], [2]]

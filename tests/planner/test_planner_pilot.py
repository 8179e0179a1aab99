"""The planner's pilot: the pace of a pipeline on CPU, found from steps of the model.

Whatever steps the pilot measures, the pace found for each size makes the
simulator predict them; sizes no number of micro-batches makes whole take
the line between their neighbours; a plan for CPU threads carries a pace per
size, and its pilot leaves the model as it was.
"""
import time
from typing import Any, Dict, List, Optional, Sequence

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import torchgpipe
from helpers import cpu_devices
from test_planner import linear_costs
from torchgpipe import GPipe
from torchgpipe.planner import calibrate
from torchgpipe.planner.pilot import (SLOWEST, STEPS, fill_in, model_steps, pace, paced,
                                      scaled, time_balance)
from torchgpipe.planner.predict import Candidate, predict

pytestmark = pytest.mark.slow


@settings(max_examples=10, deadline=None)
@given(data=st.data(), workers=st.integers(2, 3), overhead=st.sampled_from([0.0, 2e-4]))
def test_the_pace_found_makes_the_simulator_predict_the_steps_measured(
        data: st.DataObject, workers: int, overhead: float) -> None:
    costs = linear_costs(6, batch=16)  # sizes 1, 2, 4, 8, 16
    costs.overhead = overhead
    # What a pipeline of threads would measure: the layers slowed by a factor per size.
    truth = {size: data.draw(st.floats(0.5, SLOWEST / 2), label=f'pace at {size}')
             for size in costs.sizes}
    asked: List[Sequence[int]] = []

    def step(balance: Sequence[int], chunks: int) -> float:
        asked.append(balance)
        candidate = Candidate('1f1b', tuple(balance), chunks, 'never', workers)
        return predict(scaled(costs, {16 // chunks: truth[16 // chunks]}), candidate).step

    found = pace(costs, workers, step)
    assert found == pytest.approx([truth[s] for s in costs.sizes], rel=1e-6)
    # A round of one step of each size, one more to warm up, on one partition per worker.
    assert len(asked) == (STEPS + 1) * len(costs.sizes)
    assert all(len(b) == workers for b in asked)
    # Paced, the costs predict every size's pilot step.
    faster = paced(costs, found)
    assert faster.pace == found
    for size in costs.sizes:
        candidate = Candidate('1f1b', time_balance(costs, size, workers), 16 // size,
                              'never', workers)
        assert predict(faster, candidate).step == pytest.approx(
            step(candidate.balance, 16 // size), rel=1e-6)


def test_a_pace_scales_the_times_of_its_size_alone() -> None:
    costs = linear_costs(4, batch=16, heavy=1)
    faster = scaled(costs, {4: 2.5})
    for size, before, after in zip(costs.sizes, costs.table, faster.table):
        factor = 2.5 if size == 4 else 1.0
        for name in ('forward', 'input', 'backward', 'weight'):
            assert getattr(after, name) == pytest.approx(
                [factor * t for t in getattr(before, name)]), (size, name)
        for name in ('kept', 'output', 'working', 'unsaved'):
            assert getattr(after, name) == getattr(before, name), (size, name)
    # A size between takes the line between its neighbours, the scaled one
    # scaled: not what the unscaled costs had cached for it.
    assert costs.at(3).forward == pytest.approx([3e-3] * 4)
    assert faster.at(3).forward == pytest.approx([(2e-3 + 2.5 * 4e-3) / 2] * 4)


def test_a_size_no_split_makes_whole_or_the_simulator_cannot_predict_takes_its_neighbours(
        ) -> None:
    costs = linear_costs(6, batch=12)  # sizes 1, 2, 4 and 8: no split makes 8 whole
    costs.overhead = 1e-3

    def step(balance: Sequence[int], chunks: int) -> float:
        # Size 1 shorter than the pipeline's overheads alone: no factor predicts it.
        candidate = Candidate('1f1b', tuple(balance), chunks, 'never', 2)
        return 1e-6 if chunks == 12 else predict(scaled(costs, {12 // chunks: 2.0}),
                                                 candidate).step
    assert pace(costs, 2, step) == pytest.approx([2.0, 2.0, 2.0, 2.0], rel=1e-6)
    assert fill_in([1, 2, 4], [1.0, None, 3.0]) == pytest.approx([1.0, 5 / 3, 3.0])
    assert fill_in([1, 2, 4], [None, 2.0, None]) == [2.0, 2.0, 2.0]
    assert fill_in([1, 2], [None, None]) == [1.0, 1.0]


@given(found=st.lists(st.one_of(st.none(), st.floats(0.5, 4.0)), min_size=1, max_size=6))
def test_a_size_without_a_pace_takes_the_line_between_its_neighbours(
        found: List[Optional[float]]) -> None:
    sizes = [2 ** k for k in range(len(found))]
    filled = fill_in(sizes, found)
    known = [(s, f) for s, f in zip(sizes, found) if f is not None]
    for size, given_, value in zip(sizes, found, filled):
        if given_ is not None:
            assert value == given_
        elif not known:
            assert value == 1.0
        else:
            below = [k for k in known if k[0] < size]
            above = [k for k in known if k[0] > size]
            if below and above:
                (low, a), (high, b) = below[-1], above[0]
                assert min(a, b) - 1e-12 <= value <= max(a, b) + 1e-12
                assert value == pytest.approx(a + (b - a) * (size - low) / (high - low))
            else:
                assert value == (below[-1] if below else above[0])[1]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Dropout(0.5),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


@pytest.mark.parametrize('loss', [True, False], ids=['loss', 'no loss'])
def test_a_plan_of_threads_carries_a_pace_per_size_and_leaves_the_model(loss: bool) -> None:
    module, sample = model(), torch.randn(16, 8)
    state = {k: v.clone() for k, v in module.state_dict().items()}
    kwargs: Dict[str, object] = {'target': torch.randn(16, 4), 'loss_fn': F.mse_loss} \
        if loss else {}
    rng = torch.get_rng_state()
    plan = torchgpipe.plan(module, sample, devices=['cpu:0', 'cpu:1'], chunks=4, repeat=1,
                           **kwargs)
    assert plan.costs is not None
    assert len(plan.costs.pace) == len(plan.costs.sizes)
    assert all(0 < f <= SLOWEST for f in plan.costs.pace)
    # The pilot trained a copy: the running statistics, the gradients and the
    # random state (its dropout's draws) are as they were.
    assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())
    assert torch.equal(torch.get_rng_state(), rng)


def test_one_worker_has_no_pace() -> None:
    plan = torchgpipe.plan(model(), torch.randn(16, 8), devices=['cpu'], chunks=4, repeat=1)
    assert plan.costs is not None and plan.costs.pace == []


class SlowToStart(GPipe):
    """A pipeline whose calls take a second before their first task."""

    def train_step(self, *args: Any, **kwargs: Any) -> Any:
        time.sleep(1.0)
        return super().train_step(*args, **kwargs)


def test_the_pilot_times_a_step_from_its_first_task_to_its_last(
        threaded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the plan predicts, and what a trace shows: not the call's start and end. So do
    the calibration's steps."""
    devices = cpu_devices(2, threaded)
    calls: List[GPipe] = []

    def make(module: nn.Sequential, kwargs: Dict[str, Any]) -> GPipe:
        calls.append(SlowToStart(module, devices=devices, **kwargs))
        return calls[-1]

    step = model_steps(model(), torch.randn(16, 8), None, None, make)
    seconds = step([4, 3], 4)
    assert len(calls) == 1 and 0 < seconds < 1.0
    monkeypatch.setattr(calibrate, 'STEPS', 1)
    assert calibrate.median_step(calls[0], lambda: calls[0].train_step(
        torch.randn(16, 8), torch.randn(16, 4), F.mse_loss)) < 1.0

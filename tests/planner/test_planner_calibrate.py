"""The calibration of the pipeline's own costs: from the steps of an empty pipeline, the
overhead per task and the checkpoint's and the split backward pass's extra, and from
those of one with a skip, what a skip's message costs, with which the simulator predicts
those steps."""
import copy
from fractions import Fraction
from typing import Dict, Optional, Tuple
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from torchgpipe.engine.generators import named
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.simulator import simulate_sharing
from torchgpipe.planner import calibrate
from torchgpipe.planner.calibrate import (CHUNKS, Timer, skip_cost, skipping, task_overhead,
                                          zeros_loss)
from torchgpipe.planner.costs import Costs, measure
from torchgpipe.planner.predict import Candidate, predict

pytestmark = pytest.mark.slow


def simulated(truth: Tuple[float, float, float], p: int, cores: Optional[float]) -> Timer:
    """A timer whose steps are the simulator's for ``truth``: the seconds each task
    takes, that a checkpointed ``B`` takes more, and that an ``I`` or a ``W`` takes."""
    task, checkpoint, split = truth

    def timer(model: nn.Sequential, mode: str, schedule: str, input: Tensor) -> float:
        assert len(model) == p and input.shape[0] == CHUNKS

        def cost(action: Action) -> Fraction:
            seconds = split if action.kind in (Kind.I, Kind.W) else task
            if action.kind is Kind.B and mode == 'always':
                seconds += checkpoint
            return Fraction(round(seconds * 1e9))
        times = simulate_sharing(named(schedule, CHUNKS, p, p).workers, p, cost, cores)
        return float(max(end for _, end in times.values())) / 1e9
    return timer


microseconds = st.integers(0, 1000).map(lambda us: us * 1e-6)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 4), task=microseconds, checkpoint=microseconds, split=microseconds,
       cores=st.sampled_from([None, 1.0, 1.5]))
def test_the_calibration_finds_the_costs_that_made_its_steps(
        p: int, task: float, checkpoint: float, split: float, cores: Optional[float]) -> None:
    """Steps the simulator made from known costs give those costs back, on a core per
    worker or on fewer cores than workers."""
    truth = (task, checkpoint, split)
    found = task_overhead(simulated(truth, p, cores), p, cores)
    assert found == pytest.approx(truth, abs=1e-8)


@pytest.fixture(scope='module')
def skipping_costs() -> Dict[int, Costs]:
    """The measured costs of the skipping pipeline of 2 to 4 layers, once."""
    input = torch.zeros(CHUNKS, 1)
    return {p: measure(skipping(p), input, [1], torch.device('cpu'), repeat=1,
                       loss=(zeros_loss, torch.zeros_like(input)))
            for p in range(2, 5)}


@settings(max_examples=10, deadline=None)
@given(p=st.integers(2, 4), task=microseconds, skip=microseconds,
       cores=st.sampled_from([None, 1.5]))
def test_the_calibration_finds_what_a_skips_message_costs(
        skipping_costs: Dict[int, Costs], p: int, task: float, skip: float,
        cores: Optional[float]) -> None:
    """A step the simulator predicts for the skipping pipeline, its skip's messages costing
    ``skip`` each, gives a cost with which it predicts that step again (its layers measured
    as when it was predicted): ``skip``, or less where a message's cost is partly hidden
    (the least cost that makes the step)."""
    measured = skipping_costs[p]
    assert measured.skips == [(0, p - 1)]
    with mock.patch.object(calibrate, 'measure', lambda *_, **__: copy.deepcopy(measured)):
        truth = copy.deepcopy(measured)
        truth.overhead, truth.cores, truth.skip_overhead = task, cores, skip
        step = predict(truth, Candidate('1f1b', (1,) * p, CHUNKS, 'never', p)).step
        truth.skip_overhead = 0.0
        free = predict(truth, Candidate('1f1b', (1,) * p, CHUNKS, 'never', p)).step
        found = skip_cost(step, p, torch.device('cpu'), (task, 0.0, 0.0), (0.0, 0.0), cores)
        truth.skip_overhead = found
        again = predict(truth, Candidate('1f1b', (1,) * p, CHUNKS, 'never', p)).step
    # The simulator rounds each task's cost to a nanosecond: two costs a hair
    # apart can round apart on every task of the step's path.
    assert again == pytest.approx(step, abs=1e-7)
    assert found <= skip + 1e-8
    assert (step > free) == (skip > 0)  # the messages are on the step's path

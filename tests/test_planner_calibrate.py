"""The calibration of the pipeline's own costs: from the steps of an empty pipeline, the
overhead per task and the checkpoint's and the split backward pass's extra, with which
the simulator predicts those steps."""
from fractions import Fraction
from typing import Optional, Tuple

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from torchgpipe.engine.generators import named
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.simulator import simulate_sharing
from torchgpipe.planner.calibrate import CHUNKS, Timer, task_overhead


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

"""The calibration of the pipeline's own costs: from the steps of an empty pipeline, the
overhead per task, the checkpoint's and the split backward's extra, and a message's
latency with which the simulator predicts those steps."""
from fractions import Fraction
from typing import Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from torchgpipe.engine.generators import named
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.simulator import simulate_sharing
from torchgpipe.planner.calibrate import CHUNKS, Overheads, Timer, task_overhead


def simulated(truth: Overheads, p: int, cores: Optional[float]) -> Timer:
    """A timer whose steps are what the simulator gives for ``truth``'s costs."""
    def timer(model: nn.Sequential, checkpoint: str, schedule: str, input: Tensor) -> float:
        assert len(model) == p and input.shape[0] == CHUNKS

        def cost(action: Action) -> Fraction:
            seconds = truth.split if action.kind in (Kind.I, Kind.W) else truth.task
            if action.kind is Kind.B and checkpoint == 'always':
                seconds += truth.checkpoint
            return Fraction(round(seconds * 1e9))
        times = simulate_sharing(named(schedule, CHUNKS, p, p).workers, p, cost, cores,
                                 latency=Fraction(round(truth.latency * 1e9)))
        return float(max(end for _, end in times.values())) / 1e9
    return timer


microseconds = st.integers(0, 1000).map(lambda us: us * 1e-6)


@settings(max_examples=15, deadline=None)
@given(p=st.integers(2, 4), task=st.integers(50, 1000).map(lambda us: us * 1e-6),
       checkpoint=microseconds, split=microseconds, latency=microseconds,
       cores=st.sampled_from([None, 1.5]))
def test_the_calibration_finds_the_costs_that_made_its_steps(
        p: int, task: float, checkpoint: float, split: float, latency: float,
        cores: Optional[float]) -> None:
    """Steps made by the simulator from known costs give those costs back, the latency
    told apart from the overhead by 1F1B's and fill-drain's steps."""
    truth = Overheads(task, checkpoint, split, latency)
    found = task_overhead(simulated(truth, p, cores), p, cores)
    assert found == pytest.approx(truth, abs=2e-9 * CHUNKS * p)


def test_a_latency_is_not_an_overhead_per_task() -> None:
    """On one worker, nothing is sent: the steps give the overhead alone."""
    truth = Overheads(3e-4, 1e-4, 2e-4, 0.0)
    assert task_overhead(simulated(truth, 1, None), 1) == pytest.approx(truth, abs=1e-9)
    # Fill-drain as slow as 1F1B (four ranks on two cores, measured): no latency.
    steps = simulated(Overheads(3e-4, 1e-4, 2e-4, 0.0), 2, None)

    def slow_fill_drain(model: nn.Sequential, checkpoint: str, schedule: str,
                        input: Tensor) -> float:
        return steps(model, checkpoint, '1f1b' if schedule == 'fill_drain' else schedule,
                     input)
    found = task_overhead(slow_fill_drain, 2)
    assert found.latency == 0.0
    assert found.task == pytest.approx(3e-4, abs=1e-9)

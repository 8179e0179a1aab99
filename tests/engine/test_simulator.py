"""The simulator of a step with a core per worker or fewer cores than workers, and with
recomputations ahead of the gradients: what it must give, whatever the schedule and the
costs, and how the planner's predictions use it."""
from fractions import Fraction
from typing import Dict, Optional

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from torchgpipe.engine.generators import SCHEDULES, named
from torchgpipe.engine.schedule import Action, Kind, Schedule
from torchgpipe.engine.simulator import _shared, simulate, simulate_sharing
from torchgpipe.planner.predict import Candidate, predict
from test_planner import linear_costs


def shapes() -> 'st.SearchStrategy[tuple]':
    """(name, micro-batches, partitions, workers) of every built-in schedule."""
    return st.sampled_from(SCHEDULES).flatmap(lambda name: st.tuples(
        st.just(name), st.integers(1, 8),
        st.integers(1, 3).map(lambda k: 2 * k) if name in ('interleaved_1f1b', 'zbv')
        else st.integers(1, 4)))


def plan_and_costs(data: st.DataObject) -> 'tuple[Schedule, int, Dict[Action, Fraction]]':
    name, m, n = data.draw(shapes())
    workers = n // 2 if name in ('interleaved_1f1b', 'zbv') else n
    plan = named(name, m, n, workers)
    costs = {a: Fraction(data.draw(st.integers(0, 20))) for actions in plan.workers
             for a in actions}
    return plan, n, costs


def ahead_of(data: st.DataObject, costs: Dict[Action, Fraction]) -> Dict[Action, Fraction]:
    """A part ahead for some backward passes, from a little below 0 to a little more than
    their cost (which the simulators take as 0 and as all of it); none for the rest."""
    return {a: Fraction(data.draw(st.integers(-2, int(cost) + 2)))
            if a.kind in (Kind.B, Kind.I) and data.draw(st.booleans()) else Fraction(0)
            for a, cost in costs.items()}


def step(times: Dict[Action, tuple]) -> Fraction:
    return max((end for _, end in times.values()), default=Fraction(0))


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_a_core_per_worker_is_the_plain_simulation(data: st.DataObject) -> None:
    plan, n, costs = plan_and_costs(data)
    ahead = ahead_of(data, costs).__getitem__
    plain = simulate(plan.workers, n, costs.__getitem__, ahead)
    # A start is the end less the cost, whatever the action waited for after its part ahead.
    assert all(end - start == costs[a] for a, (start, end) in plain.items())
    cores = data.draw(st.sampled_from([None, len(plan.workers), len(plan.workers) + 0.5]))
    assert simulate_sharing(plan.workers, n, costs.__getitem__, cores, ahead) == plain
    # The events themselves, with cores enough, give the same times.
    capacity = Fraction(len(plan.workers) + data.draw(st.integers(0, 2)))
    assert _shared(plan.workers, n, costs.__getitem__, capacity, ahead) == plain


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_one_core_does_all_the_work_one_action_at_a_time(data: st.DataObject) -> None:
    """One core is never idle while an action is left (no schedule waits in a circle):
    the step is the sum of the work, whatever runs ahead."""
    plan, n, costs = plan_and_costs(data)
    ahead = ahead_of(data, costs).__getitem__
    shared = simulate_sharing(plan.workers, n, costs.__getitem__, 1, ahead)
    assert step(shared) == sum(costs.values())


@settings(max_examples=80, deadline=None)
@given(data=st.data(), cores=st.sampled_from([0.5, 1.0, 1.5, 2.0, 3.0]))
def test_shared_cores_stretch_the_step_within_bounds(data: st.DataObject, cores: float) -> None:
    """Sharing never makes a step faster than a core each, nor than the work over the
    cores; and since each action goes at least ``cores / workers`` of its speed, never
    slower than the plain step stretched by ``workers / cores``. Each worker still runs
    its actions in order, after what they wait for."""
    plan, n, costs = plan_and_costs(data)
    ahead = ahead_of(data, costs).__getitem__
    shared = simulate_sharing(plan.workers, n, costs.__getitem__, cores, ahead)
    plain = step(simulate(plan.workers, n, costs.__getitem__, ahead))
    capacity = min(Fraction(cores), Fraction(len(plan.workers)))
    assert max(plain, sum(costs.values()) / capacity) <= step(shared)
    assert step(shared) <= plain * max(1, len(plan.workers) / capacity)
    for actions in plan.workers:
        for before, after in zip(actions, actions[1:]):
            assert shared[before][1] <= shared[after][0]
    for action, (start, end) in shared.items():
        assert end - start >= costs[action]


@pytest.mark.parametrize('cores, p, expected', [
    (None, 1, 6), (None, 2, 9), (None, 4, 15), (4, 4, 15), (2, 2, 9),
    # Two cores: 0F0, then 1F0 beside 0's recomputation, each at full speed; then
    # 2F0 beside two recomputations (2/3 speed), ... until t = 9; the backward
    # passes after that one at a time.
    (2, 4, 17)])
def test_a_recomputation_ahead_waits_for_no_gradient(cores: Optional[float], p: int,
                                                     expected: int) -> None:
    """One micro-batch through ``p`` workers, F = 1, B = 5 of which a recomputation of 3:
    every worker but the last recomputes while the gradient is on its way, so only the
    last one's shows in the step (3p + 3), where inside B all ``p`` would (6p). On fewer
    cores than workers, the recomputations that run together share them."""
    plan = named('fill_drain', 1, p, p)

    def cost(action: Action) -> Fraction:
        return Fraction(1 if action.kind is Kind.F else 5)

    def recompute(action: Action) -> Fraction:
        return Fraction(3 if action.kind is Kind.B else 0)

    assert step(simulate_sharing(plan.workers, p, cost, cores)) == 6 * p
    ahead = simulate_sharing(plan.workers, p, cost, cores, recompute)
    assert step(ahead) == expected
    # Each backward pass spans its cost, the wait between its parts left out; longer
    # only where it shared the cores.
    spans = [ahead[actions[-1]][1] - ahead[actions[-1]][0] for actions in plan.workers]
    if cores is None or cores >= p:
        assert spans == [5] * p
    else:
        assert min(spans) >= 5 and max(spans) > 5


def test_four_workers_on_two_cores_go_at_half_speed_together() -> None:
    """Fill-drain's forward passes of four workers, each alone at first, then all four."""
    plan = named('fill_drain', 8, 4, 4)
    unit = lambda action: Fraction(1)  # noqa: E731
    shared = step(simulate_sharing(plan.workers, 4, unit, 2))
    assert step(simulate(plan.workers, 4, unit)) == 22  # 2 (m + p - 1)
    assert 32 <= shared < 44  # the work over two cores; the plain step, twice


@pytest.mark.parametrize('cores', [0, -1, 1e-6])
def test_cores_must_be_positive(cores: float) -> None:
    plan = named('1f1b', 2, 2, 2)
    with pytest.raises(ValueError, match='cores must be positive'):
        simulate_sharing(plan.workers, 2, lambda a: Fraction(1), cores)


def test_a_schedule_that_waits_in_a_circle_is_named() -> None:
    """As the plain simulator's clock order does, not a hang."""
    first, second = named('1f1b', 2, 2, 2).workers
    stuck = [first, [second[1], second[0], *second[2:]]]  # 1B0 before its own 1F0
    with pytest.raises(ValueError, match='cannot go on'):
        simulate_sharing(stuck, 2, lambda a: Fraction(1), 1)


def test_the_planner_predicts_with_the_cores_shared() -> None:
    """With ``Costs.cores``, a step of workers that all work at once takes longer, and one
    of a single micro-batch (one worker at a time) no longer; the costs keep the cores
    through JSON."""
    costs = linear_costs(8, batch=16)
    busy = Candidate('1f1b', (2, 2, 2, 2), 16, 'never', 4)
    alone = Candidate('1f1b', (2, 2, 2, 2), 1, 'never', 4)
    own = predict(costs, busy).step, predict(costs, alone).step
    costs.cores = 2.0
    shared = predict(costs, busy).step, predict(costs, alone).step
    assert shared[0] > own[0] * 1.2
    assert shared[1] == pytest.approx(own[1])
    costs.cores = None
    alone = predict(costs, busy).busy
    costs.cores = 1.0
    one = predict(costs, busy)
    assert one.step == pytest.approx(sum(sum(b.values()) for b in alone))
    # Each worker's work as a trace sees it: stretched while others work beside it.
    for stretched, own_work in zip(one.busy, alone):
        assert sum(stretched.values()) > sum(own_work.values()) * 1.2
        assert sum(stretched.values()) <= one.step * (1 + 1e-9)

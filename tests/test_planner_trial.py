"""The planner's trials: the few configurations predicted fastest, timed before choosing.

Whatever their steps measure, the tried come first, fastest measured first,
each with the median of its timed steps, and the rest follow as predicted;
a plan on CPU threads chooses the fastest it measured, within the memory
limit, and with ``trials=0`` the fastest predicted.
"""
import statistics
from typing import Any, Dict, List, Tuple

import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import torchgpipe
from test_planner import model
from torchgpipe.planner.option import Option
from torchgpipe.planner.trial import SPREAD, STEPS, shortlist, tried


def options(steps: List[float]) -> List[Option]:
    """Options predicted to take ``steps`` (sorted), each named by its chunks."""
    return [Option('1f1b', [1, 1], k + 1, 'never', 'loop', step, [0.0, 0.0])
            for k, step in enumerate(sorted(steps))]


@settings(max_examples=30, deadline=None)
@given(data=st.data(), trials=st.integers(0, 5),
       predicted=st.lists(st.floats(1.0, 2.0), min_size=1, max_size=7))
def test_the_shortlist_is_tried_and_ordered_by_its_median_step(
        data: st.DataObject, trials: int, predicted: List[float]) -> None:
    given_ = options(predicted)
    short = shortlist(given_, trials)
    # The first few, predicted within SPREAD of the fastest.
    assert short == given_[:len(short)] and len(short) <= trials
    fastest = given_[0].step
    assert all(o.step <= SPREAD * fastest for o in short)
    assert len(short) == min(trials, len(given_)) or \
        given_[len(short)].step > SPREAD * fastest
    measured = {o.chunks: data.draw(st.lists(st.floats(0.5, 3.0), min_size=STEPS + 1,
                                             max_size=STEPS + 1), label=f'steps of {o.chunks}')
                for o in short}
    calls: List[Tuple[int, str]] = []

    def step(kwargs: Dict[str, Any], schedule: str) -> float:
        chunks = kwargs['chunks']
        calls.append((chunks, schedule))
        return measured[chunks][sum(c == chunks for c, _ in calls) - 1]

    ordered = tried(given_, trials, step, lambda o: {'chunks': o.chunks})
    if len(short) < 2:
        assert ordered == given_ and not calls
        assert all(o.measured is None for o in given_)
        return
    # In rounds, one step of each, the first round warming up.
    assert calls == [(o.chunks, '1f1b') for o in short] * (STEPS + 1)
    head, rest = ordered[:len(short)], ordered[len(short):]
    assert sorted(head, key=lambda o: o.chunks) == short and rest == given_[len(short):]
    for o in head:
        assert o.measured == statistics.median(measured[o.chunks][1:])
    assert [o.measured for o in head] == sorted(o.measured for o in head)
    assert all(o.measured is None for o in rest)


def test_a_plan_of_threads_chooses_the_fastest_it_measured_within_the_limit() -> None:
    free = torchgpipe.plan(model(), torch.randn(16, 8), devices=['cpu:0', 'cpu:1'],
                           chunks=4, repeat=1, runners_up=100, trials=0)
    rows = free.table()
    # Without trials: the fastest predicted, nothing measured.
    assert [r['step'] for r in rows] == sorted(r['step'] for r in rows)
    assert all(r['measured'] is None for r in rows)
    limit = sorted(max(r['memory'].values()) for r in rows)[len(rows) // 2]
    plan = torchgpipe.plan(model(), torch.randn(16, 8), devices=['cpu:0', 'cpu:1'],
                           target=torch.randn(16, 4), loss_fn=F.mse_loss, chunks=4, repeat=1,
                           memory_limit=limit, runners_up=100)
    rows = plan.table()
    assert all(max(r['memory'].values()) <= limit for r in rows)
    tried_ = [r for r in rows if r['measured'] is not None]
    # A tiny model's configurations are predicted within a few percent of each other.
    assert 2 <= len(tried_) <= 4 and rows[:len(tried_)] == tried_
    assert rows[0]['measured'] == min(r['measured'] for r in tried_)
    assert 'tried' in str(plan) and f"{rows[0]['measured'] * 1e3:.2f} ms" in str(plan)

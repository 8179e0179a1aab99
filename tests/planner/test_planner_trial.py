"""The planner's trials: the few configurations predicted fastest, timed before choosing.

Whatever their steps measure, the tried (the fastest predicted of each kind)
come first, fastest measured first, each with the median of its timed steps,
and the rest follow as predicted;
a plan on CPU threads chooses the fastest it measured, within the memory
limit, and with ``trials=0`` the fastest predicted.
"""
import statistics
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import torchgpipe
from test_planner import model
from torchgpipe.planner import trial
from torchgpipe.planner.option import Option
from torchgpipe.planner.trial import SPREAD, STEPS, kind, shortlist, tried

pytestmark = pytest.mark.slow


KINDS = st.tuples(st.sampled_from(['1f1b', 'zb_h1']), st.integers(1, 3),
                  st.sampled_from(['never', 'except_last', 'always']))


@settings(max_examples=30, deadline=None)
@given(data=st.data(), trials=st.integers(0, 5),
       drawn=st.lists(st.tuples(st.floats(1.0, 2.0), KINDS), min_size=1, max_size=8))
def test_the_shortlist_is_tried_and_ordered_by_its_median_step(
        data: st.DataObject, trials: int, drawn: List[Tuple[float, Tuple[str, int, str]]]
        ) -> None:
    # Options named by their first partition's layers, fastest predicted first.
    given_ = [Option(schedule, [k, 1], chunks, mode, 'loop', step, [0.0, 0.0])
              for k, (step, (schedule, chunks, mode)) in enumerate(sorted(drawn))]
    short = shortlist(given_, trials)
    # The fastest of each kind, predicted within SPREAD of the fastest, in order.
    fastest = given_[0].step
    close = [o for o in given_ if o.step <= SPREAD * fastest]
    firsts = [o for k, o in enumerate(close) if all(kind(p) != kind(o) for p in close[:k])]
    assert short == firsts[:trials]
    measured = {o.balance[0]: data.draw(st.lists(st.floats(0.5, 3.0), min_size=STEPS + 1,
                                                 max_size=STEPS + 1))
                for o in short}
    calls: List[int] = []

    def step(kwargs: Dict[str, Any], schedule: str) -> float:
        name = kwargs['name']
        calls.append(name)
        return measured[name][calls.count(name) - 1]

    ordered = tried(given_, trials, step, lambda o: {'name': o.balance[0]})
    if len(short) < 2:
        assert ordered == given_ and not calls
        assert all(o.measured is None for o in given_)
        return
    # In rounds, one step of each, the first round warming up.
    assert calls == [o.balance[0] for o in short] * (STEPS + 1)
    head, rest = ordered[:len(short)], ordered[len(short):]
    assert sorted(head, key=given_.index) == short
    assert rest == [o for o in given_ if o not in short]
    for o in head:
        assert o.measured == statistics.median(measured[o.balance[0]][1:])
    assert [o.measured for o in head] == sorted(o.measured for o in head)
    assert all(o.measured is None for o in rest)


def test_a_plan_of_threads_chooses_the_fastest_it_measured_within_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    free = torchgpipe.plan(model(), torch.randn(16, 8), devices=['cpu:0', 'cpu:1'],
                           chunks=4, repeat=1, runners_up=100, trials=0)
    rows = free.table()
    # Without trials: the fastest predicted, nothing measured.
    assert [r['step'] for r in rows] == sorted(r['step'] for r in rows)
    assert all(r['measured'] is None for r in rows)
    limit = sorted(max(r['memory'].values()) for r in rows)[len(rows) // 2]
    # However far apart this machine's timings put the predictions, four are tried.
    monkeypatch.setattr(trial, 'SPREAD', float('inf'))
    plan = torchgpipe.plan(model(), torch.randn(16, 8), devices=['cpu:0', 'cpu:1'],
                           target=torch.randn(16, 4), loss_fn=F.mse_loss, chunks=4, repeat=1,
                           memory_limit=limit, runners_up=100)
    rows = plan.table()
    assert all(max(r['memory'].values()) <= limit for r in rows)
    tried_ = [r for r in rows if r['measured'] is not None]
    assert len(tried_) == 4 and rows[:4] == tried_
    assert rows[0]['measured'] == min(r['measured'] for r in tried_)
    assert 'tried' in str(plan) and f"{rows[0]['measured'] * 1e3:.2f} ms" in str(plan)

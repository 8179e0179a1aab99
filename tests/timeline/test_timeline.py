"""torchgpipe.trace: the timeline holds every task, in the order the schedule promises.

No test here asserts a duration: only counts, orders and sums, which hold on
any machine however loaded.
"""
import contextlib
import copy
import json
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Callable, Dict, List, Optional, Set, Tuple

import jsonschema
import pytest
import torch
from helpers import PopAdd, Stash, cpu_devices, mlp, schedule_devices
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import torchgpipe
from torchgpipe import GPipe
from torchgpipe.engine.generators import resolve
from torchgpipe.engine.pipeline import clock_cycles
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.simulator import idle, simulate, unit_cost
from torchgpipe.timeline import Event, Timeline, segments

CHECKPOINT_STOP = {'always': lambda m, chunks: m,
                   'except_last': lambda m, chunks: min(m, chunks - 1),
                   'never': lambda m, chunks: 0}


def traced_step(model: GPipe, input: Tensor) -> Timeline:
    with torchgpipe.trace(model) as timeline:
        model(input).sum().backward()
    return timeline


def by_kind(events: List[Event], kind: str) -> Dict[Tuple[int, int], List[Event]]:
    found: Dict[Tuple[int, int], List[Event]] = {}
    for e in events:
        if e.kind == kind:
            found.setdefault((e.micro_batch, e.partition), []).append(e)
    return found


def assert_schedule(events: List[Event], m: int, n: int, stop: int,
                    devices: List[str]) -> None:
    """Every task once, forward by clock cycle, backward in reverse, jF'i before jBi."""
    pairs = {(i, j) for i in range(m) for j in range(n)}
    forward = by_kind(events, 'forward')
    backward = by_kind(events, 'backward')
    recompute = by_kind(events, 'recompute')
    assert set(forward) == pairs and all(len(v) == 1 for v in forward.values())
    assert set(backward) == pairs and all(len(v) == 1 for v in backward.values())
    assert set(recompute) == {(i, j) for i, j in pairs if i < stop}
    assert all(len(v) == 1 for v in recompute.values())

    for e in events:
        assert e.start <= e.end
        assert e.device == devices[e.partition]
        assert e.pieces and all(e.start <= a <= b <= e.end for a, b in e.pieces)

    # Forward: on each device, tasks start in the order the clock issues them.
    issued = [(i, j) for cycle in clock_cycles(m, n) for i, j in cycle]
    for device in set(devices):
        ran = sorted((forward[p][0] for p in pairs if devices[p[1]] == device),
                     key=lambda e: e.start)
        order = [p for p in issued if devices[p[1]] == device]
        assert [(e.micro_batch, e.partition) for e in ran] == order

    for j in range(n):
        # Backward: on each partition, micro-batches m-1 .. 0.
        starts = [backward[i, j][0].start for i in reversed(range(m))]
        assert starts == sorted(starts)
        for i in range(stop):
            # The recomputation runs right before its backward, after the
            # backward of the next micro-batch began.
            assert recompute[i, j][0].end <= backward[i, j][0].start
            if i + 1 < m:
                assert backward[i + 1, j][0].start <= recompute[i, j][0].start


def test_every_task_once_in_schedule_order(checkpoint: str, threaded: bool) -> None:
    devices = cpu_devices(3, threaded)
    model = GPipe(mlp(4, depth=6, blocks=True), balance=[2, 2, 2], devices=devices, chunks=4,
                  checkpoint=checkpoint)
    timeline = traced_step(model, torch.randn(8, 4))
    assert_schedule(timeline.events, 4, 3, CHECKPOINT_STOP[checkpoint](4, 4),
                    [str(torch.device(d)) for d in devices])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_schedule_for_any_balance_and_chunks(data: st.DataObject) -> None:
    n = data.draw(st.integers(1, 4), label='partitions')
    balance = data.draw(st.lists(st.integers(1, 2), min_size=n, max_size=n), label='balance')
    chunks = data.draw(st.integers(1, 5), label='chunks')
    batch = data.draw(st.integers(1, 6), label='batch')
    checkpoint = data.draw(st.sampled_from(sorted(CHECKPOINT_STOP)), label='checkpoint')
    threaded = data.draw(st.booleans(), label='threaded')
    devices = cpu_devices(n, threaded)
    model = GPipe(mlp(4, depth=sum(balance), blocks=True), balance=balance, devices=devices,
                  chunks=chunks, checkpoint=checkpoint)
    timeline = traced_step(model, torch.randn(batch, 4))
    m = len(torch.empty(batch).chunk(chunks))  # as scatter splits the batch
    assert timeline.steps[0].micro_batches == m
    assert_schedule(timeline.events, m, n, CHECKPOINT_STOP[checkpoint](m, chunks),
                    [str(torch.device(d)) for d in devices])


def test_skip_copies_appear_both_ways(threaded: bool) -> None:
    layers = nn.Sequential(nn.Linear(4, 4), Stash(), nn.Linear(4, 4), nn.Tanh(), PopAdd(),
                           nn.Linear(4, 4))
    devices = cpu_devices(3, threaded)
    model = GPipe(layers, balance=[2, 2, 2], devices=devices, chunks=3)
    events = traced_step(model, torch.randn(6, 4)).events

    copies = [e for e in events if e.kind == 'copy']
    # The skip goes from partition 0 straight to partition 2, one copy per
    # micro-batch in the forward pass and one back in the backward pass.
    forward = sorted(e.micro_batch for e in copies if e.detail == 'skip, forward')
    back = sorted(e.micro_batch for e in copies if e.detail == 'skip, backward')
    assert forward == back == [0, 1, 2]
    assert {e.partition for e in copies} == {2}
    assert {e.track for e in copies} == {f'{torch.device(devices[2])} copies'}
    backward = by_kind(events, 'backward')
    for e in copies:
        if e.detail == 'skip, backward':
            # Copied back after the popping partition's backward began,
            # before the stashing partition's.
            assert backward[e.micro_batch, 2][0].start <= e.start
            assert e.end <= backward[e.micro_batch, 0][0].end
    # No input copy between CPU devices: a copy there is the identity.
    assert not any(e.detail.startswith('input') for e in copies)
    assert_schedule(events, 3, 3, 2, [str(torch.device(d)) for d in devices])


class Fail(nn.Module):
    """Raises at its call number ``at``, once."""

    def __init__(self, at: int) -> None:
        super().__init__()
        self.at: Optional[int] = at
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls - 1 == self.at:
            self.at = None
            raise ValueError('planned failure')
        return x


def test_failed_step_leaves_a_consistent_trace(threaded: bool) -> None:
    devices = cpu_devices(3, threaded)
    # Partition 1 fails at micro-batch 2, in clock cycle 3.
    layers = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), Fail(at=2), nn.Linear(4, 4))
    model = GPipe(layers, balance=[1, 2, 1], devices=devices, chunks=4)

    with torchgpipe.trace(model) as timeline:
        with pytest.raises(ValueError, match='planned failure'):
            model(torch.randn(8, 4))
        model(torch.randn(8, 4)).sum().backward()

    failed = [e for e in timeline.events if e.failed]
    assert [(e.kind, e.micro_batch, e.partition, e.step) for e in failed] == \
        [('forward', 2, 1, 0)]
    first = [e for e in timeline.events if e.step == 0]
    # Nothing of step 0 ran after the failure's clock cycle, nor backward.
    assert all(e.kind == 'forward' and e.micro_batch + e.partition <= 3 for e in first)
    assert all(e.start <= e.end for e in first)
    # The next step inside the same trace is whole.
    second = [e for e in timeline.events if e.step == 1]
    assert_schedule(second, 4, 3, 3, [str(torch.device(d)) for d in devices])
    assert timeline.summary().step == 1


def test_summary_adds_up(threaded: bool) -> None:
    devices = cpu_devices(4, threaded)
    model = GPipe(mlp(4, depth=8, blocks=True), balance=[2, 2, 2, 2], devices=devices, chunks=8)
    timeline = traced_step(model, torch.randn(16, 4))
    summary = timeline.summary()
    events = timeline.events

    assert (summary.micro_batches, summary.partitions) == (8, 4)
    assert summary.step_time == pytest.approx(max(e.end for e in events) -
                                              min(e.start for e in events))
    assert [d.device for d in summary.devices] == list(dict.fromkeys(
        str(torch.device(d)) for d in devices))
    for d in summary.devices:
        assert d.busy + d.idle == pytest.approx(summary.step_time)
        assert 0 <= d.bubble <= 1 and d.busy > 0
    assert summary.predicted_bubble == pytest.approx(3 / 11)
    for p in summary.partition_times:
        ran = [e for e in events if e.partition == p.partition]
        assert p.forward == pytest.approx(sum(e.busy for e in ran if e.kind == 'forward'))
        assert p.backward == pytest.approx(sum(e.busy for e in ran if e.kind == 'backward'))
        assert p.recompute == pytest.approx(sum(e.busy for e in ran if e.kind == 'recompute'))

    path = summary.critical_path
    # A chain: each task ends before the next starts, and the last ends the step.
    assert all(a.end <= b.start for a, b in zip(path, path[1:]))
    assert path[-1].end == max(e.end for e in events if e.kind != 'copy')
    assert path[-1].kind == 'backward' and path[0].kind == 'forward'
    assert 0 < summary.critical_path_time <= summary.step_time
    assert set(summary.peak_memory) == {d.device for d in summary.devices}
    assert all(v > 0 for v in summary.peak_memory.values())
    text = str(summary)
    assert 'bubble' in text and 'critical path' in text


@pytest.mark.parametrize('schedule', [None, '1f1b', 'fill_drain'])
def test_summary_says_what_the_step_was(schedule: Optional[str], threaded: bool) -> None:
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=cpu_devices(2, threaded),
                  chunks=2)
    input, target = torch.randn(4, 4), torch.randn(4, 4)
    with torchgpipe.trace(model) as timeline:
        if schedule is None:
            model(input).sum().backward()
        else:
            model.train_step(input, target, torch.nn.functional.mse_loss, schedule=schedule)
    kind = 'forward' if schedule is None else f"train_step (schedule '{schedule}')"
    summary = timeline.summary()
    assert summary.kind == kind
    assert str(summary).splitlines()[0].startswith(f'step 0, {kind}: 2 micro-batches, ')


@pytest.mark.parametrize('schedule, formula', [
    ('1f1b', '(p-1)(F+B) (1f1b)'), ('zb_h1', '(p-1)(F+B-2W) (zb_h1)'), ('zbv', '~0 (zbv)'),
    ('0F0 0F1 0B0 0B1\n1F0 1I0 1F1 1I1 1W0 1W1', 'its schedule')])
def test_summary_gives_the_bubble_of_the_schedule_beside_its_formula(
        schedule: str, formula: str, threaded: bool) -> None:
    devices = schedule_devices(schedule, 2, threaded)
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=devices, chunks=2,
                  checkpoint='never')
    with torchgpipe.trace(model) as timeline:
        model.train_step(torch.randn(4, 4), torch.randn(4, 4), torch.nn.functional.mse_loss,
                         schedule=schedule)
    summary = timeline.summary()
    plan = resolve(schedule, 2, 2, devices)
    # The bubble of the schedule itself, with equal F, I and W.
    times = simulate(plan.workers, 2, unit_cost)
    span = max(end for _, end in times.values())
    assert summary.formula == formula
    assert summary.predicted_bubble == pytest.approx(float(idle(plan.workers, 2, unit_cost)
                                                           / span))
    assert f'by {formula}' in str(summary)
    # The split backward passes are recorded under their own names.
    kinds = {e.kind for e in timeline.events}
    if any(a.kind is Kind.I for actions in plan.workers for a in actions):
        assert {'input', 'weight'} <= kinds
        assert {e.name for e in timeline.events if e.kind == 'weight' and e.partition == 1} \
            == {'1W0', '1W1'}
    else:
        assert not {'input', 'weight'} & kinds


def test_segments_never_overlap_on_a_track(threaded: bool) -> None:
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=cpu_devices(2, threaded),
                  chunks=4, checkpoint='never')
    events = traced_step(model, torch.randn(8, 4)).events
    found = segments(events)
    per_track: Dict[str, List[Tuple[float, float]]] = {}
    for e, a, b in found:
        per_track.setdefault(e.track, []).append((a, b))
    for spans in per_track.values():
        spans.sort()
        assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))
    # Every piece lies in a segment of its own event; a segment also spans
    # the gaps between its pieces (glue nodes, the engine's own work).
    for e in events:
        mine = [(a, b) for owner, a, b in found if owner is e]
        assert all(any(a <= p <= q <= b for a, b in mine) for p, q in e.pieces)
    assert sum(b - a for _, a, b in found) >= sum(e.busy for e in events)


# The parts of the Chrome trace event format the timeline uses.
CHROME_TRACE = {
    'type': 'object',
    'required': ['traceEvents'],
    'properties': {
        'displayTimeUnit': {'enum': ['ms', 'ns']},
        'traceEvents': {'type': 'array', 'items': {'oneOf': [
            {'type': 'object',
             'required': ['name', 'ph', 'ts', 'dur', 'pid', 'tid', 'args'],
             'properties': {
                 'ph': {'const': 'X'}, 'name': {'type': 'string'}, 'cat': {'type': 'string'},
                 'ts': {'type': 'number'}, 'dur': {'type': 'number', 'minimum': 0},
                 'pid': {'type': 'integer'}, 'tid': {'type': 'integer'},
                 'args': {'type': 'object',
                          'required': ['micro_batch', 'partition', 'kind'],
                          'properties': {
                              'micro_batch': {'type': 'integer', 'minimum': 0},
                              'partition': {'type': 'integer', 'minimum': 0},
                              'kind': {'enum': ['forward', 'recompute', 'backward', 'copy']}}}}},
            {'type': 'object',
             'required': ['name', 'ph', 'pid', 'args'],
             'properties': {'ph': {'const': 'M'},
                            'name': {'enum': ['process_name', 'thread_name',
                                              'thread_sort_index']}}},
        ]}},
    },
}


def test_saved_json_is_a_chrome_trace(tmp_path: Path, threaded: bool) -> None:
    layers = nn.Sequential(nn.Linear(4, 4), Stash(), nn.Linear(4, 4), PopAdd())
    devices = cpu_devices(2, threaded)
    model = GPipe(layers, balance=[2, 2], devices=devices, chunks=2)
    timeline = traced_step(model, torch.randn(4, 4))
    path = tmp_path / 'trace.json'
    timeline.save(path)
    document = json.loads(path.read_text())
    jsonschema.validate(document, CHROME_TRACE)

    names = {e['tid']: e['args']['name'] for e in document['traceEvents']
             if e['ph'] == 'M' and e['name'] == 'thread_name'}
    device_names = [str(torch.device(d)) for d in dict.fromkeys(devices)]
    # A track per device, and per device that received copies.
    assert sorted(names.values()) == sorted(device_names + [f'{device_names[-1]} copies'])
    tasks = [e for e in document['traceEvents'] if e['ph'] == 'X']
    kinds = Counter(e['args']['kind'] for e in tasks)
    assert set(kinds) == {'forward', 'recompute', 'backward', 'copy'}
    for e in tasks:
        assert names[e['tid']].startswith(e['args']['device'])


def test_plot_writes_an_image(tmp_path: Path, threaded: bool) -> None:
    pytest.importorskip('matplotlib')
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=cpu_devices(2, threaded),
                  chunks=4)
    timeline = traced_step(model, torch.randn(8, 4))
    path = tmp_path / 'timeline.png'
    timeline.plot(path)
    assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


@pytest.mark.parametrize('schedule', ['1f1b', 'zb_h1'])
def test_the_timeline_names_tasks_as_the_schedule_writes_its_actions(
        schedule: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One notation: a train_step's events, its summary's critical path, its
    Chrome trace and the boxes of its chart write the schedule's actions
    ('1F0': partition 1, forward, micro-batch 0), never (micro-batch, partition)."""
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=['cpu', 'cpu'],
                  chunks=2, checkpoint='never')
    with torchgpipe.trace(model) as timeline:
        model.train_step(torch.randn(4, 4), torch.randn(4, 4), torch.nn.functional.mse_loss,
                         schedule=schedule)
    plan = resolve(schedule, 2, 2, ['cpu', 'cpu'])
    tasks = [e for e in timeline.events if e.kind in ('forward', 'backward', 'input', 'weight')]
    assert sorted(e.name for e in tasks) == sorted(str(a) for w in plan.workers for a in w)
    for e in tasks:
        action = Action.parse(e.name)
        assert (action.micro_batch, action.partition) == (e.micro_batch, e.partition)
    path = timeline.summary().critical_path
    assert str(timeline.summary()).endswith(': ' + ' '.join(str(Action.parse(e.name))
                                                           for e in path))
    names = {e['name'] for e in timeline.chrome_trace()['traceEvents'] if e['ph'] == 'X'}
    assert {e.name for e in tasks} <= names
    # A copy and a recomputation keep the layout: partition, kind, micro-batch.
    assert Event('copy', 0, 1, 'cpu', 'cpu', '', 0, 1, 0).name == '1C0'
    assert Event('recompute', 3, 2, 'cpu', 'cpu', '', 0, 1, 0).name == "2F'3"


def test_the_chart_writes_actions_in_its_boxes() -> None:
    matplotlib = pytest.importorskip('matplotlib')
    matplotlib.use('Agg', force=False)
    import matplotlib.pyplot as plt

    from torchgpipe.timeline.events import draw_timeline
    wide = Event('forward', 0, 1, 'cpu:1', 'cpu:1', '', 0.0, 1.0, 0, ((0.0, 1.0),))
    narrow = Event('backward', 2, 0, 'cpu:0', 'cpu:0', '', 1.0, 1.015, 0, ((1.0, 1.015),))
    figure, axes = plt.subplots()
    try:
        draw_timeline(axes, segments([wide, narrow]))
        texts = sorted(t.get_text() for t in axes.texts)
    finally:
        plt.close(figure)
    # Where the name fits, the action; where only a digit does, the micro-batch.
    assert texts == ['1F0', '2']


def test_plot_without_matplotlib_says_what_to_install(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model = GPipe(mlp(4, depth=2, blocks=True), balance=[1, 1], devices=['cpu', 'cpu'], chunks=2)
    timeline = traced_step(model, torch.randn(4, 4))
    monkeypatch.setitem(sys.modules, 'matplotlib', None)
    with pytest.raises(ModuleNotFoundError, match='pip install matplotlib'):
        timeline.plot(tmp_path / 'timeline.png')
    assert not (tmp_path / 'timeline.png').exists()


def drawn_by_plot(timeline: Timeline, monkeypatch: pytest.MonkeyPatch,
                  step: Optional[int]) -> Tuple[List[Event], Optional[str]]:
    """The events and the title that ``timeline.plot(step=step)`` draws."""
    import torchgpipe.timeline.recording
    drawn: List[Tuple[List[Event], Optional[str]]] = []
    monkeypatch.setattr(torchgpipe.timeline.recording, 'plot_timeline',
                        lambda segments, path, title: drawn.append(
                            ([e for e, _, _ in segments], title)))
    timeline.plot('unused.png', step=step)
    (result,) = drawn
    return result


# "steps 0 to 1: 2 partitions, 2 to 4 micro-batches: bubble 31% to 40% (formula 20% to 33%)"
TITLE = re.compile(r'steps? (\d+)(?: to (\d+))?: (\d+)(?: to (\d+))? partitions, '
                   r'(\d+)(?: to (\d+))? micro-batches: bubble (\d+%)(?: to (\d+%))? '
                   r'\(formula (\d+%)(?: to (\d+%))?\)')


@pytest.mark.parametrize('step', [None, 0, -1])
def test_plot_title_gives_the_figures_of_the_steps_drawn(step: Optional[int], threaded: bool,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=cpu_devices(2, threaded),
                  chunks=4)
    with torchgpipe.trace(model) as timeline:
        # Steps of 4 and 2 micro-batches: their figures differ.
        for batch in (8, 2):
            model(torch.randn(batch, 4)).sum().backward()

    events, title = drawn_by_plot(timeline, monkeypatch, step)
    steps = sorted({e.step for e in events})
    assert steps == ([0, 1] if step is None else [step % 2])
    summaries = [timeline.summary(k) for k in steps]

    def extent(values: List[float], spec: str) -> Tuple[str, str]:
        return format(min(values), spec), format(max(values), spec)

    match = TITLE.fullmatch(title or '')
    assert match, title
    # Each figure as (lowest, highest); a single value stands for both.
    figures = [(low, high or low) for low, high in zip(match.groups()[::2],
                                                       match.groups()[1::2])]
    assert figures == [extent(steps, 'd'),
                       extent([s.partitions for s in summaries], 'd'),
                       extent([s.micro_batches for s in summaries], 'd'),
                       extent([s.bubble for s in summaries], '.0%'),
                       extent([s.predicted_bubble for s in summaries], '.0%')]


@pytest.mark.parametrize('steps, step, title', [
    (0, None, None), (0, 0, 'my title'), (2, 5, 'my title'), (2, -3, None),
])
def test_plot_refuses_what_summary_refuses_before_writing(steps: int, step: Optional[int],
                                                          title: Optional[str],
                                                          tmp_path: Path) -> None:
    model = GPipe(mlp(4, depth=2, blocks=True), balance=[1, 1], devices=['cpu', 'cpu'], chunks=2)
    with torchgpipe.trace(model) as timeline:
        for _ in range(steps):
            model(torch.randn(2, 4))
    with pytest.raises(ValueError) as expected:
        timeline.summary(step)
    path = tmp_path / 'timeline.png'
    with pytest.raises(ValueError) as raised:
        timeline.plot(path, step=step, title=title)
    assert str(raised.value) == str(expected.value)
    assert not path.exists()


def test_nothing_is_recorded_outside_the_trace(threaded: bool) -> None:
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=cpu_devices(2, threaded),
                  chunks=2)
    assert model.core.state.recorder is None
    with torchgpipe.trace(model) as timeline:
        output = model(torch.randn(4, 4))
    assert model.core.state.recorder is None
    # The backward pass came after the trace ended: not recorded.
    output.sum().backward()
    assert {e.kind for e in timeline.events} == {'forward'}
    # The next call, untraced, adds nothing either.
    model(torch.randn(4, 4)).sum().backward()
    assert len(timeline.steps) == 1


def test_trace_ends_when_its_block_raises() -> None:
    model = GPipe(mlp(4, depth=2, blocks=True), balance=[1, 1], devices=['cpu', 'cpu'], chunks=2)
    with pytest.raises(KeyError):
        with torchgpipe.trace(model):
            raise KeyError('user code')
    assert model.core.state.recorder is None


def test_each_backward_pass_of_a_retained_graph_is_recorded(threaded: bool) -> None:
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=cpu_devices(2, threaded),
                  chunks=2)
    with torchgpipe.trace(model) as timeline:
        loss = model(torch.randn(4, 4)).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    backward = by_kind(timeline.events, 'backward')
    recompute = by_kind(timeline.events, 'recompute')
    assert all(len(v) == 2 for v in backward.values()) and len(backward) == 4
    assert all(len(v) == 2 for v in recompute.values()) and len(recompute) == 2


def test_tracing_changes_no_result(threaded: bool) -> None:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 4), nn.ReLU())
    traced = GPipe(layers, balance=[2, 2], devices=cpu_devices(2, threaded), chunks=3)
    plain = copy.deepcopy(traced)
    input = torch.randn(6, 4)

    torch.manual_seed(1)
    with torchgpipe.trace(traced):
        traced(input).square().sum().backward()
    torch.manual_seed(1)
    plain(input).square().sum().backward()
    for a, b in zip(traced.parameters(), plain.parameters()):
        assert a.grad is not None and torch.equal(a.grad, b.grad)


def test_bad_use_gets_clear_errors() -> None:
    with pytest.raises(TypeError, match='trace\\(\\) watches a GPipe or a '
                                        'DistributedGPipe, got Sequential'):
        with torchgpipe.trace(mlp(4, depth=2, blocks=True)):
            pass
    model = GPipe(mlp(4, depth=2, blocks=True), balance=[1, 1], devices=['cpu', 'cpu'], chunks=2)
    with torchgpipe.trace(model) as timeline:
        with pytest.raises(RuntimeError, match='traced already'):
            with torchgpipe.trace(model):
                pass
        with pytest.raises(ValueError, match='recorded no step'):
            timeline.summary()
        model(torch.randn(2, 4))
    with pytest.raises(ValueError, match='step must be in \\[-1, 0\\]'):
        timeline.summary(step=1)
    assert timeline.summary(step=-1).step == 0


def test_a_copy_inside_a_trace_is_not_traced() -> None:
    model = GPipe(mlp(4, depth=2, blocks=True), balance=[1, 1], devices=['cpu', 'cpu'], chunks=2)
    with torchgpipe.trace(model) as timeline:
        clone = copy.deepcopy(model)
        assert clone.core.state.recorder is None
        clone(torch.randn(2, 4)).sum().backward()
    assert timeline.steps == []


def profiled_names(run: Callable[[], object], threaded: bool) -> Set[str]:
    options = {}
    if threaded:
        # torch.profiler records other threads than the caller's only when asked.
        config = torch._C._profiler._ExperimentalConfig
        if 'profile_all_threads' not in (config.__init__.__doc__ or ''):
            pytest.skip('this PyTorch cannot profile worker threads')
        options['experimental_config'] = config(profile_all_threads=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                **options) as profile:
        run()
    return {e.key for e in profile.key_averages()}


def test_tasks_carry_profiler_labels(threaded: bool) -> None:
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=cpu_devices(2, threaded),
                  chunks=2, checkpoint='except_last')
    names = profiled_names(lambda: model(torch.randn(4, 4)).sum().backward(), threaded)
    pairs = [(i, j) for i in range(2) for j in range(2)]
    assert {f'torchgpipe {j}F{i}' for i, j in pairs} <= names
    # The checkpointed micro-batch's recomputation and backward pass, too.
    assert {f"torchgpipe {j}F'0" for j in range(2)} <= names
    assert {f'torchgpipe {j}B0' for j in range(2)} <= names
    # The last is not checkpointed: its backward pass is plain autograd nodes.
    assert not {f"torchgpipe {j}F'1" for j in range(2)} & names


def test_train_step_actions_carry_profiler_labels(threaded: bool) -> None:
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=cpu_devices(2, threaded),
                  chunks=2, checkpoint='except_last')
    names = profiled_names(lambda: model.train_step(torch.randn(4, 4), torch.randn(4, 4),
                                                    torch.nn.functional.mse_loss), threaded)
    pairs = [(i, j) for i in range(2) for j in range(2)]
    # Written as the schedule writes its actions ('1F0': partition 1, micro-batch 0).
    assert {f'torchgpipe {Action(kind, i, j)}' for i, j in pairs
            for kind in (Kind.F, Kind.B)} <= names
    assert {f"torchgpipe {j}F'0" for j in range(2)} <= names
    names = profiled_names(lambda: model.train_step(torch.randn(4, 4), torch.randn(4, 4),
                                                    torch.nn.functional.mse_loss,
                                                    schedule='zb_h1'), threaded)
    assert {f'torchgpipe {Action(kind, i, j)}' for i, j in pairs
            for kind in (Kind.I, Kind.W)} <= names


def test_nothing_is_labelled_without_a_profiler(monkeypatch: pytest.MonkeyPatch) -> None:
    opened = []
    monkeypatch.setattr(torch.profiler, 'record_function',
                        lambda name: opened.append(name) or contextlib.nullcontext())
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=['cpu', 'cpu'], chunks=2)
    model(torch.randn(4, 4)).sum().backward()
    model.train_step(torch.randn(4, 4), torch.randn(4, 4), torch.nn.functional.mse_loss)
    assert opened == []


@pytest.mark.cuda
def test_cuda_events_and_input_copies() -> None:
    # Two partitions on one GPU (or two, when there are): every input crosses
    # a copy stream, timed with CUDA events on the stream that ran it.
    count = torch.cuda.device_count()
    devices = ['cuda:0', 'cuda:1'] if count > 1 else ['cuda:0', 'cuda:0']
    model = GPipe(mlp(4, depth=4, blocks=True), balance=[2, 2], devices=devices, chunks=4)
    timeline = traced_step(model, torch.randn(8, 4, device='cuda:0'))
    events = timeline.events
    assert_schedule([e for e in events if e.kind != 'copy'], 4, 2, 3, devices)
    copies = [e for e in events if e.kind == 'copy']
    assert sorted(e.micro_batch for e in copies if e.detail == 'input, forward') == [0, 1, 2, 3]
    assert sorted(e.micro_batch for e in copies if e.detail == 'input, backward') == [0, 1, 2, 3]
    assert all(e.partition == 1 and e.track == f'{devices[1]} copies' for e in copies)
    summary = timeline.summary()
    assert all(summary.peak_memory[d] > 0 for d in set(devices))

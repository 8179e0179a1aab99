"""Schedules as data: the built-in generators, a schedule's text, its checks, its idle time.

No model runs here: test_train_step.py runs the schedules. What is held to
account is what a schedule promises before it runs: each action once, an
order that can finish, the memory each worker keeps, and the idle time of
the paper's analysis (``F = I = W = 1``, ``B = 2``) beside its formula.
"""
import random
import re
from fractions import Fraction
from typing import Callable, Dict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import torchgpipe.schedules
from torchgpipe.processes.core import ranks_of_partitions
from torchgpipe.engine.generators import (BUILT_INS, SCHEDULES, check_schedule, fill_drain,
                                          interleaved_1f1b, named, one_f_one_b, resolve, worker_of,
                                          zb_h1, zbv)
from helpers import random_order
from torchgpipe.engine.schedule import Action, Kind, Schedule, clock_order, dependencies
from torchgpipe.engine.simulator import idle
from torchgpipe.planner.predict import Candidate


def unit(n: int, p: int) -> Callable[[Action], Fraction]:
    """The paper's costs for ``n`` partitions on ``p`` workers: a stage of the model is 1."""
    size = Fraction(p, n)
    return lambda a: size * (2 if a.kind is Kind.B else 1)


def in_flight(actions: list) -> int:
    """How many micro-batches' activations a worker keeps at most (``W`` frees them, not ``I``)."""
    alive = peak = 0
    for action in actions:
        if action.kind is Kind.F:
            alive += 1
            peak = max(peak, alive)
        elif action.kind is not Kind.I:
            alive -= 1
    return peak


def workers_of(name: str, n: int) -> int:
    return n // 2 if name in ('interleaved_1f1b', 'zbv') else n


def shapes() -> 'st.SearchStrategy[tuple]':
    """(name, m, n) of every built-in schedule, n even where the schedule needs it."""
    return st.sampled_from(SCHEDULES).flatmap(lambda name: st.tuples(
        st.just(name), st.integers(1, 12),
        st.integers(1, 4).map(lambda k: 2 * k) if name in ('interleaved_1f1b', 'zbv')
        else st.integers(1, 6)))


@pytest.mark.slow
@pytest.mark.parametrize('p', [2, 3, 4, 5])
def test_interleaved_1f1b_can_finish_with_any_micro_batches_and_partitions_per_worker(
        p: int) -> None:
    # 4 workers with 3 or more partitions each and m = 5, 9, ... once waited in a circle.
    for v in range(1, 5):
        for m in range(1, 4 * p + 2):
            schedule = named('interleaved_1f1b', m, v * p, p)
            cycles = clock_order(schedule.workers, v * p)  # raises if it cannot finish
            assert sum(len(c) for c in cycles) == 2 * m * v * p


@settings(max_examples=150, deadline=None)
@given(shape=shapes())
def test_every_built_in_schedule_runs_each_action_once_and_can_finish(shape: tuple) -> None:
    name, m, n = shape
    schedule = named(name, m, n, workers_of(name, n))
    split = name in ('zb_h1', 'zbv')
    actions = [a for worker in schedule.workers for a in worker]
    kinds = 'FIW' if split else 'FB'
    assert sorted(actions, key=str) == sorted(
        (Action(Kind(k), i, j) for k in kinds for i in range(m) for j in range(n)), key=str)
    # Each partition on one worker; every action after what it waits for.
    placement = schedule.placement()
    assert sorted(placement) == list(range(n))
    done = set()
    for cycle in clock_order(schedule.workers, n):
        for a in cycle:
            if a.kind is Kind.F and a.j > 0:
                assert Action(Kind.F, a.i, a.j - 1) in done
            if a.kind in (Kind.B, Kind.I):
                assert Action(Kind.F, a.i, a.j) in done
                if a.j < n - 1:
                    assert Action(Kind.I if split else Kind.B, a.i, a.j + 1) in done
            if a.kind is Kind.W:
                assert Action(Kind.I, a.i, a.j) in done
        done.update(cycle)
    assert done == set(actions)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 12), n=st.integers(1, 6))
def test_one_f_one_b_warms_up_alternates_and_drains(m: int, n: int) -> None:
    for j, actions in enumerate(one_f_one_b(m, n).workers):
        warmup = min(n - j, m)
        kinds = ''.join(a.kind.value for a in actions)
        assert kinds == 'F' * warmup + 'BF' * (m - warmup) + 'B' * warmup
        assert [a.i for a in actions if a.kind is Kind.F] == list(range(m))
        assert [a.i for a in actions if a.kind is Kind.B] == list(range(m))
        assert in_flight(actions) == warmup


@settings(max_examples=30, deadline=None)
@given(m=st.integers(1, 12), n=st.integers(1, 6))
def test_fill_drain_keeps_every_micro_batch_alive(m: int, n: int) -> None:
    for actions in fill_drain(m, n).workers:
        assert [a.kind for a in actions] == [Kind.F] * m + [Kind.B] * m
        assert [a.i for a in actions if a.kind is Kind.B] == list(reversed(range(m)))
        assert in_flight(actions) == m


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 12), n=st.integers(1, 6))
def test_zb_h1_sends_gradients_first_and_keeps_1f1b_peak(m: int, n: int) -> None:
    for j, actions in enumerate(zb_h1(m, n).workers):
        # 1F1B's order of forward passes and input gradients...
        warmup = min(n - j, m)
        kinds = ''.join(a.kind.value for a in actions if a.kind is not Kind.W)
        assert kinds == 'F' * warmup + 'IF' * (m - warmup) + 'I' * warmup
        # ...each W j micro-batches behind its I, the rest at the end.
        for i in range(m):
            behind = actions.index(Action(Kind.W, i, j)) - actions.index(Action(Kind.I, i, j))
            assert behind > 0
        # At most 1F1B's first partition's micro-batches, on every partition.
        assert in_flight(actions) == min(n, m)


@settings(max_examples=60, deadline=None)
@given(m=st.integers(1, 12), p=st.integers(1, 4), v=st.integers(1, 3))
def test_interleaved_loops_the_partitions_and_bounds_memory(m: int, p: int, v: int) -> None:
    schedule = interleaved_1f1b(m, p * v, p)
    assert schedule.placement() == {j: j % p for j in range(p * v)}
    # Where the rule's warm-up would wait in a circle (within this test's
    # range: 4 workers, 3 partitions each, m = 5 or 9), every worker warms up
    # with one forward pass more (as many as it has, at most).
    more = 1 if p == 4 and v == 3 and m in (5, 9) else 0
    for w, actions in enumerate(schedule.workers):
        # Megatron-LM's warm-up (1F1B's with one partition per worker): the
        # forward passes before the first backward pass, then one more.
        warmup = min((v - 1) * p + (p - 1 - w) * (2 if v > 1 else 1) + more, m * v)
        first_backward = next(k for k, a in enumerate(actions) if a.kind is Kind.B)
        assert first_backward == (warmup + 1 if warmup < m * v else m * v)
        bound = v * p + p - 1 - 2 * w if v > 1 else p - w
        assert in_flight(actions) <= min(bound + more, m * v)
    if v == 1:  # one partition per worker: 1F1B itself
        assert schedule == one_f_one_b(m, p)


@settings(max_examples=40, deadline=None)
@given(m=st.integers(1, 12), p=st.integers(1, 4))
def test_zbv_folds_the_partitions_into_a_v_at_1f1b_peak(m: int, p: int) -> None:
    schedule = zbv(m, 2 * p)
    assert schedule.placement() == {j: min(j, 2 * p - 1 - j) for j in range(2 * p)}
    # Half-size partitions: 2p of them weigh 1F1B's first partition's p.
    assert all(in_flight(actions) <= 2 * p for actions in schedule.workers)


@pytest.mark.parametrize('input_share', [Fraction(1, 2), Fraction(1), Fraction(6, 5),
                                         Fraction(3, 2)])
@pytest.mark.parametrize('p', [2, 3, 4])
def test_zbv_stays_near_no_bubble_when_i_and_w_cost_apart(input_share: Fraction, p: int) -> None:
    """A backward pass split into ``I`` and ``W`` of other costs (``I + W = 2 F``) leaves ZBV
    at most 0.4x 1F1B's idle time at the same costs (halved for its half-size partitions),
    with ``2p`` and ``3p`` micro-batches: a ``W`` never holds up an ``I`` another worker waits
    for. (A layout made with equal costs left up to 2x 1F1B's where ``I`` costs more.)"""
    def cost(scale: Fraction) -> Callable[[Action], Fraction]:
        costs = {Kind.F: 1, Kind.I: input_share, Kind.W: 2 - input_share, Kind.B: 2}
        return lambda a: costs[a.kind] * scale
    for m in (2 * p, 3 * p):
        assert idle(zbv(m, 2 * p).workers, 2 * p, cost(Fraction(1, 2))) <= \
            Fraction(2, 5) * idle(one_f_one_b(m, p).workers, p, cost(Fraction(1)))


@pytest.mark.parametrize('name', SCHEDULES)
def test_the_schedule_the_planner_and_the_ranks_place_each_shape_alike(name: str) -> None:
    """Every shape of the table: the schedule runs partition j on worker_of's worker,
    where the planner predicts it and DistributedGPipe puts it."""
    for virtual, layout in BUILT_INS[name].shapes:
        for p in (1, 2, 3):
            n = virtual * p
            placement = named(name, 4, n, p).placement()
            candidate = Candidate(name, (1,) * n, 4, 'never', p, layout)
            expected = [worker_of(j, n, p, layout) for j in range(n)]
            assert [placement[j] for j in range(n)] == expected, (name, n, p)
            assert [candidate.worker_of(j) for j in range(n)] == expected
            assert ranks_of_partitions([1] * n, p, layout) == expected


def test_idle_time_as_the_formulas_say() -> None:
    # The targets of benchmarks.schedules, p = 4, m = 8: idle per worker
    # against 1F1B's (p-1)(F+B) = 9.
    p, m = 4, 8
    ratios: Dict[str, Fraction] = {}
    for name in SCHEDULES:
        n = 2 * p if name in ('interleaved_1f1b', 'zbv') else p
        schedule = named(name, m, n, p)
        measured = idle(schedule.workers, n, unit(n, p))
        formula = BUILT_INS[name].bubble(p, n // p, Fraction(1), Fraction(2), Fraction(1))
        if name != 'zbv':
            assert measured == formula, name
        ratios[name] = measured / 9
    assert ratios['fill_drain'] == ratios['1f1b'] == 1
    assert ratios['interleaved_1f1b'] <= Fraction(55, 100)
    assert ratios['zb_h1'] <= Fraction(40, 100)
    assert ratios['zbv'] <= Fraction(20, 100)


# -- text --------------------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(shape=shapes())
def test_a_schedule_prints_and_parses_back(shape: tuple) -> None:
    name, m, n = shape
    schedule = named(name, m, n, workers_of(name, n))
    text = str(schedule)
    assert len(text.splitlines()) == len(schedule.workers)
    assert Schedule.parse(text) == schedule
    assert Schedule.parse([[str(a) for a in w] for w in schedule.workers]) == schedule
    assert eval(repr(schedule), {'Schedule': Schedule}) == schedule


def test_the_notation_of_torch_distributed_pipelining() -> None:
    schedule = Schedule.parse('0F0, 0F1, 0I0, 0W0\n 1F0 1B0  ')
    assert schedule.workers == [
        [Action(Kind.F, 0, 0), Action(Kind.F, 1, 0), Action(Kind.I, 0, 0), Action(Kind.W, 0, 0)],
        [Action(Kind.F, 0, 1), Action(Kind.B, 0, 1)]]
    assert str(Action(Kind.W, 3, 12)) == '12W3'
    with pytest.raises(ValueError, match="schedule action '0X1' is not of the form"):
        Schedule.parse('0F0 0X1')
    with pytest.raises(TypeError, match='a schedule must be a name, its text or a list'):
        Schedule.parse(['0F0', '0B0'])


# -- checks, before any work ----------------------------------------------------------


@pytest.mark.parametrize('text, m, n, message', [
    ('0F0 0B0 0F0', 1, 1, 'schedule runs 0F0 twice'),
    ('0F0 0B0\n1F0', 1, 2, 'schedule never runs 1B0'),
    ('0F0 0I0', 1, 1, 'schedule never runs 0W0'),
    ('0F0 0B0 0I0 0W0', 1, 1, 'schedule runs both 0B0 and a split of it'),
    ('0F0 0B0 0F1 0B1', 1, 1, 'schedule action 0F1 is outside the step'),
    ('0F0\n0B0', 1, 1, 'schedule runs partition 0 on workers 0 and 1'),
    ('0F0 0B0 1F0\n1B0', 1, 2, 'schedule runs partition 1 on workers 0 and 1'),
    ('0B0 0F0\n1F0 1B0', 1, 2, 'the schedule cannot go on: 0B0 can never run, for it waits '
     'for 0F0, which waits for 0B0 (before it on worker 0); each worker runs its actions in '
     'order'),
    ('0F0 0W0 0I0', 1, 1, 'the schedule cannot go on: 0W0 can never run, for it waits for '
     '0I0, which waits for 0W0 (before it on worker 0);'),
    # Worker 1 waits for 0F1, which comes after 0B0, which waits for worker 1.
    ('0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1', 2, 2, 'the schedule cannot go on: 0B0 can never '
     'run, for it waits for 1B0'),
])
def test_a_schedule_that_cannot_run_is_refused_naming_the_action(text: str, m: int, n: int,
                                                                 message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Schedule.parse(text).check(micro_batches=m, partitions=n)


def test_a_circle_of_waits_is_named_whole() -> None:
    """The message walks the waits until they come back: every action of the
    circle, and which wait is the worker's order."""
    with pytest.raises(ValueError) as caught:
        Schedule.parse('0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1').check(micro_batches=2, partitions=2)
    assert str(caught.value).startswith(
        'the schedule cannot go on: 0B0 can never run, for it waits for 1B0, which waits for '
        '1F1 (before it on worker 1), which waits for 0F1, which waits for 0B0 (before it on '
        'worker 0); ')
    assert_a_circle(str(caught.value), Schedule.parse('0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1'), 2)


def assert_a_circle(message: str, schedule: Schedule, n: int) -> None:
    """The circle of a message is one: each action waits for the next (needs
    it, or runs after it on the worker named), and the last is the first."""
    text = message.split('cannot go on: ', 1)[1].split(';', 1)[0]
    first, rest = text.split(' can never run, for it waits for ')
    chain = [(first, None)] + [(link.split(' (before it on worker ')[0],
                                int(link.split('worker ')[1].rstrip(')')) if 'worker' in link
                                else None) for link in rest.split(', which waits for ')]
    assert chain[-1][0] == first, message
    needs = dependencies(schedule.workers, n)
    for (a, _), (b, worker) in zip(chain, chain[1:]):
        x, y = Action.parse(a), Action.parse(b)
        if worker is None:
            assert y in needs[x], (message, a, b)
        else:
            actions = schedule.workers[worker]
            assert actions.index(y) < actions.index(x), (message, a, b)


@settings(max_examples=100, deadline=None)
@given(shape=shapes(), seed=st.integers(0, 2**16))
def test_any_deadlock_is_named_as_a_circle_of_true_waits(shape: tuple, seed: int) -> None:
    name, m, n = shape
    rng = random.Random(seed)
    workers = [list(actions) for actions in named(name, m, n, workers_of(name, n)).workers]
    for actions in workers:
        rng.shuffle(actions)
    schedule = Schedule(workers)
    try:
        schedule.check(micro_batches=m, partitions=n)
    except ValueError as exc:
        assert_a_circle(str(exc), schedule, n)


@pytest.mark.parametrize('written, name', [
    ('1F1B', '1f1b'), (' 1f1b ', '1f1b'), ('ZB-H1', 'zb_h1'), ('zbh1', 'zb_h1'),
    ('Interleaved-1F1B', 'interleaved_1f1b'), ('fill-drain', 'fill_drain'),
    ('FILL_DRAIN', 'fill_drain'), ('ZBV', 'zbv'), ('gpipe', 'fill_drain'),
    ('GPipe', 'fill_drain')])
def test_schedule_names_read_as_users_write_them(written: str, name: str) -> None:
    check_schedule(written)
    assert torchgpipe.schedules.built_in(written) == name
    devices = ['cpu:0', 'cpu:1', 'cpu:1', 'cpu:0'] if name == 'zbv' else ['cpu:0', 'cpu:1'] * 2
    assert resolve(written, 4, 4, devices).name == name


@pytest.mark.parametrize('written, closest', [
    ('zbh2', 'zb_h1'), ('interleaved', 'interleaved_1f1b'), ('1f2b', '1f1b'),
    ('filldrian', 'fill_drain'), ('chimera', None),
    # Shaped as an action (partition 1, micro-batch 1), but close to a name.
    ('1fb1', '1f1b'), ('1F0B', '1f1b')])
def test_an_unknown_name_lists_the_names_and_the_closest(written: str,
                                                         closest: 'str | None') -> None:
    with pytest.raises(ValueError) as caught:
        check_schedule(written)
    message = str(caught.value)
    assert all(repr(name) in message for name in SCHEDULES), message
    assert f'(schedule: {written!r})' in message
    if closest is None:
        assert 'did you mean' not in message and message.endswith("use schedule='1f1b'")
    else:
        assert message.endswith(f'did you mean {closest!r}?'), message


@pytest.mark.parametrize('schedule', [[['0F0', '0X0']], [['0F0', '0B0'], ['1X0']], '0F0 0X0',
                                      '0X0'])
def test_a_malformed_action_is_named(schedule: object) -> None:
    bad = '0X0' if '0X0' in str(schedule) else '1X0'
    with pytest.raises(ValueError, match=f"schedule action '{bad}' is not of the form"):
        check_schedule(schedule)


def test_what_a_schedule_of_ones_own_needs_is_public() -> None:
    """torchgpipe.schedules holds it, with names for the indices easy to swap."""
    from torchgpipe.schedules import NAMES, Action, Kind, Schedule, build
    assert set(torchgpipe.schedules.__all__) >= {'Action', 'Kind', 'Schedule', 'build'}
    assert NAMES == SCHEDULES
    action = Action('F', micro_batch=1, partition=0)
    assert action == Action(Kind.F, 1, 0) == Action.parse('0F1')
    assert str(action) == '0F1' and (action.micro_batch, action.partition) == (1, 0)
    for wrong in [dict(i=1, micro_batch=1, partition=0), dict(partition=0)]:
        with pytest.raises(ValueError, match='Action takes its micro_batch once'):
            Action('F', **wrong)  # type: ignore[arg-type]
    schedule = Schedule([[Action('F', micro_batch=0, partition=0),
                          Action('B', micro_batch=0, partition=0)]])
    assert len(schedule.check(micro_batches=1, partitions=1)) == 2
    with pytest.raises(TypeError):
        schedule.check(1, 1)  # type: ignore[misc]  # keywords only: the two are easy to swap
    assert build('ZB-H1', micro_batches=3, partitions=2) == zb_h1(3, 2)
    assert build('interleaved_1f1b', micro_batches=4, partitions=4, workers=2) \
        == interleaved_1f1b(4, 4, 2)
    with pytest.raises(ValueError, match="did you mean 'zbv'"):
        build('zvb', micro_batches=2, partitions=2)
    with pytest.raises(ValueError, match='micro_batches of a schedule must be a positive int'):
        build('1f1b', micro_batches=0, partitions=2)


@settings(max_examples=100, deadline=None)
@given(m=st.integers(1, 6), n=st.integers(1, 5), p=st.integers(1, 3), seed=st.integers(0, 2**16),
       data=st.data())
def test_any_order_that_respects_dependencies_is_accepted_and_breaking_one_refused(
        m: int, n: int, p: int, seed: int, data: st.DataObject) -> None:
    rng = random.Random(seed)
    placement = [data.draw(st.integers(0, p - 1)) for _ in range(n)]
    placement = [sorted(set(placement)).index(w) for w in placement]
    split = [data.draw(st.booleans()) for _ in range(n)]
    schedule = random_order(m, n, placement, split, rng)
    schedule.check(micro_batches=m, partitions=n)
    # Moving an action before one it waits for (on its worker) can never finish.
    worker = max(schedule.workers, key=len)
    for k, action in enumerate(worker):
        if action.kind is not Kind.F or action.j > 0:
            before = next((b for b in worker[:k] if b.kind is Kind.F and b.i == action.i
                           and b.j == action.j) or (), None)
            if before is not None:
                worker.remove(action)
                worker.insert(worker.index(before), action)
                with pytest.raises(ValueError, match=f'cannot go on: {action} can never run') \
                        as caught:
                    schedule.check(micro_batches=m, partitions=n)
                assert_a_circle(str(caught.value), schedule, n)
                break


def test_a_worker_of_the_schedule_needs_its_partitions_on_one_device() -> None:
    assert resolve('zbv', 4, 4, ['cpu:0', 'cpu:1', 'cpu:1', 'cpu:0']).name == 'zbv'
    with pytest.raises(ValueError, match=r"schedule 'zbv' runs partitions \[0, 3\] on one "
                       r"worker, but they are on \['cpu:0', 'cpu:1'\]; give them one device, "
                       r"e.g. devices=\['cpu:0', 'cpu:1', 'cpu:1', 'cpu:0'\]"):
        resolve('zbv', 4, 4, ['cpu:0', 'cpu:1', 'cpu:0', 'cpu:1'])
    with pytest.raises(ValueError, match="schedule 'interleaved_1f1b' runs partitions"):
        resolve('interleaved_1f1b', 4, 4, ['cpu:0', 'cpu:0', 'cpu:1', 'cpu:1'])
    # One thread runs any worker's partitions.
    assert resolve('zbv', 3, 6, ['cpu'] * 6).placement() == {0: 0, 1: 1, 2: 2, 3: 2, 4: 1, 5: 0}
    own = resolve('0F0 0B0', 1, 1, ['cpu'])
    assert own.name == 'own'

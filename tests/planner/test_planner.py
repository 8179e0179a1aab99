"""The planner: its predictions are the simulator's, its choice fits and is the fastest
predicted, and the plan applies, saves, loads and compares as documented."""
import json
import warnings
import dataclasses
from dataclasses import fields
from typing import Any, List, Optional, Tuple
from fractions import Fraction

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import torchgpipe
from benchmarks.environment import threads as intra_op_threads
from helpers import PopAdd, Stash
from torchgpipe import GPipe, Plan
from torchgpipe.engine.generators import named
from torchgpipe.engine.generators import BUILT_INS
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.engine.simulator import simulate_sharing
from torchgpipe.planner.costs import Costs, LayerCosts, measure
from torchgpipe.balance.memory import tensor_bytes
from torchgpipe.planner.option import Option
from torchgpipe.planner.partitions import Partitions
from torchgpipe.planner.predict import Candidate, checkpoints, micro_batches, predict
from torchgpipe.foundation.validation import CHECKPOINTS
from torchgpipe.planner.search import chunk_counts, search
from torchgpipe.balance.timing import PassTimes
from torchgpipe.planner.sharing import SharedBytes
from torchgpipe.skip import pop, skippable, stash

SCHEDULES = sorted(BUILT_INS)


#: The lists of LayerCosts with an entry per skip, not per layer.
PER_SKIP = ('skipped', 'loose', 'reused', 'aliased')


def linear_costs(layers: int, batch: int = 16, *, forward: float = 1e-3, input: float = 1e-3,
                 weight: float = 1e-3, kept: float = 1e3, parameters: int = 1000,
                 heavy: int = -1) -> Costs:
    """Costs proportional to the micro-batch, exactly; layer ``heavy`` is a large head:
    light in time, heavy in parameters and activations."""
    sizes = [1, 2, 4, 8, 16, 32][:batch.bit_length()]

    def at(size: int) -> LayerCosts:
        per = {'forward': forward, 'input': input, 'backward': input + weight,
               'weight': weight, 'kept': kept, 'output': kept / 4}
        table = {name: [value * size] * layers for name, value in per.items()}
        if heavy >= 0:
            table['kept'][heavy] *= 40
        # What is not modelled here, nothing (and no skips).
        return LayerCosts(**{**{f.name: [0.0] * layers for f in fields(LayerCosts)
                                if f.name not in PER_SKIP}, **table})

    params = [parameters * (200 if k == heavy else 1) for k in range(layers)]
    return Costs(batch=batch, sizes=sizes, table=[at(s) for s in sizes], parameters=params,
                 entry=kept / 4)


@settings(max_examples=40, deadline=None)
@given(schedule=st.sampled_from(['fill_drain', '1f1b']), p=st.integers(1, 4),
       per=st.integers(1, 3), m=st.sampled_from([1, 2, 4, 8, 16]))
def test_one_partition_per_worker_takes_the_papers_time(schedule: str, p: int, per: int,
                                                        m: int) -> None:
    """Equal partitions of GPipe or 1F1B take (m + p - 1)(F + B): the paper's bubble."""
    costs = linear_costs(p * per)
    prediction = predict(costs, Candidate(schedule, (per,) * p, m, 'never', p))
    size = 16 // m
    f, b = per * 1e-3 * size, per * 2e-3 * size
    assert prediction.step == pytest.approx((m + p - 1) * (f + b), rel=1e-6)


@settings(max_examples=60, deadline=None)
@given(data=st.data(), schedule=st.sampled_from(SCHEDULES), p=st.integers(1, 3),
       m=st.integers(1, 12), checkpoint=st.sampled_from(CHECKPOINTS),
       overhead=st.sampled_from([0.0, 1e-4]), transfer=st.sampled_from([0.0, 1e-9]),
       skip_overhead=st.sampled_from([0.0, 5e-4]), cores=st.sampled_from([None, 1.5]))
def test_predictions_are_the_simulators(data: st.DataObject, schedule: str, p: int, m: int,
                                        checkpoint: str, overhead: float, transfer: float,
                                        skip_overhead: float, cores: Optional[float]) -> None:
    """The step predicted is the simulator's, each action costing its partition's layers
    (once more for a checkpointed backward, ahead of its gradient), the overhead, and any
    message it sends (its output's or input gradient's, and one for each skip to or from
    another worker); the workers sharing the cores ``Costs.cores`` says."""
    virtual, placement = data.draw(st.sampled_from(BUILT_INS[schedule].shapes))
    n = virtual * p
    layers = data.draw(st.integers(n, n + 4))
    cuts = sorted(data.draw(st.sets(st.integers(1, layers - 1), min_size=n - 1,
                                    max_size=n - 1))) if n > 1 else []
    balance = tuple(b - a for a, b in zip([0, *cuts], [*cuts, layers]))
    routes = data.draw(st.lists(st.integers(0, layers - 2).flatmap(
        lambda a: st.tuples(st.just(a), st.integers(a + 1, layers - 1))),
        max_size=3 if layers > 1 else 0))
    costs = linear_costs(layers, batch=12, forward=2e-3, input=1e-3, weight=3e-3)
    costs.overhead, costs.checkpoint_overhead, costs.split_overhead = \
        overhead, 2 * overhead, 3 * overhead
    costs.transfer = (transfer * 1e3, transfer)
    costs.skips, costs.skip_overhead = routes, skip_overhead
    for size, table in zip(costs.sizes, costs.table):
        table.skipped = [100.0 * size] * len(routes)
        table.loose = table.reused = table.aliased = [0.0] * len(routes)
    costs.cores = cores
    candidate = Candidate(schedule, balance, m, checkpoint, p, placement)

    sizes = micro_batches(12, m)
    schedule_ = named(schedule, len(sizes), n, p)
    workers = [min(j, n - 1 - j) if placement == 'v' else j % p for j in range(n)]

    def partition_of(layer: int) -> int:
        return next(j for j in range(n) if layer < sum(balance[:j + 1]))

    def again(action: Action) -> bool:
        """Whether the action recomputes its micro-batch's forward pass first."""
        return action.kind in (Kind.B, Kind.I) and (
            checkpoint == 'always' or checkpoint == 'except_last' and action.i < len(sizes) - 1)

    def recompute(action: Action) -> Fraction:
        return Fraction(round(2e-3 * balance[action.j] * sizes[action.i] * 1e9 * again(action)))

    def cost(action: Action) -> Fraction:
        layers_j, size = balance[action.j], sizes[action.i]
        # I reaches the partition's inputs (the first has none to reach: its
        # W is the whole of B), W does the rest.
        i_ = 1e-3 if action.j else 0.0
        per_layer = {Kind.F: 2e-3, Kind.B: 4e-3, Kind.I: i_, Kind.W: 4e-3 - i_}[action.kind]
        split = action.kind in (Kind.I, Kind.W)
        seconds = (3 if split else 1) * overhead + per_layer * layers_j * size
        seconds += 2 * overhead * again(action)
        to = action.j + 1 if action.kind is Kind.F else action.j - 1
        if action.kind is not Kind.W and 0 <= to < n and workers[to] != workers[action.j]:
            seconds += transfer * 1e3 + transfer * 250 * size
        for a, b in routes:
            ends = (partition_of(a), partition_of(b))
            # F sends what it stashes; B or I sends back the gradients of what it pops.
            mine, other = ends if action.kind is Kind.F else ends[::-1]
            if (action.kind is not Kind.W and mine == action.j != other
                    and workers[other] != workers[mine]):
                seconds += transfer * 1e3 + skip_overhead + transfer * 100 * size
        return Fraction(round(seconds * 1e9)) + recompute(action)

    # The recomputation runs ahead of the gradient it does not need.
    times = simulate_sharing(schedule_.workers, n, cost, cores, recompute)
    expected = float(max(end for _, end in times.values())) / 1e9
    assert predict(costs, candidate).step == pytest.approx(expected, rel=1e-9, abs=1e-12)


def test_memory_frees_what_backward_passes_finish() -> None:
    """1F1B keeps at most p - j micro-batches on partition j; fill-drain keeps all m."""
    costs = linear_costs(4, batch=16, parameters=0)
    one = predict(costs, Candidate('1f1b', (1, 1, 1, 1), 8, 'never', 4)).memory
    all_ = predict(costs, Candidate('fill_drain', (1, 1, 1, 1), 8, 'never', 4)).memory
    per_micro_batch = (1e3 + 1e3 / 4) * 2  # kept and entry, micro-batches of 2
    assert one == pytest.approx([per_micro_batch * k for k in (4, 3, 2, 1)])
    assert all_ == pytest.approx([per_micro_batch * 8] * 4)
    checkpointed = predict(costs, Candidate('fill_drain', (1, 1, 1, 1), 8, 'always', 4)).memory
    assert max(checkpointed) < max(all_) / 2


@settings(max_examples=40, deadline=None)
@given(schedule=st.sampled_from(SCHEDULES), shards=st.integers(2, 8),
       param_scale=st.sampled_from([1.0, 2.0, 4.0]), mode=st.sampled_from(CHECKPOINTS))
def test_sharded_partitions_keep_shards_and_gather_for_the_step(
        schedule: str, shards: int, param_scale: float, mode: str) -> None:
    """FSDP2 gathered through the step: a worker's parameters and optimizer states are a
    shard each between steps, and whole beside the shard during one; each partition adds
    an all-gather and a reduce-scatter, a ring of ``shards - 1`` messages each."""
    costs = linear_costs(8, batch=16)
    costs.transfer = (1e-4, 1e-8)
    virtual, placement = BUILT_INS[schedule].shapes[0]
    candidate = Candidate(schedule, (2,) * (2 * virtual), 4, mode, 2, placement)
    alone = predict(costs, candidate, param_scale=param_scale)
    sharded = predict(costs, candidate, param_scale=param_scale, shards=shards)
    parameters = [2 * virtual * 1000.0] * 2  # bytes of a worker's weights
    for w in range(2):
        assert sharded.memory[w] - alone.memory[w] == pytest.approx(
            (param_scale - 1) * parameters[w] * (1 / shards - 1) + parameters[w])
    # Never faster; no slower than every collective on the critical path.
    ring = (shards - 1) * (1e-4 + 1e-8 * 2 * 1000 / shards)
    assert alone.step < sharded.step <= alone.step + 2 * 2 * virtual * ring + 1e-6


@settings(max_examples=30, deadline=None)
@given(chunks=st.integers(1, 8), mode=st.sampled_from(['never', 'except_last', 'always']))
def test_what_partitions_of_one_rank_hand_each_other_is_let_go_of_by_the_end(
        chunks: int, mode: str) -> None:
    """Across processes, where a rank runs two partitions of a micro-batch (ZBV's turn),
    the input of the later one is the earlier one's output, counted once, and its
    gradient goes back as it is; skips between the V's arms are lent the same way;
    what they share is let go of by the step's end, even where the later one lets go
    first (ZBV's W of the last partition before the first's I)."""
    costs = linear_costs(4, batch=8)
    costs.processes = True
    # Half the output is held by the pipeline, half saved by the layer above
    # its weights (let go of by I, as the rest of what it keeps); two skips from
    # the first partition to the last, both on the first rank.
    costs.skips = [(0, 3), (0, 3)]
    for layers in costs.table:
        layers.unsaved = [nbytes / 2 for nbytes in layers.output]
        layers.shed = list(layers.kept)
        layers.skipped = layers.loose = [layers.output[0]] * 2
        layers.reused = layers.aliased = [0.0] * 2
    candidate = Candidate('zbv', (1, 1, 1, 1), chunks, mode, 2, 'v')
    sizes = micro_batches(costs.batch, chunks)
    parts = Partitions(costs, candidate.balance, candidate.worker_of)
    turn = parts(2, sizes[0])
    assert turn.messages.turned == turn.messages.entry > 0
    assert parts(1, sizes[0]).messages.turned == 0
    assert parts.returned(2, sizes[0]) == [(1, turn.messages.entry, True)]
    assert parts.lent(1, sizes[0]) == ({2: costs.at(sizes[0]).output[1]},
                                       {2: costs.at(sizes[0]).output[1]})
    assert parts.lent(0, sizes[0]) == ({3: 2 * costs.at(sizes[0]).output[0]},
                                       {3: 2 * costs.at(sizes[0]).output[0]})
    assert parts.returned(3, sizes[0]) == [(0, costs.at(sizes[0]).output[0], False)] * 2
    for actions in candidate.plan(len(sizes)).workers:
        shared = SharedBytes(parts, sizes, checkpoints(mode, len(sizes)))
        # (As the walk asks, an F what it takes over, then each action what it leaves.)
        change = sum(-shared.taken(action) + shared.after(action) for action in actions)
        assert change == pytest.approx(0.0)
        assert not shared.lent and not shared.handed


@pytest.mark.unmeasured
@settings(max_examples=12, deadline=None)
@given(p=st.integers(1, 3), layers=st.integers(3, 8), limit=st.floats(1e5, 5e6),
       heavy=st.integers(-1, 2))
def test_the_choice_fits_and_is_the_fastest_predicted(p: int, layers: int, limit: float,
                                                      heavy: int) -> None:
    layers = max(layers, 2 * p)
    costs = linear_costs(layers, batch=8, heavy=heavy if heavy < layers else -1)
    found = search(costs, p, memory_limit=limit, schedules=SCHEDULES, chunks=[1, 2, 4, 8],
                   checkpoints=CHECKPOINTS, param_scale=2.0)
    fitting = [s for s in found if max(s.memory) <= limit]
    if not fitting:
        assert not found[0].fits(limit)
        return
    assert found[0].fits(limit)
    assert found[0].step == min(s.step for s in fitting)
    # A limit never makes the choice faster; one the free choice fits changes nothing.
    free = search(costs, p, memory_limit=None, schedules=SCHEDULES, chunks=[1, 2, 4, 8],
                  checkpoints=CHECKPOINTS, param_scale=2.0)[0]
    assert free.step <= found[0].step
    if free.fits(limit):
        assert found[0].step == free.step


def test_a_heavy_head_is_placed_to_fit() -> None:
    """A head light in time but heavy in memory: splitting by time alone does not fit,
    and the plan moves layers away from it until it does."""
    costs = linear_costs(8, batch=8, heavy=7, parameters=100)
    by_time = predict(costs, Candidate('1f1b', (4, 4), 4, 'never', 2))
    limit = max(by_time.memory) * 0.97
    best = search(costs, 2, memory_limit=limit, schedules=['1f1b'], chunks=[4],
                  checkpoints=['never'], param_scale=2.0)[0]
    assert best.fits(limit)
    assert best.balance[-1] < 4


def test_chunk_counts_skip_splits_torch_chunk_cannot_make() -> None:
    assert micro_batches(10, 4) == [3, 3, 3, 1]
    assert chunk_counts(10, 6) == [1, 2, 3, 4, 5]
    assert chunk_counts(3, 32) == [1, 2, 3]


def test_costs_interpolate_between_sizes() -> None:
    costs = linear_costs(2, batch=16)
    assert costs.at(3).forward == pytest.approx([3e-3, 3e-3])
    assert costs.at(16).kept == pytest.approx([16e3, 16e3])
    assert costs.at(64).forward == pytest.approx([64e-3, 64e-3])  # beyond, in proportion


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 4))


def test_measuring_leaves_the_model_and_the_random_state_as_they_were() -> None:
    module = nn.Sequential(*model(), nn.Dropout(0.5))
    state = {k: v.clone() for k, v in module.state_dict().items()}
    input, target = torch.randn(8, 8), torch.randn(8, 4)
    rng = torch.get_rng_state()
    costs = measure(module, input, [2, 8], torch.device('cpu'), repeat=1,
                    loss=(F.mse_loss, target))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(state[k], v) for k, v in module.state_dict().items())
    assert all(p.grad is None for p in module.parameters())
    assert costs.layers == 6 and costs.loss and len(costs.table[0].forward) == 7
    assert costs.parameters[0] == (8 * 32 + 32) * 4 and costs.parameters[1] == 0
    # The ReLU keeps its output (more for a larger micro-batch); the linear layer
    # before it keeps its input, not its output, which the ReLU does not save.
    assert 0 < costs.at(2).kept[1] < costs.at(8).kept[1]
    assert costs.at(8).kept[0] == 0
    assert costs.at(8).output[0] == 8 * 32 * 4
    assert costs.entry == 0  # the input is the caller's, where the first partition runs


def test_an_input_copied_to_the_first_device_is_the_first_partitions_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Given in another memory (on CPU, said to be), each micro-batch of the input is a
    copy the first partition holds: its bytes, not those of the storage it is a view of."""
    from torchgpipe.planner import costs as module
    monkeypatch.setattr(module, 'same_memory', lambda a, b: False)
    costs = measure(model(), torch.randn(8, 8), [2, 8], torch.device('cpu'), repeat=1)
    assert costs.entry == 8 * 4


def test_a_pass_another_process_interrupts_is_left_out(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    """A layer's time is the least of its rounds: another process's slice of the core makes
    a pass longer, never shorter, even when it falls on most rounds of a layer."""
    from torchgpipe.planner import costs as module
    calls: List[bool] = []

    def layer_times(layers: Any, sample: Any, device: Any, split: bool) -> Any:
        # A round visits both sizes, I and W, and B, each: four passes. Rounds
        # 1 and 2 (of the three timed after the one to warm up) are
        # interrupted at every layer. B takes I's time and W's.
        slow = 1 + 99 * (len(calls) // 4 in (1, 2))
        calls.append(split)
        times = [slow * (k + 1) * 1e-3 for k in range(len(layers))]
        if split:  # (no I for the first layer: it is not timed here)
            return PassTimes(times, input=times, weight=sum(times[1:]), cut=1)
        return PassTimes(times, backward=[2 * t for t in times])
    monkeypatch.setattr(module, 'layer_times', layer_times)
    costs = measure(nn.Sequential(*model()), torch.randn(8, 8), [2, 8], torch.device('cpu'),
                    repeat=3)
    assert len(calls) == 4 * 4
    for size in (2, 8):
        at = costs.at(size)
        expected = [(k + 1) * 1e-3 for k in range(costs.layers)]
        assert at.forward == at.input == pytest.approx(expected)
        assert at.backward == pytest.approx([2 * t for t in expected])
        # W's time, shared as B goes beyond I; the first layer's is its B.
        assert at.weight == pytest.approx([2e-3, *expected[1:]])


def test_the_split_backward_pass_is_timed_as_the_engine_runs_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``I`` and ``W`` are timed as :mod:`torchgpipe.engine.split` runs them: ``I`` from
    the last output to the first layer's, made a leaf as a partition's input is, and
    ``W`` after it, once; the first layer has no ``I`` (no partition before it waits for
    its input's gradient), and every gradient made is let go of."""
    from torchgpipe.engine import split
    from torchgpipe.balance import timing
    layers = list(model())
    sample = torch.randn(4, 8)
    first = layers[0](sample)
    passes: List[Any] = []

    def spied(tensors: Any, grads: Any, inputs: List[Tensor], outputs: Any = ()) -> Any:
        weights = split.input_pass(tensors, grads, inputs, outputs)
        passes.append((inputs, weights))
        monkeypatch.setattr(weights, 'run', lambda: passes.append(split.WeightPass.run(weights)))
        return weights
    monkeypatch.setattr(timing, 'input_pass', spied)
    times = timing.layer_times(layers, sample, torch.device('cpu'), split=True)
    assert len(passes) == 2  # I, then W once
    inputs, _ = passes[0]
    assert len(inputs) == 1 and inputs[0].is_leaf and inputs[0].shape == first.shape
    assert times.input[0] == 0 and times.weight > 0
    assert all(p.grad is None for layer in layers for p in layer.parameters())


@pytest.fixture(scope='module')
def planned() -> Plan:
    return torchgpipe.plan(model(), torch.randn(16, 8), devices=['cpu:0', 'cpu:1'],
                           target=torch.randn(16, 4), loss_fn=F.mse_loss, chunks=4, repeat=1,
                           runners_up=3)


def test_a_plan_applies_in_one_line_and_trains_as_the_model(planned: Plan) -> None:
    input, target = torch.randn(16, 8), torch.randn(16, 4)
    reference = model()
    F.mse_loss(reference(input), target).backward()
    pipe = GPipe(model(), **planned.kwargs)
    pipe.train_step(input, target, F.mse_loss, schedule=planned.schedule)
    for a, b in zip(reference.parameters(), pipe.parameters()):
        assert torch.allclose(a.grad, b.grad, atol=1e-6)
    assert planned.kwargs['devices'] == planned.partition_devices()
    assert set(planned.kwargs['devices']) <= {'cpu:0', 'cpu:1'}


@pytest.mark.parametrize('schedule, balance', [
    ('fill_drain', [3, 2]), ('1f1b', [3, 2]), ('zb_h1', [2, 3]),
    ('interleaved_1f1b', [2, 1, 1, 1]), ('zbv', [1, 1, 2, 1])])
def test_every_configuration_a_plan_gives_trains_as_the_model(
        planned: Plan, schedule: str, balance: List[int], threaded: bool) -> None:
    """Each schedule's layout, as Plan.kwargs writes it, on both paths: a worker thread
    per planned device, or every partition in the calling thread ('cpu' for each)."""
    option = planned.predict(schedule, balance, chunks=4, checkpoint='except_last')
    kwargs = Plan(option, [], planned.devices, None).kwargs
    if not threaded:
        kwargs['devices'] = ['cpu'] * len(balance)
    input, target = torch.randn(16, 8).double(), torch.randn(16, 4).double()
    reference = model().double()
    F.mse_loss(reference(input), target).backward()
    pipe = GPipe(model().double(), **kwargs)
    pipe.train_step(input, target, F.mse_loss, schedule=option.schedule)
    for a, b in zip(reference.parameters(), pipe.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def test_a_plan_says_what_it_chose_and_what_it_set_aside(planned: Plan) -> None:
    rows = planned.table()
    assert len(rows) == 4 and rows[0]['balance'] == planned.balance
    # The fastest predicted first.
    assert [r['step'] for r in rows] == sorted(r['step'] for r in rows)
    text = str(planned)
    assert planned.schedule in text and str(planned.balance) in text
    assert text.count(' ms ') >= 4


def test_a_plan_predicts_other_configurations_by_its_measurements(planned: Plan) -> None:
    again = planned.predict(planned.schedule, planned.balance, planned.chunks,
                            planned.checkpoint)
    assert again.step == planned.step_time and again.memory == planned.chosen.memory
    by_hand = planned.predict('1F1B', [3, 2], chunks=1)
    assert by_hand.step >= min(r['step'] for r in planned.table())
    assert by_hand.schedule == '1f1b'
    with pytest.raises(ValueError, match='module and sum of balance have different length'):
        planned.predict('1f1b', [3, 3], chunks=1)
    with pytest.raises(ValueError, match='balance must have 4 partitions for zbv on 2 devices'):
        planned.predict('zbv', [3, 2], chunks=1)
    with pytest.raises(ValueError, match='checkpoint is not one of'):
        planned.predict('1f1b', [3, 2], chunks=1, checkpoint='Always')
    with pytest.raises(ValueError, match='chunks'):
        planned.predict('1f1b', [3, 2], chunks=0)
    # As many micro-batches as the mini-batch splits into: 16 samples make 16 at most.
    assert planned.predict('1f1b', [3, 2], chunks=40).chunks == 16


def test_a_plan_saves_and_loads(planned: Plan, tmp_path) -> None:
    path = tmp_path / 'plan.json'
    planned.save(path)
    loaded = Plan.load(path)
    assert loaded.kwargs == planned.kwargs and loaded.table() == planned.table()
    assert str(loaded) == str(planned)
    # The threads each worker measured with (the conftest's one), kept and printed.
    assert loaded.threads == planned.threads == planned.kwargs['planned_threads'] == 1
    assert 'intra-op threads per worker: 1, as measured' in str(loaded)
    with pytest.raises(ValueError, match='predict needs the measurements'):
        loaded.predict('1f1b', [3, 2], chunks=1)
    # A plan saved by a later version (a field more).
    data = json.loads(path.read_text())
    data['chosen']['later'] = 1
    path.write_text(json.dumps(data))
    assert Plan.load(path).kwargs == planned.kwargs
    path.write_text('{"balance": [1]}')
    with pytest.raises(ValueError, match='a plan file must be one Plan.save wrote'):
        Plan.load(path)


def test_a_plan_compares_with_a_traced_step(planned: Plan) -> None:
    pipe = GPipe(model(), **planned.kwargs)
    input, target = torch.randn(16, 8), torch.randn(16, 4)
    with torchgpipe.trace(pipe) as timeline:
        pipe.train_step(input, target, F.mse_loss, schedule=planned.schedule)
    comparison = planned.compare(timeline)
    assert comparison.step.predicted == planned.step_time
    assert comparison.step.measured == timeline.summary().step_time
    kinds = {(r.device, r.what) for r in comparison.rows[1:]}
    assert ('cpu:0', 'forward') in kinds and ('cpu:1', 'forward') in kinds
    assert all(r.measured > 0 for r in comparison.rows if r.what == 'forward')
    assert 'ratio' in str(comparison)
    # A CPU trace reads the process's peak, no device's: no memory row.
    assert not any(r.what == 'memory' for r in comparison.rows)
    with torchgpipe.trace(pipe) as timeline:
        pipe(input).sum().backward()
    with pytest.raises(ValueError, match="compare needs a train_step of the plan's pipeline"):
        planned.compare(timeline)


@pytest.mark.cuda
def test_a_plan_on_cuda_compares_each_devices_peak_memory() -> None:
    devices = [f'cuda:{k}' for k in range(min(2, torch.cuda.device_count()))]
    input, target = torch.randn(16, 8), torch.randn(16, 4)
    plan = torchgpipe.plan(model(), input, devices=devices, target=target, loss_fn=F.mse_loss,
                           chunks=4, repeat=1)
    pipe = GPipe(model(), **plan.kwargs)
    with torchgpipe.trace(pipe) as timeline:
        pipe.train_step(input.to(devices[0]), target.to(devices[-1]), F.mse_loss,
                        schedule=plan.schedule)
    memory = {r.device: r for r in plan.compare(timeline).rows if r.what == 'memory'}
    assert set(memory) == set(devices)
    assert all(r.predicted > 0 and r.measured > 0 for r in memory.values())


def test_a_limit_nothing_fits_names_the_least_memory_and_its_device() -> None:
    with pytest.raises(ValueError, match=r'the least any needs is .* on cpu:[01] \('):
        torchgpipe.plan(model(), torch.randn(16, 8), devices=['cpu:0', 'cpu:1'], chunks=2,
                        repeat=1, memory_limit=1000)


def test_a_plan_under_a_limit_fits_it_and_gives_up_what_does_not() -> None:
    # Between the least and the most memory any configuration takes: which one
    # is fastest depends on this machine's timings, the memory each takes not.
    free = torchgpipe.plan(model(), torch.randn(16, 8), devices=['cpu:0', 'cpu:1'], chunks=4,
                           repeat=1, runners_up=100)
    peaks = [max(r['memory'].values()) for r in free.table()]
    limit = (min(peaks) + max(peaks)) / 2
    assert min(peaks) < limit < max(peaks)
    limited = torchgpipe.plan(model(), torch.randn(16, 8), devices=['cpu:0', 'cpu:1'],
                              chunks=4, repeat=1, runners_up=100, memory_limit=limit)
    # What does not fit (some configurations, above) is given up: every one it lists fits.
    assert all(m <= limit for m in limited.memory.values())
    assert all(max(r['memory'].values()) <= limit for r in limited.table())


def test_planning_leaves_the_random_state_and_the_threads_as_they_were() -> None:
    module, input = model(), torch.randn(16, 8)
    rng, threads = torch.get_rng_state(), torch.get_num_threads()
    torchgpipe.plan(module, input, devices=['cpu:0', 'cpu:1'], chunks=2, repeat=1)
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads
    with pytest.raises(ValueError, match='memory_limit must leave room'):
        torchgpipe.plan(module, input, devices=['cpu:0', 'cpu:1'], chunks=2, repeat=1,
                        memory_limit=1)
    assert torch.equal(torch.get_rng_state(), rng) and torch.get_num_threads() == threads


def test_planning_a_model_with_gradients_leaves_them_and_records_its_threads() -> None:
    """Planned as if it had none (its copies have none), every gradient is the same
    tensor with the same values after. Two threads on two workers: each measures with
    one, which the plan records for the pipeline it gives."""
    module, input = model(), torch.randn(16, 8)
    F.mse_loss(module(input), torch.randn(16, 4)).backward()
    grads = [(p, p.grad, p.grad.clone()) for p in module.parameters()]
    with intra_op_threads(2):
        plan = torchgpipe.plan(module, input, devices=['cpu:0', 'cpu:1'], chunks=2, repeat=1)
    assert all(p.grad is grad and torch.equal(grad, values) for p, grad, values in grads)
    assert plan.threads == plan.kwargs['planned_threads'] == 1


def thread_warnings(caught: List[warnings.WarningMessage]) -> List[str]:
    return [str(w.message) for w in caught if 'intra-op threads' in str(w.message)]


@pytest.mark.parametrize('first', ['forward', 'train_step', 'eval_step'])
def test_a_planned_pipeline_warns_once_at_its_first_step_under_other_threads(
        planned: Plan, threaded: bool, first: str) -> None:
    """Whichever step comes first, on both paths; and not under the threads planned."""
    kwargs = dict(planned.kwargs)
    if not threaded:
        kwargs['devices'] = ['cpu'] * len(planned.balance)
    input, target = torch.randn(16, 8), torch.randn(16, 4)
    steps = {'forward': lambda pipe: pipe(input),
             'train_step': lambda pipe: pipe.train_step(input, target, F.mse_loss),
             'eval_step': lambda pipe: pipe.eval_step(input)}
    for threads, expected in ((planned.threads, 0), (planned.threads + 1, 1)):
        with intra_op_threads(threads), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            pipe = GPipe(model(), **kwargs)
            steps[first](pipe)
            for step in steps.values():
                step(pipe)
        said = thread_warnings(caught)
        assert len(said) == expected, said
    assert 'planned_threads: 1, torch.get_num_threads(): 2' in said[0]
    assert 'call torch.set_num_threads(1) before the first step, or plan again' in said[0]
    with pytest.raises(ValueError, match='planned_threads must be positive'):
        GPipe(model(), **{**kwargs, 'planned_threads': 0})
    with pytest.raises(TypeError, match='planned_threads must be an int'):
        GPipe(model(), **{**kwargs, 'planned_threads': '1'})


def test_a_plan_says_why_chunks_1_won() -> None:
    def made(chunks: int, step: float) -> Option:
        return Option('1f1b', [3, 2], chunks, 'never', 'loop', step, [1.0, 1.0])
    chosen, runners_up = made(1, 10e-3), [made(2, 11e-3), made(4, 12e-3)]
    lines = str(Plan(chosen, runners_up, ['cpu:0', 'cpu:1'], None)).splitlines()
    assert any(line.startswith('  chunks=1, no pipelining: what each micro-batch adds')
               for line in lines)
    assert 'no pipelining' not in str(Plan(runners_up[0], [chosen], ['cpu:0', 'cpu:1'], None))


def test_a_first_layer_that_needs_no_gradient_leaves_the_others_an_input_pass() -> None:
    """The input pass starts from the first output that needs a gradient: behind a
    Flatten (no parameters, an input without gradient), the layers still have an I."""
    module = nn.Sequential(nn.Flatten(), *model())
    costs = measure(module, torch.randn(16, 2, 4), [16], torch.device('cpu'), repeat=1)
    input = costs.at(16).input
    assert input[0] == 0 and input[1] == 0  # nothing before them waits for a gradient
    assert all(t > 0 for t in input[3::2])  # the linear layers after the first


def test_a_sample_with_a_nochunk_tensor_is_refused_before_any_work() -> None:
    with pytest.raises(TypeError, match='plan measures samples of tensors split'):
        torchgpipe.plan(model(), (torch.randn(16, 8), torchgpipe.NoChunk(torch.ones(1))),
                        devices=['cpu:0', 'cpu:1'])


def test_no_schedule_that_fits_is_named() -> None:
    with pytest.raises(ValueError, match='schedules must hold one that fits'):
        torchgpipe.plan(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), torch.randn(4, 8),
                        devices=['cpu:0', 'cpu:1'], schedules=['zbv'], repeat=1)


@pytest.mark.parametrize('kwargs, error, match', [
    ({'devices': ['cpu:0', 'cpu:0']}, ValueError, 'devices must be distinct'),
    ({'devices': ['cpu:0'] + [f'cpu:{k}' for k in range(1, 7)]}, ValueError,
     'no more than the layers'),
    ({'devices': 'cpu:0'}, TypeError, 'list of devices'),
    ({'schedules': ['gpipe2']}, ValueError, 'schedule must be one of'),
    ({'schedules': []}, ValueError, 'schedules must name at least one'),
    ({'checkpoint': ['sometimes']}, ValueError, 'checkpoint must list modes'),
    ({'target': torch.randn(16, 4)}, ValueError, 'plan takes a target and a loss_fn together'),
    ({'target': torch.randn(16, 4), 'loss_fn': 3}, TypeError, 'loss_fn must be callable'),
    ({'memory_limit': -1}, ValueError, 'memory_limit'),
    ({'chunks': 0}, ValueError, 'chunks'),
    ({'repeat': 0}, ValueError, 'repeat must be at least 1'),
    ({'shards': 0}, ValueError, 'shards must be at least 1'),
    ({'shards': 2.0}, TypeError, 'shards must be an int'),
    ({'shards': 2}, ValueError, 'shards is for a pipeline of processes, with group'),
    ({'runners_up': 1.5}, TypeError, 'runners_up must be an int'),
    ({'devices': ['cpu:0', 'meta']}, ValueError, 'devices must be of one type'),
    ({'target': torch.randn(8, 4), 'loss_fn': F.mse_loss}, ValueError,
     'target must have the batch size of sample'),
    ({'schedules': 3}, TypeError, 'schedules must be a list'),
])
def test_bad_arguments_are_named_before_any_work(kwargs: dict, error: type,
                                                 match: str) -> None:
    arguments = {'devices': ['cpu:0', 'cpu:1'], **kwargs}
    with pytest.raises(error, match=match):
        torchgpipe.plan(model(), torch.randn(16, 8), **arguments)


def test_one_device_plans_one_partition() -> None:
    planned = torchgpipe.plan(model(), torch.randn(8, 8), devices=['cpu'], chunks=2, repeat=1)
    assert planned.balance == [5] and planned.kwargs['devices'] == ['cpu']
    assert planned.schedule in ('fill_drain', '1f1b', 'zb_h1')


def live_peak(step: Any, module: nn.Sequential, input: Tensor, target: Tensor) -> int:
    """The most bytes of tensors ``step()`` holds at once, beside the parameters, their
    gradients, the input and the target; after a first step (a pipeline's first runs
    each partition on copies of its input, to learn whether it changes them)."""
    from torchgpipe.balance.working import Live
    step()
    module.zero_grad(set_to_none=True)
    live = Live({t.untyped_storage().data_ptr()
                 for t in [*module.parameters(), input, target]})
    with live:
        step()
    grads = live.numbers([p.grad for p in module.parameters() if p.grad is not None])
    module.zero_grad(set_to_none=True)
    return live.peak(grads, 0)


def vocabulary_loss(output: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


def skip_model() -> Tuple[nn.Sequential, Tensor, Tensor, Any]:
    """A skip around two layers; its pop has no weight, but the layer after has."""
    return (nn.Sequential(nn.Linear(16, 64), Stash(), nn.Linear(64, 64), nn.ReLU(), PopAdd(),
                          nn.Linear(64, 16)),
            torch.randn(32, 16), torch.randn(32, 16), F.mse_loss)


MEMORY_MODELS = {
    'mlp': lambda: (nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256),
                                  nn.Tanh(), nn.Linear(256, 16)),
                    torch.randn(32, 16), torch.randn(32, 16), F.mse_loss),
    # The logits are not kept (the softmax keeps its own output), and the
    # loss's backward pass holds two gradients as large as the logits.
    'vocabulary': lambda: (nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 32), nn.GELU(),
                                         nn.Linear(32, 4096)),
                           torch.randint(0, 100, (16, 8)), torch.randint(0, 4096, (16, 8)),
                           vocabulary_loss),
    'tied': lambda: (tied_model(), torch.randint(0, 4096, (16, 8)),
                     torch.randint(0, 4096, (16, 8)), vocabulary_loss),
    'conv': lambda: (nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(),
                                   nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                   nn.Linear(16 * 16 * 16, 10)),
                     torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)), F.cross_entropy),
    'skip': skip_model,
}


def tied_model() -> nn.Sequential:
    """An embedding and a head that share one weight."""
    embedding, head = nn.Embedding(4096, 32), nn.Linear(32, 4096, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(32, 32), nn.GELU(), head)


def test_a_weight_two_layers_share_is_counted_once_where_they_are_together() -> None:
    """The shared weight's bytes (and its gradient's) count once on a worker holding
    both layers (one tensor there, and a share of the gradient for the second
    partition), and on each worker holding one."""
    module, tokens = tied_model(), torch.randint(0, 4096, (16, 8))
    plan = torchgpipe.plan(module, tokens, devices=['cpu:0', 'cpu:1'], chunks=1,
                           schedules=['1f1b', 'zbv'], checkpoint=['never'], repeat=1)
    assert plan.costs is not None and plan.costs.shared == [([0, 3], 4096 * 32 * 4)]
    weight = 4096 * 32 * 4
    together = plan.predict('zbv', [1, 1, 1, 1], 1, 'never')  # layers 0 and 3 on worker 0
    apart = plan.predict('1f1b', [2, 2], 1, 'never')
    alone = dataclasses.replace(plan.costs, shared=[], _cache={})
    untied = predict(alone, Candidate('zbv', (1, 1, 1, 1), 1, 'never', 2, 'v'))
    assert untied.memory[0] - together.memory[0] == pytest.approx(weight)
    assert untied.memory[1] == pytest.approx(together.memory[1])
    assert predict(alone, Candidate('1f1b', (2, 2), 1, 'never', 2)).memory == apart.memory


@pytest.mark.parametrize('schedule, chunks, mode', [
    ('fill_drain', 1, 'never'), ('fill_drain', 4, 'never'), ('zb_h1', 4, 'never'),
    ('fill_drain', 4, 'always'), ('zb_h1', 4, 'always'), ('zbv', 4, 'never')])
@pytest.mark.slow
@pytest.mark.parametrize('name', MEMORY_MODELS)
def test_the_predicted_peak_is_the_pipelines(name: str, schedule: str, chunks: int,
                                             mode: str) -> None:
    """One worker (one partition, or ZBV's two in a V): the predicted activations and
    working memory are the most a
    training step of the pipeline holds: with 4 micro-batches, the later ones' weight
    gradients too, until added to the first's, in ``B`` or in ``W``, and without the
    logits from ``I`` on; checkpointed, each micro-batch's input alone until its
    recomputation (not its output, which that makes again). With one micro-batch,
    the unwrapped model's step holds less when the pipeline holds a partition's
    output that no layer saves, as the logits (tensors only: what a kernel allocates
    inside itself is not seen by either)."""
    torch.manual_seed(0)
    module, input, target, loss_fn = MEMORY_MODELS[name]()
    plan = torchgpipe.plan(module, input, devices=['cpu:0'], target=target, loss_fn=loss_fn,
                           chunks=chunks, schedules=['1f1b'], checkpoint=[mode],
                           param_scale=1.0, repeat=1)
    parameters = sum(p.numel() * p.element_size() for p in module.parameters())
    n = len(module)
    balance = [n // 2, n - n // 2] if schedule == 'zbv' else [n]
    predicted = plan.predict(schedule, balance, chunks, mode).memory[0] - parameters
    pipe = GPipe(module, balance=balance, devices=['cpu:0'] * len(balance), chunks=chunks,
                 checkpoint=mode)
    measured = live_peak(lambda: pipe.train_step(input, target, loss_fn, schedule=schedule),
                         module, input, target)
    assert abs(predicted / measured - 1) < 0.1, (predicted, measured)
    if chunks == 1:
        unwrapped = live_peak(lambda: loss_fn(module(input), target).backward(), module,
                              input, target)
        assert unwrapped <= measured


@skippable(stash=['skip'])
class StashProjection(nn.Module):
    """Stashes a projection of its input, which nothing else keeps, and returns the input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash('skip', self.linear(x))
        return x


@skippable(pop=['skip'])
class PopMul(nn.Module):
    """Multiplies its input by the skip: saves the skip for its backward pass."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop('skip')
        return x * skip


@skippable(pop=['skip'])
class PopCat(nn.Module):
    """Concatenates the skip to its input."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop('skip')
        return torch.cat([x, skip], dim=1)


@pytest.mark.parametrize('stasher, popper, loose, reused', [
    (StashProjection, PopAdd, True, False), (Stash, PopAdd, False, False),
    (StashProjection, PopMul, True, True), (Stash, PopCat, False, False)])
# (An addition gives the skip its output's gradient itself; a product, one of its
# own; a concatenation, a part of its own output's.)
def test_a_skip_is_measured_with_its_route_and_what_each_end_keeps(
        stasher: Any, popper: Any, loose: bool, reused: bool) -> None:
    """Each skip's route and bytes; its bytes only the skip keeps (a projection's, not
    the stashing layer's input); those the pop saves; those of its gradient that are the
    pop's output gradient; and they survive a saved plan."""
    module = nn.Sequential(nn.Linear(8, 16), stasher(), nn.Linear(16, 16), popper())
    costs = measure(module, torch.randn(4, 8), [4], torch.device('cpu'), repeat=1)
    costs.processes = True
    nbytes = 4 * 16 * 4
    at = costs.at(4)
    assert costs.skips == [(1, 3)] and at.skipped == [nbytes]
    assert at.loose == [nbytes if loose else 0.0]
    assert at.reused == [nbytes if reused else 0.0]
    assert at.aliased == [nbytes if popper is PopAdd else 0.0]
    # A stash of the layer's own output gets two gradients, added in place in
    # training (a projection's third, its input's, comes from its own pass).
    assert at.working[1] < 3 * nbytes if stasher is Stash else at.working[1] > 3 * nbytes
    # The first layer's output: saved by the third, through a stash that passes
    # it on (not freed before the first's backward pass, which a partition
    # boundary after the stash would make the pipeline's to hold), or not.
    assert at.passed[0] == (0.0 if stasher is Stash else nbytes)


@pytest.mark.parametrize('name', MEMORY_MODELS)
def test_the_gradients_i_keeps_for_w_are_the_layers_sum(name: str) -> None:
    """A partition after the first, its backward pass split: what ``I`` leaves alive for
    ``W`` (the gradients that reached each node leading to a weight) is the sum of what
    the planner measured for each of its layers alone. A popped skip is an input of its
    layer there, not a weight."""
    from torchgpipe.engine.split import input_pass
    from torchgpipe.balance.working import Live
    torch.manual_seed(0)
    module, input, target, loss_fn = MEMORY_MODELS[name]()
    plan = torchgpipe.plan(module, input, devices=['cpu:0'], chunks=1, schedules=['1f1b'],
                           checkpoint=['never'], repeat=1)
    assert plan.costs is not None
    predicted = sum(plan.costs.at(input.size(0)).retained[1:])
    leaf = module[0](input).detach().requires_grad_()
    live = Live({t.untyped_storage().data_ptr() for t in [*module.parameters(), leaf]})
    with live:
        output = module[1:](leaf.clone())
        since = len(live.log)
        weights = input_pass([output], [torch.ones_like(output)], [leaf])
        made = {number for number in live.alive.values() if number >= since}
        kept = sum(live.log[number][1] for number in made) - tensor_bytes(leaf.grad)
        weights.run()
    assert predicted > 0 and abs(predicted / kept - 1) < 0.1, (predicted, kept)


def test_a_loss_keeps_neither_its_target_nor_its_output() -> None:
    """The target is the user's before the step (the loss's micro-batches of it are
    views), and the pipeline keeps the weighted number of a loss, not its output (whose
    storage, mse_loss's on CPU, is as large as its input): a loss that saves only its
    input and its target keeps nothing of its own, whatever storage the target is in."""
    module = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 256))
    input = torch.randn(32, 16)
    compact = torch.randn(32, 256)
    inside = torch.randn(32, 1024)[:, :256]  # a view of a storage four times larger
    for target in (compact, inside):
        costs = measure(module, input, [4, 32], torch.device('cpu'), repeat=1,
                        loss=(F.mse_loss, target))
        assert [costs.at(size).kept[-1] for size in (4, 32)] == [0.0, 0.0]
        assert [costs.at(size).passed[-1] for size in (4, 32)] == [0.0, 0.0]


def test_a_gradient_an_addition_shares_with_its_skip_counts_once_before_the_pop() -> None:
    """Within the partition of the pop, the layer before it gets the very gradient the
    skip does: its backward pass holds one tensor, not two. A pop that opens the next
    partition hands the two over apart (a message, or two leaves' gradients)."""
    from torchgpipe.planner.partitions import Partitions
    module = nn.Sequential(nn.Linear(8, 16), Stash(), nn.Tanh(), PopAdd(), nn.Linear(16, 4))
    costs = measure(module, torch.randn(4, 8), [4], torch.device('cpu'), repeat=1)
    apart = dataclasses.replace(costs, _cache={}, table=[
        dataclasses.replace(row, aliased=[0.0] * len(row.aliased)) for row in costs.table])
    assert costs.at(4).aliased == costs.at(4).skipped != [0.0]
    assert (Partitions(costs, [5])(0, 4).temporaries.backward.alone
            < Partitions(apart, [5])(0, 4).temporaries.backward.alone)
    assert Partitions(costs, [3, 2])(0, 4) == Partitions(apart, [3, 2])(0, 4)


@pytest.mark.cuda
def test_a_target_copied_to_the_last_device_counts() -> None:
    """A CPU target for a CUDA pipeline: each micro-batch of it is a copy on the last
    device, kept for the step; cross entropy saves it, so its bytes count."""
    module = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 10))
    target = torch.randint(0, 10, (32,))
    on_host = measure(module, torch.randn(32, 8), [8], torch.device('cuda'), repeat=1,
                      loss=(F.cross_entropy, target))
    on_device = measure(module, torch.randn(32, 8), [8], torch.device('cuda'), repeat=1,
                        loss=(F.cross_entropy, target.cuda()))
    rows_bytes = 8 * target.element_size()
    assert on_host.at(8).kept[-1] - on_device.at(8).kept[-1] >= rows_bytes

"""The planner across processes: every rank gets one plan, which trains as the unwrapped model."""
import math
import warnings
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchgpipe
from torchgpipe import GPipe
from torchgpipe.distributed import DistributedGPipe
from torchgpipe.engine.generators import worker_of
from torchgpipe.planner.costs import measure
from torchgpipe.planner.predict import Candidate, predict
from torchgpipe.skip import pop, skippable, stash

from process_group import run_distributed
from test_distributed_pipe import Config, Result, assert_equal, batch, merge, model, train, \
    unwrapped

pytestmark = pytest.mark.slow

#: Each job's plans: every schedule, and ZBV alone (two partitions per rank, in a V;
#: a loop's layout as Plan.kwargs gives it is checked by tests/planner/test_planner.py).
SCHEDULES: List[Optional[List[str]]] = [None, ['zbv']]


def planned(module: nn.Sequential, schedules: Optional[List[str]], **kwargs: Any
            ) -> torchgpipe.Plan:
    sample, target = batch(0)
    return torchgpipe.plan(module, sample, group=dist.group.WORLD, target=target,
                           loss_fn=F.mse_loss, chunks=4, repeat=1, schedules=schedules,
                           **kwargs)


def plan_and_train(rank: int, world_size: int) -> List[Dict[str, Any]]:
    """On every rank: each plan, and the DistributedGPipe it gives, trained."""
    results = []
    for schedules in SCHEDULES:
        plan = planned(model('mlp'), schedules)
        config = Config('mlp', tuple(plan.balance), plan.schedule, plan.checkpoint,
                        plan.chosen.placement)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            pipe = DistributedGPipe(model('mlp'), **plan.kwargs)
            trained = train(pipe, config, pipe.train_step)
            # Another pipeline of the plan, its first steps under other threads.
            torch.set_num_threads(plan.kwargs['planned_threads'] + 1)
            try:
                other = DistributedGPipe(model('mlp'), **plan.kwargs)
                for _ in range(2):
                    other.eval_step(batch(0)[0])
            finally:
                torch.set_num_threads(plan.kwargs['planned_threads'])
        with torchgpipe.trace(pipe) as timeline:
            pipe.train_step(*batch(0), F.mse_loss, schedule=plan.schedule)
        compared = plan.compare(timeline)
        results.append({'table': plan.table(), 'kwargs': plan.kwargs, 'devices': plan.devices,
                        'processes': plan.processes, 'costs': plan.costs, 'trained': trained,
                        'compared': sorted({(r.device, r.what) for r in compared.rows
                                            if r.measured > 0}),
                        'warned': [str(w.message) for w in caught
                                   if 'intra-op threads' in str(w.message)]})
    # A model with a skip between the ranks: what the skip's messages cost, measured.
    sample, target = torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,))
    skipping = torchgpipe.plan(shortcut_model(), sample, group=dist.group.WORLD, target=target,
                               loss_fn=F.cross_entropy, chunks=2, repeat=1,
                               schedules=['1f1b'], checkpoint=['never'])
    assert skipping.costs is not None
    results.append({'costs': skipping.costs})
    # Sharded over 4 ranks (FSDP2): the plan predicts its choice so.
    sharded = planned(model('mlp'), ['1f1b'], shards=4, checkpoint=['never'])
    assert sharded.costs is not None
    candidate = Candidate('1f1b', tuple(sharded.balance), sharded.chunks, 'never', 2)
    expected = predict(sharded.costs, candidate, shards=4)
    results.append({'sharded': list(sharded.memory.values()) == expected.memory and
                    sharded.predict('1f1b', sharded.balance, sharded.chunks, 'never').step ==
                    expected.step})
    return results


@pytest.fixture(scope='module')
def two_ranks() -> List[List[Dict[str, Any]]]:
    # Untraced, for its time (tracing about doubles it): the lines only it runs (the
    # calibration's steps across the group) go unmeasured by coverage.py.
    return run_distributed(plan_and_train, timeout=240, measured=False)


def one_process(plan: Dict[str, Any], config: Config) -> Result:
    """The plan's layout as GPipe runs it, a worker thread per rank."""
    kwargs = dict(plan['kwargs'])
    n, placement = len(kwargs['balance']), kwargs.pop('placement')
    devices = [f'cpu:{worker_of(j, n, 2, placement)}' for j in range(n)]
    gpipe = GPipe(model('mlp'), **kwargs, devices=devices)
    return train(gpipe, config, gpipe.train_step)


@pytest.mark.parametrize('index', range(len(SCHEDULES)),
                         ids=[' '.join(s) if s else 'every' for s in SCHEDULES])
def test_every_rank_gets_one_plan_that_trains_as_the_unwrapped_model(
        two_ranks: List[List[Dict[str, Any]]], index: int) -> None:
    first, second = (r[index] for r in two_ranks)
    for key in ('table', 'kwargs', 'devices', 'costs'):
        assert first[key] == second[key], key
    # The pilot's steps ran across the ranks, each size's pace the same on both.
    assert len(first['costs'].pace) == len(first['costs'].sizes) > 0
    assert first['devices'] == ['rank 0', 'rank 1'] and first['processes']
    # A traced step of every rank compares with the plan, rank by rank.
    assert {device for device, _ in first['compared']} == {'step', 'rank 0', 'rank 1'}
    assert ('rank 1', 'forward') in first['compared']
    schedules = SCHEDULES[index]
    if schedules:
        assert first['table'][0]['schedule'] == schedules[0]
        assert first['kwargs']['placement'] == ('v' if schedules == ['zbv'] else 'loop')
        assert len(first['kwargs']['balance']) == 4
    balance = tuple(first['kwargs']['balance'])
    config = Config('mlp', balance, first['table'][0]['schedule'],
                    first['kwargs']['checkpoint'], first['kwargs']['placement'])
    actual = merge([r[index]['trained'] for r in two_ranks])
    # Bit for bit GPipe's in one process, and the unwrapped model's to rounding.
    assert_equal(actual, one_process(first, config), exact=True)
    assert_equal(actual, unwrapped(config), exact=False)
    # Under the threads planned, no warning; another pipeline under more, one, on each rank.
    for rank in two_ranks:
        said = rank[index]['warned']
        assert len(said) == 1 and 'planned_threads: 1, torch.get_num_threads(): 2' in said[0]


def test_a_plan_for_sharded_partitions_predicts_them_sharded(
        two_ranks: List[List[Dict[str, Any]]]) -> None:
    assert [r[len(SCHEDULES) + 1] for r in two_ranks] == [{'sharded': True}] * 2


def test_the_ranks_agree_on_what_a_skips_message_costs(
        two_ranks: List[List[Dict[str, Any]]]) -> None:
    """Planning a model whose skips cross ranks calibrates a skip's message on every rank
    together (rank 0 finds its cost); a model without skips leaves it at nothing."""
    first, second = (r[len(SCHEDULES)]['costs'] for r in two_ranks)
    assert first.skips and first == second
    assert first.skip_overhead > 0.0  # (found by halving: never 0 for a step that took time)
    assert all(r[0]['costs'].skip_overhead == 0.0 for r in two_ranks)  # the MLP


class Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError('broken on purpose')


def refused(rank: int, world_size: int) -> List[str]:
    """Each error a rank raises, for each way of planning wrong."""
    errors = []
    attempts = [
        # rank 1 names a device it does not have
        lambda: planned(model('mlp'), None, device='cuda:99' if rank else 'cpu'),
        # rank 1 alone gives a bad argument
        lambda: planned(model('mlp'), None, runners_up=-1 if rank else 1),
        # rank 0 alone gives devices too
        lambda: torchgpipe.plan(model('mlp'), batch(0)[0], group=dist.group.WORLD,
                                devices=None if rank else ['cpu:0', 'cpu:1']),
        # the ranks disagree on the memory limit, and on a layer
        lambda: planned(model('mlp' if rank else 'tied'), None, memory_limit=2**30 * (rank + 1)),
        # a layer that fails: rank 0 measures it, rank 1 must not wait forever
        lambda: planned(nn.Sequential(*model('mlp'), Broken()), None),
    ]
    for attempt in attempts:
        with pytest.raises((ValueError, RuntimeError)) as caught:
            attempt()
        errors.append(f'{caught.type.__name__}: {caught.value}')
    return errors


def test_a_wrong_rank_makes_every_rank_raise() -> None:
    ranks = run_distributed(refused, timeout=120)
    for rank, errors in enumerate(ranks):
        device, argument, both, disagreeing, broken = errors
        if rank == 1:
            assert device.startswith('ValueError: device is cuda:99'), device
            assert argument.startswith('ValueError: runners_up must be at least 0'), argument
        else:
            assert device.startswith('ValueError: rank 1 cannot plan: device is cuda:99'), device
            assert argument.startswith('ValueError: rank 1 cannot plan: runners_up must be')
        if rank == 0:
            assert both.startswith('ValueError: plan takes devices or group, not both'), both
        else:
            assert both.startswith('ValueError: rank 0 cannot plan: plan takes devices or group')
        assert disagreeing.startswith('ValueError: every rank must plan with the same arguments')
        assert 'rank 1: memory_limit 2147483648 (rank 0: 1073741824)' in disagreeing
        assert 'rank 1: layers [' in disagreeing
        if rank == 0:
            assert broken == 'RuntimeError: broken on purpose'
        else:
            assert broken.startswith('RuntimeError: rank 0 failed measuring for the plan')
            assert 'broken on purpose' in broken


def test_group_needs_distributed_and_device_needs_group() -> None:
    sample = torch.zeros(4, 2)
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert not dist.is_initialized()
    # Before init_process_group, group=dist.group.WORLD is None.
    with pytest.raises(RuntimeError, match=r'call torch\.distributed\.init_process_group'):
        torchgpipe.plan(module, sample, group=dist.group.WORLD, device='cpu')
    with pytest.raises(ValueError, match='device is for planning across processes'):
        torchgpipe.plan(module, sample, devices=['cpu:0', 'cpu:1'], device='cpu')
    with pytest.raises(RuntimeError, match='plan with group= needs torch.distributed'):
        torchgpipe.plan(module, sample, group=object())


def test_a_job_of_torchrun_planning_before_init_process_group_is_told_to_call_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Without device= too: group=dist.group.WORLD is None, as if no group was given."""
    monkeypatch.setenv('WORLD_SIZE', '2')  # as torchrun sets it in each rank
    with pytest.raises(RuntimeError, match=r'call torch\.distributed\.init_process_group'):
        torchgpipe.plan(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), torch.zeros(4, 2),
                        group=dist.group.WORLD)


def test_a_plan_for_processes_gives_distributed_gpipe_its_arguments_and_saves_so(
        tmp_path: Any) -> None:
    from torchgpipe.planner.option import Option
    chosen = Option('zbv', [1, 2, 2, 1], 4, 'never', 'v', 0.01, [1.0, 2.0])
    plan = torchgpipe.Plan(chosen, [], ['rank 0', 'rank 1'], None, processes=True)
    expected = {'balance': [1, 2, 2, 1], 'chunks': 4, 'checkpoint': 'never', 'placement': 'v',
                'planned_threads': None}
    assert plan.kwargs == expected
    plan.save(tmp_path / 'plan.json')
    loaded = torchgpipe.Plan.load(tmp_path / 'plan.json')
    assert loaded.processes and loaded.kwargs == expected and loaded.devices == plan.devices


@skippable(stash=['shortcut'])
class Project(nn.Module):
    """Stashes a projection of its input (its gradient comes back) and returns the input."""

    def __init__(self, inputs: int = 8, outputs: int = 32) -> None:
        super().__init__()
        self.conv = nn.Conv2d(inputs, outputs, 1)

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        yield stash('shortcut', self.conv(x))
        return x


@skippable(pop=['shortcut'])
class Merge(nn.Module):
    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        shortcut = yield pop('shortcut')
        return x + shortcut


@skippable(pop=['shortcut'])
class Gate(nn.Module):
    """Multiplies by the shortcut: saves it for the backward pass."""

    def forward(self, x: torch.Tensor):  # type: ignore[no-untyped-def]
        shortcut = yield pop('shortcut')
        return x * shortcut


def shortcut_model(merge: Any = Merge) -> nn.Sequential:
    """A residual block whose shortcut crosses from rank 0 to rank 1 under [3, 6]."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), Project(),
                         nn.Conv2d(8, 32, 3, padding=1), nn.ReLU(), merge(), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10))


def gated_model() -> nn.Sequential:
    """The residual block, its shortcut multiplied in: the pop saves what it receives."""
    return shortcut_model(Gate)


def wide_model() -> nn.Sequential:
    """Under [3, 2], rank 0's output and its gradient (held by the pipeline through the
    backward pass) are as large as any tensor there, and its peak is before its last
    layer, in a GELU's backward pass."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 512), nn.GELU(), nn.Linear(512, 512), nn.GELU(),
                         nn.Linear(512, 16))


def projected_model() -> nn.Sequential:
    """Under [4, 6], rank 0's peak is in the backward pass of its layer before last, which
    stashed the projection rank 1 pops: the gradient rank 1 sends back for it is held
    until the pass returns (the ReLU before keeps the projection's input alive)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 64, 1), nn.ReLU(), Project(64, 64), nn.Conv2d(64, 64, 1),
                         nn.ReLU(), Merge(), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(64, 10))


def rectified_model() -> nn.Sequential:
    """Under [4, 1], rank 0's output is a ReLU's, which saves it: the pipeline holds it
    through the backward pass all the same, past the ReLU's."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 16))


def blocks_model() -> nn.Sequential:
    """Under [2, 2], rank 1's first layer ends in a ReLU, which saves its output: within
    the partition nothing else holds it, and it is gone once the ReLU's backward pass
    has run, before the linear layer's input gradient is made. Rank 0's last layer is
    the same, its output held by the pipeline: a later micro-batch's new weight
    gradient comes at its peak."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 256), nn.Sequential(nn.Linear(256, 512), nn.ReLU()),
                         nn.Sequential(nn.Linear(512, 512), nn.ReLU()), nn.Linear(512, 16))


class TanhGELU(nn.Module):
    """GELU's tanh approximation in elementary operations (GPT-2's): its backward pass
    makes as many temporaries as the tensors it saved."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


def composite_model() -> nn.Sequential:
    """Under [2, 3] in ZB-H1, rank 1's ``I`` keeps what the second GELU saved beside the
    temporaries of its backward pass, which ``B`` frees once used; in ZBV under
    [1, 2, 1, 1], rank 1's partition with the second GELU alone has no weights: its
    ``I`` keeps nothing."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 512), TanhGELU(), nn.Linear(512, 512), TanhGELU(),
                         nn.Linear(512, 16))


def vocabulary_model() -> nn.Sequential:
    """A head over a vocabulary: its loss keeps the log-probabilities until ``I``."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(100, 32), nn.Linear(32, 32), nn.GELU(),
                         nn.Linear(32, 4096))


def vocabulary_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(output.reshape(-1, output.size(-1)), target.reshape(-1))


def tied_model() -> nn.Sequential:
    """An embedding and a head sharing a weight: under [2, 2], on both ranks, which sum
    its gradient's two halves as the step ends."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(4096, 32), nn.Linear(32, 4096, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(32, 32), nn.GELU(), head)


def resnet_model() -> nn.Sequential:
    """The benchmark's CNN, small: under [8, 11], rank 0's largest backward pass is
    that of a layer before its last, while the gradient of its output, which the
    pipeline holds until the pass ends, is still alive, and so are the gradient of
    the skip it sent on and its output, a ReLU's."""
    from benchmarks.models.resnet import resnet
    torch.manual_seed(0)
    return resnet((1, 1, 1), width=8, num_classes=10, batch_norm=False, small_input=True)


#: The models whose peaks are compared, with a batch, its target and a loss.
PEAK_MODELS: Dict[str, Tuple[Any, Any]] = {
    'resnet': (resnet_model, lambda: (torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)),
                                      F.cross_entropy)),
    'shortcut': (shortcut_model, lambda: (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)),
                                          F.cross_entropy)),
    'gated': (gated_model, lambda: (torch.randn(8, 3, 8, 8), torch.randint(0, 10, (8,)),
                                    F.cross_entropy)),
    'wide': (wide_model, lambda: (torch.randn(1024, 16), torch.randn(1024, 16), F.mse_loss)),
    'composite': (composite_model, lambda: (torch.randn(1024, 16), torch.randn(1024, 16),
                                            F.mse_loss)),
    'blocks': (blocks_model, lambda: (torch.randn(1024, 16), torch.randn(1024, 16),
                                      F.mse_loss)),
    'rectified': (rectified_model, lambda: (torch.randn(1024, 16), torch.randn(1024, 16),
                                            F.mse_loss)),
    'projected': (projected_model, lambda: (torch.randn(8, 3, 16, 16),
                                            torch.randint(0, 10, (8,)), F.cross_entropy)),
    'vocabulary': (vocabulary_model, lambda: (torch.randint(0, 100, (16, 8)),
                                              torch.randint(0, 4096, (16, 8)), vocabulary_loss)),
    'tied': (tied_model, lambda: (torch.randint(0, 4096, (16, 8)),
                                  torch.randint(0, 4096, (16, 8)), vocabulary_loss)),
}

#: Each configuration compared: the shortcut stashed before the end of rank 0's
#: partition, or at its end.
PEAKS = [('shortcut', 'fill_drain', (3, 6), 1, 'never'),
         ('shortcut', 'fill_drain', (2, 7), 1, 'never'),
         ('shortcut', '1f1b', (3, 6), 4, 'always'), ('shortcut', 'zb_h1', (3, 6), 1, 'never'),
         ('shortcut', 'zb_h1', (3, 6), 4, 'never'), ('shortcut', 'zb_h1', (2, 7), 2, 'never'),
         ('wide', 'fill_drain', (3, 2), 1, 'never'), ('wide', '1f1b', (3, 2), 2, 'never'),
         ('vocabulary', 'zb_h1', (2, 2), 4, 'never'), ('tied', '1f1b', (2, 2), 4, 'never'),
         ('gated', '1f1b', (3, 6), 4, 'never'), ('resnet', 'zb_h1', (8, 11), 1, 'never'),
         ('vocabulary', 'interleaved_1f1b', (1, 1, 1, 1), 2, 'never'),
         ('tied', 'zbv', (1, 1, 1, 1), 8, 'never'), ('vocabulary', 'zb_h1', (2, 2), 1, 'never'),
         ('wide', 'zb_h1', (2, 3), 1, 'never'), ('resnet', 'zb_h1', (11, 8), 1, 'never'),
         ('projected', 'fill_drain', (4, 6), 1, 'never'),
         ('rectified', 'fill_drain', (4, 1), 1, 'never'), ('resnet', '1f1b', (8, 11), 1, 'never'),
         ('composite', 'zb_h1', (2, 3), 1, 'never'), ('composite', 'zbv', (1, 2, 1, 1), 1, 'never'),
         ('blocks', '1f1b', (2, 2), 4, 'never'), ('resnet', 'zbv', (6, 2, 4, 7), 2, 'except_last'),
         ('resnet', 'zbv', (6, 2, 4, 7), 2, 'never'), ('resnet', 'zbv', (6, 2, 4, 7), 4, 'always'),
         ('resnet', 'zbv', (6, 1, 5, 7), 2, 'always'), ('resnet', 'zbv', (7, 4, 4, 4), 4, 'never')]
#: The ranks of configurations whose every tensor the prediction accounts for,
#: held to 2%: the blocks model's (see it); rank 0 of the small CNN in ZBV,
#: which recomputes its first partition, whose addition's sum and its operands
#: are alive at once, beside all the rest; and its rank 1, which holds both
#: partitions of the V's turn (see the test). Three ranks of the small CNN in
#: ZBV are held to 10% only: the tensors in flight between processes (sent, or
#: posted to be received) come out 2.5% to 6.7% off there, which the typed
#: memory model of the planner's next round is to settle.
EXACT: Dict[Tuple[str, str, Tuple[int, ...], int, str], Tuple[int, ...]] = {
    ('blocks', '1f1b', (2, 2), 4, 'never'): (0, 1),
    ('resnet', 'zbv', (6, 2, 4, 7), 2, 'except_last'): (0, 1),
    ('resnet', 'zbv', (6, 2, 4, 7), 2, 'never'): (1,),
    ('resnet', 'zbv', (6, 2, 4, 7), 4, 'always'): (1,),
    ('resnet', 'zbv', (6, 1, 5, 7), 2, 'always'): (1,),
    ('resnet', 'zbv', (7, 4, 4, 4), 4, 'never'): (0,)}


def predicted_and_measured_peaks(rank: int, world_size: int) -> List[Tuple[float, float]]:
    """Each configuration's predicted peak of this rank, and the peak a step held."""
    from benchmarks.plan_ranks import settle, tensor_peak
    made = {name: (build(), *batch()) for name, (build, batch) in PEAK_MODELS.items()}
    costs = {name: measure(module, input, [len(input) // 4, len(input) // 2, len(input)],
                           torch.device('cpu'), repeat=1, loss=(loss_fn, target))
             for name, (module, input, target, loss_fn) in made.items()}
    for measured in costs.values():
        measured.processes = True  # as torchgpipe.plan(..., group=...) measures
    peaks = []
    for name, schedule, balance, chunks, mode in PEAKS:
        module, input, target, loss_fn = made[name]
        placement = 'v' if schedule == 'zbv' else 'loop'
        candidate = Candidate(schedule, balance, chunks, mode, 2, placement)
        pipe = DistributedGPipe(module, balance=list(balance), chunks=chunks, checkpoint=mode,
                                placement=placement)

        def step() -> None:
            pipe.train_step(input, target, loss_fn, schedule=schedule)
        settle(step)
        module.zero_grad(set_to_none=True)
        own = sum(p.numel() * p.element_size() for p in pipe.parameters())
        peaks.append((predict(costs[name], candidate).memory[rank],
                      float(tensor_peak(module, step) + own)))
    return peaks


def test_each_rank_holds_the_peak_predicted() -> None:
    """Each rank's predicted peak (parameters and their gradients included) is what its
    step held, within 10%. The shortcut's rank 0 keeps the stashed projection until
    its backward pass (or ``I``), which gets the projection's gradient back (at the
    last layer, or at the layers after the stash too); its rank 1 keeps the copy it
    receives until its own, and the gradients of its input and of the copy until
    ``W``; ``I`` frees nothing on its way, and lets go of the vocabulary loss's
    log-probabilities once done; the GELU's output, which only the next layer saves,
    is gone by the GELU's backward pass; the ranks sharing a weight hold the other's
    share of its gradient and the sum as the step ends; a pop that saves the skip it
    receives keeps that one tensor; the gradients the pipeline passes a backward pass
    stay until it ends; the weights' gradients are made in the step, each
    partition's in its first backward pass (rank 0 of the vocabulary model in
    interleaved 1F1B, the embedding's and the GELU's, peaks in the GELU's backward
    passes, before the embedding's gradient is made); a rank's partitions sharing a
    weight (the tied model's rank 0 in ZBV) hold a gradient each; the first backward
    pass has made, at its peak, the gradients of the layers done by then only (the
    vocabulary model's rank 0 in ZB-H1, one micro-batch); the output a rank sends
    another goes at ``I``, whether or not the next layer saves it (its copy, there:
    the wide model's rank 0 under [2, 3]); ``I`` keeps the gradients it leaves ``W``
    as it goes on (the small CNN's rank 1 under [11, 8]); B holds the gradient of a
    skip it sent on from the start (the projected model), and the output it starts
    from to the end (the rectified model); ``I`` frees none of what the layers saved,
    but where the partition has no weights (the composite model). Without any one of
    these, a rank is 10.5% to 40% off. Within a partition, a layer's output goes
    once what saved it has run (the blocks model's rank 1), and a partition's last
    layer holds it to the end, where a later micro-batch's new weight gradients
    come (its rank 0); a recomputation peaks within its forward pass (the small
    CNN's rank 0 in ZBV, EXACT: 9.2% under without). Where one rank runs two
    partitions of a micro-batch (the V's turn of ZBV, rank 1 of the small CNN), what
    one hands the other is one tensor, counted once (its input, when not
    checkpointed; checkpointed, the shortcut's input that it passes on as it is)
    and alive until both let go of it: the output and the skip a partition lends
    stay after its ``I`` until the next one's ``W``; a checkpointed forward pass
    makes them for the next one; the gradients handed back are alive from the
    later partition's backward pass; ``I`` lets go of what the nodes above where
    ``W`` starts saved (a ReLU's output after its convolution), and of a skip
    received for a layer up there with its gradient (rank 1 under [7, 4, 4, 4], to 10%);
    what the last layer leaves ``W`` is the output's gradient only where it is
    that tensor. Each of these held to 2% fails without it."""
    ranks = run_distributed(predicted_and_measured_peaks, timeout=120)
    errors = [(rank, config, round(predicted / measured - 1, 3))
              for rank, peaks in enumerate(ranks)
              for config, (predicted, measured) in zip(PEAKS, peaks)]
    assert all(abs(error) < (0.02 if rank in EXACT.get(config, ()) else 0.1)
               for rank, config, error in errors), errors


@pytest.mark.parametrize('hosts, cores, threads, size, shared', [
    (['a'] * 4, [{0, 1}] * 4, 1, 4, 2.0),  # four ranks on two cores: they share them
    (['a'] * 4, [{0, 1, 2, 3}] * 4, 2, 4, 2.0),  # ... and on four, two threads each
    (['a'] * 4, [{0}, {0}, {1}, {1}], 1, 4, 2.0),  # pinned two to a core
    (['a'] * 4, [{0}, {1}, {2}, {3}], 1, 4, None),  # pinned a core each
    (['a'] * 2, [{0, 1}] * 2, 8, 2, 1.0),  # more threads than cores: each has them all
    (['a'] * 2, [{0, 1}] * 2, 1, 2, None),  # a core each
    (['a', 'a', 'b', 'b'], [{0}] * 4, 1, 4, None),  # across machines: not modelled
])
def test_ranks_share_the_cores_when_they_outnumber_them(
        monkeypatch: pytest.MonkeyPatch, hosts: List[str], cores: List[set], threads: int,
        size: int, shared: Optional[float]) -> None:
    """What PlanningGroup.cores tells the planner (``Costs.cores``), from every rank's machine, the
    cores it may run on and its threads; on CUDA devices, nothing."""
    from torchgpipe.planner.group import PlanningGroup
    monkeypatch.setattr(torch, 'get_num_threads', lambda: threads)
    monkeypatch.setattr('os.sched_getaffinity', lambda pid: cores[0], raising=False)
    monkeypatch.setattr('socket.gethostname', lambda: hosts[0])
    planning = object.__new__(PlanningGroup)
    planning.size, planning.device = size, torch.device('cpu')
    # This rank's report, and the others' as theirs would be on their machines and cores.
    planning._gather = lambda value, device: [value] + [  # type: ignore
        (host, sorted(mine), min(threads, len(mine)))
        for host, mine in zip(hosts[1:], cores[1:])]
    assert planning.cores() == shared
    planning.device = torch.device('cuda', 0)
    assert planning.cores() is None

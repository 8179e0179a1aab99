"""Every registered benchmark runs its CPU preset in smoke mode and writes its results.

The benchmarks live in ``benchmarks/`` at the repository root (not in the
wheel); the experiments are those of ``benchmarks.registry``, so a new one is
smoke-tested as soon as it is registered. Each runs in this process with
``--smoke`` (a couple of steps) and ``--output-dir`` in a temporary directory.
Their figures are not checked here (timings are never asserted), except the
loss differences of the transparency experiments, which must be 0 up to float
rounding.
"""
import json
import re
import sys
from pathlib import Path
from typing import Any, Callable, Dict, List

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import registry, report, runner, timing  # noqa: E402
from helpers import CHECKPOINT_MODES  # noqa: E402
from benchmarks.memory import parameter_count  # noqa: E402
from benchmarks.models.amoebanet import amoebanetd  # noqa: E402
from benchmarks.models.resnet import resnet, resnet101  # noqa: E402

# The benchmarks run the library's lines that the other tests measure: untraced.
pytestmark = [pytest.mark.unmeasured, pytest.mark.slow]

try:
    import matplotlib  # noqa: F401
    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


def check_overhead(document: Dict[str, Any]) -> None:
    results = document['results']
    assert [r['name'] for r in results] == ['wrapper', 'scheduler', 'compute-bound', 'memory']
    for r in results:
        assert r['ratio'] > 0 and isinstance(r['within_target'], bool)
    scheduler = results[1]
    assert scheduler['floor_ratio'] > 0 and scheduler['gpipe_over_floor'] > 0
    assert scheduler['target'] == max(12.0, 1.15 * scheduler['floor_ratio'])
    for r in results[:3]:
        for key in ('gpipe_ms', 'unwrapped_ms'):
            assert r[key]['min'] <= r[key]['median'] <= r[key]['max']
    assert document['grid'] and all('per_task_us' in g for g in document['grid'])
    assert [r['name'] for r in document['threaded']] == ['scheduler (threads)',
                                                         'compute-bound (threads)']


def check_transparency(document: Dict[str, Any]) -> None:
    results = document['results']
    assert {r['checkpoint'] for r in results} == set(CHECKPOINT_MODES)
    assert len({(r['chunks'], r['partitions']) for r in results}) >= 3
    # float64 and the same seed: equal up to float rounding.
    assert document['max_loss_difference'] < 1e-12
    assert document['max_parameter_difference'] < 1e-12


def check_unet_memory(document: Dict[str, Any]) -> None:
    results = document['results']
    assert [r['name'] for r in results] == ['naive-1', 'pipeline-1', 'pipeline-2', 'pipeline-4']
    for r in results:
        assert r['parameters'] > 0 and r['memory'] > r['parameter_bytes']
        assert sum(r['balance']) > 0 and len(r['balance']) == r['partitions']
    assert results[0]['memory_ratio'] == 1.0


def check_speed(document: Dict[str, Any]) -> None:
    results = document['results']
    for r in results:
        assert r['throughput'] > 0 and r['speedup'] > 0
        assert len(r['epoch_seconds']) == 2
        assert len(r['balance'] or [0]) == r['partitions']
        spread = r['throughput_spread']
        assert spread['min'] <= spread['median'] <= spread['max'] == r['throughput']
    assert results[0]['speedup'] == 1.0


def check_solver_speed(document: Dict[str, Any]) -> None:
    for r in document['results']:
        assert 0 < r['ms']['min'] <= r['ms']['median'] <= r['ms']['max']


def check_unet_example(document: Dict[str, Any]) -> None:
    r = document['results']
    assert r['max_loss_difference'] < 1e-5
    assert 0 < r['copies_with_portals'] < r['copies_through_partitions']


def check_schedules(document: Dict[str, Any]) -> None:
    results = document['results']
    assert [r['name'] for r in results] == ['compute-bound', 'memory', 'parallelism',
                                            'two threads', 'fill-drain', '1F1B, checkpointed']
    for r in results:
        # A smoke run's memory is a few KiB of noise in the process's
        # resident size, which may as well shrink during a step (a CI run
        # gave -2.75x), or nothing (NaN, see benchmarks.memory.peak_ratio):
        # only the timings are sure to be positive.
        assert r['ratio'] > 0 if r['name'] != 'memory' else isinstance(r['ratio'], float)
        assert ('target' in r) == (r['name'] in ('compute-bound', 'memory', 'parallelism'))
    assert [t['schedule'] for t in document['timelines']] == ['1f1b', 'fill_drain']
    for t in document['timelines']:
        assert 0 < t['utilization'] <= 1
        kinds = {e['kind'] for e in t['events']}
        assert {'forward', 'backward'} <= kinds
    # Each schedule's idle time from its actions, beside its formula.
    units = {r['schedule']: r for r in document['units']}
    assert list(units) == ['fill_drain', '1f1b', 'interleaved_1f1b', 'zb_h1', 'zbv']
    assert units['1f1b']['ratio'] == 1 and units['zb_h1']['ratio'] < 0.4
    assert all(r['idle'] == r['formula_value'] for n, r in units.items() if n != 'zbv')


def check_bubbles(document: Dict[str, Any]) -> None:
    units = {r['schedule']: r for r in document['units']}
    assert list(units) == ['fill_drain', '1f1b', 'interleaved_1f1b', 'zb_h1', 'zbv']
    every = {r['schedule']: r for r in document['results']}
    assert list(every) == ['1f1b', 'zb_h1', 'interleaved_1f1b', 'zbv']
    assert every['1f1b']['step_ratio'] == every['1f1b']['idle_ratio'] == 1
    assert all(r['step_ms'] > 0 and r['idle_ratio'] >= 0 for r in every.values())
    # Each traced step keeps its events, with the split actions where there are.
    assert {'input', 'weight'} <= {e['kind'] for e in every['zb_h1']['events']}
    assert not {'input', 'weight'} & {e['kind'] for e in every['1f1b']['events']}
    memory = document['device_memory']
    # A rank each (a smoke run spawns 2 of the preset's 4).
    assert memory['ranks'] >= 2
    assert len(memory['per_rank_mib']['1f1b']) == len(memory['per_rank_mib']['zb_h1']) == \
        memory['ranks']
    assert memory['target'] == 1.05
    assert isinstance(memory['ratio'], float)  # noise in a smoke run: see check_schedules


def check_distributed(document: Dict[str, Any]) -> None:
    from benchmarks import distributed as d

    schedules = list(d.SCHEDULES)
    latency = d.latency_names(2)
    names = [n for s in schedules for n in (d.anchor_name(s), d.ours_name(s))] + \
        [d.FILL_DRAIN] + latency + [d.one_process_name(s) for s in schedules] + [d.UNWRAPPED]
    assert list(document['times']) == names
    for t in document['times'].values():
        assert 0 < t['min'] <= t['median'] <= t['max'] and t['samples'] >= 1
    results = document['results']
    assert [(r['measured'], r['against']) for r in results] == [
        (d.ours_name(s), d.anchor_name(s)) for s in schedules] + [(d.FILL_DRAIN, d.ANCHOR)] + [
        (latency[1], latency[0])] + [
        (d.one_process_name(s), d.anchor_name(s)) for s in schedules] + [
        (d.OURS, d.ONE_PROCESS), (d.OURS, d.UNWRAPPED)]
    assert all(r['ratio'] > 0 and r['ratio_fastest'] > 0 and r['ratio_median'] > 0
               for r in results)
    # A paired median: one sample a round, so with one round it is the ratio
    # of the two steps, which is also that of the fastest and of the medians.
    assert all(r['ratio'] == pytest.approx(r['ratio_fastest']) for r in results)
    # Each of ours against the anchor's, and the one-process steps against
    # the anchor's: targets; the others are for information.
    targeted = {(r['measured'], r['target']) for r in results if 'target' in r}
    assert targeted == {(d.ours_name(s), d.TARGETS[s]) for s in schedules} | {
        (d.one_process_name(s), d.ONE_PROCESS_TARGET) for s in schedules} | {
        (latency[1], d.LATENCY_TARGET)}
    # Every step trains the same mini-batch from the same parameters: the same loss.
    assert set(document['losses']) == set(names)
    assert document['max_loss_difference'] < 1e-5
    assert document['latency_loss_difference'] < 1e-5
    assert document['ranks_malloc_tuned'] in (True, False)


def check_plan(document: Dict[str, Any]) -> None:
    """Each model planned: the choice first among its measured rows, the even split
    measured for the limited model, every figure of the targets in the headline."""
    for model in document['results']:
        assert model['rows'][0]['chosen'] and not any(r['chosen'] for r in model['rows'][1:])
        assert all(r['predicted'] > 0 and r['measured'] > 0 for r in model['rows'])
        assert all(min(r['steps']) <= r['measured'] <= max(r['steps']) for r in model['rows'])
        assert model['plan'].startswith('plan: ')
    assert any(m.get('even', {}).get('ratio', 0) > 0 for m in document['results'])
    # The pilot's own configurations are measured too: 1F1B, nothing checkpointed.
    piloted = [r['configuration'] for m in document['results'] for r in m['rows']
               if r['pilot']]
    assert piloted and all(c.startswith('1f1b,') and "checkpoint='never'" in c
                           for c in piloted)
    # The ablation: the plan again without each correction of two CPU workers, its choice
    # measured, and every configuration of the grid predicted by it.
    left_out = ['pilot pace']
    for model in document['results']:
        assert sorted(model['chosen_without']) == sorted(left_out)
        measured = {r['configuration'] for r in model['rows']}
        assert set(model['chosen_without'].values()) <= measured
        assert all(sorted(r['without']) == sorted(left_out) and min(r['without'].values()) > 0
                   for r in model['rows'])
    assert {f['label'] for f in document['headline']} == {
        'median error', 'largest error', 'choice over the best', 'plan over the even split',
        'planning 100 layers', 'median step spread', 'median pilot drift',
        'largest pilot drift', 'repeat difference', 'grid median error',
        *[f'{figure} without {c}' for c in left_out
          for figure in ('grid median error', 'choice over the best')]}


#: What each experiment's results must hold beyond what every document holds.
def check_sharded(document: Dict[str, Any]) -> None:
    from benchmarks import sharded as s

    assert list(document['times']) == list(s.WAYS)
    for t in document['times'].values():
        assert 0 < t['min'] <= t['median'] <= t['max']
    memory, time, ddp = document['results']
    assert (memory['measured'], memory['against']) == (s.FSDP, s.DDP)
    assert (time['measured'], time['against'], ddp['measured']) == (s.FSDP, s.ANCHOR, s.DDP)
    # Counted from the tensors: the shards are half the replicas' (dp 2).
    assert memory['ratio'] == pytest.approx(0.5, rel=0.05)
    assert document['at_rest_mib'][s.FSDP] == pytest.approx(document['at_rest_mib'][s.ANCHOR])
    assert time['target'] == s.TIME_TARGET and time['ratio'] > 0 and 'target' not in ddp
    # Every way trains the same steps from the same parameters.
    assert document['max_loss_difference'] < 1e-5


CHECKS: Dict[str, Callable[[Dict[str, Any]], None]] = {
    'overhead': check_overhead, 'transparency': check_transparency,
    'unet_memory': check_unet_memory, 'unet_speed': check_speed,
    'amoebanet_speed': check_speed, 'solver_speed': check_solver_speed,
    'unet_example': check_unet_example, 'schedules': check_schedules,
    'bubbles': check_bubbles, 'distributed': check_distributed, 'sharded': check_sharded,
    'plan': check_plan,
}


@pytest.mark.parametrize('name', registry.NAMES)
def test_cpu_preset_smoke(name: str, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    experiment = registry.load(name)
    threads = torch.get_num_threads()
    returned = runner.main(experiment, ['--smoke', '--output-dir', str(tmp_path)])
    assert torch.get_num_threads() == threads, 'the benchmark left its thread setting behind'

    # A smoke run never takes the place of a real run's results.
    assert not (tmp_path / f'{name}-cpu.json').exists()
    document: Dict[str, Any] = json.loads((tmp_path / f'{name}-cpu-smoke.json').read_text())
    assert document == json.loads(json.dumps(returned, default=str))
    assert document['experiment'] == name
    assert document['preset'] == 'cpu' and document['smoke'] is True
    assert isinstance(document['settings'], dict)
    assert document['results'] and document['headline']
    assert all(f['within'] is None for f in document['headline'])
    env = document['environment']
    assert env['torch'] == torch.__version__ and env['torch_threads'] == 1
    assert env['devices'] and all(d.startswith('cpu') for d in env['devices'])
    CHECKS.get(name, lambda document: None)(document)

    # capfd, not capsys: the output of processes the benchmark starts too.
    out, err = capfd.readouterr()
    assert runner.SMOKE_NOTE in out
    # As CI's benchmarks stage does: a benchmark's run prints no Python warning.
    assert not re.search(r':[0-9]+: [A-Za-z]*Warning: ', out + err), err
    if HAVE_MATPLOTLIB:
        assert (tmp_path / f'{name}-cpu-smoke.png').is_file()
        assert not (tmp_path / f'{name}-cpu.png').exists()
    else:
        assert 'plot skipped' in out


@pytest.mark.parametrize('name', registry.NAMES)
def test_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = __import__(f'benchmarks.{name}', fromlist=['main'])
    with pytest.raises(SystemExit) as exc_info:
        module.main(['--help'])
    assert exc_info.value.code == 0
    out = capsys.readouterr().out
    assert '--smoke' in out and '--output-dir' in out
    assert 'presets:' in out and 'cpu' in out


def test_run_all_summarizes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import run_all

    summary = run_all.main(['--smoke', '--only', 'transparency', '--no-plot',
                            '--output-dir', str(tmp_path)])
    assert summary['smoke'] is True
    assert [f['label'] for f in summary['figures']] == ['largest loss difference',
                                                        'largest parameter difference']
    assert json.loads((tmp_path / 'run_all-cpu-smoke.json').read_text()) == summary
    assert not (tmp_path / 'run_all-cpu.json').exists()
    with pytest.raises(SystemExit):
        run_all.main(['--only', 'nonesuch'])
    assert '--only: no experiment nonesuch' in capsys.readouterr().err


def test_run_all_help_lists_every_experiment(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks import run_all

    with pytest.raises(SystemExit):
        run_all.main(['--help'])
    out = ' '.join(capsys.readouterr().out.split())
    assert all(name in out for name in registry.NAMES)


def test_amoebanet_passes_cell_pairs_between_layers() -> None:
    model = amoebanetd(3, 8, num_classes=10)
    assert len(model) == 3 + 6
    x: Any = torch.rand(2, 3, 32, 32)
    for layer in list(model)[:-1]:
        x = layer(x)
        assert isinstance(x, tuple) and len(x) == 2
        assert all(isinstance(t, torch.Tensor) for t in x)
    assert model[-1](x).shape == (2, 10)


def test_resnet101_is_resnet101() -> None:
    with torch.device('meta'):
        model = resnet101()
    assert len(model) == 1 + 5 * 33 + 3
    assert parameter_count(model) == 44_549_160


def test_tiny_resnet_on_gpipe_matches(threaded: bool) -> None:
    from helpers import cpu_devices
    from torchgpipe import GPipe

    model = resnet((1, 1), width=4, num_classes=10, batch_norm=False, small_input=True).double()
    gpipe = GPipe(model, [4, 4, 6], devices=cpu_devices(3, threaded), chunks=2)
    x = torch.rand(4, 3, 8, 8, dtype=torch.float64)
    expected = torch.cat([model(x[:2]), model(x[2:])])
    assert torch.allclose(gpipe(x), expected, rtol=0, atol=1e-12)


@pytest.mark.parametrize('interleave', [True, False])
def test_measure_throughputs(interleave: bool) -> None:
    built: List[str] = []

    def factory(name: str) -> timing.Trainer:
        built.append(name)
        model = torch.nn.Linear(4, 1)
        return timing.Trainer(model, torch.rand(8, 4), torch.rand(8, 1),
                              torch.nn.functional.mse_loss, steps_per_epoch=2,
                              devices=[torch.device('cpu')])

    results = timing.measure_throughputs({'a': lambda: factory('a'), 'b': lambda: factory('b')},
                                         3, interleave=interleave)
    assert built == ['a', 'b']
    for result in results.values():
        assert len(result['epoch_seconds']) == 3
        assert result['samples_per_epoch'] == 16
        assert result['throughput'] >= result['throughput_mean'] > 0
        assert result['throughput_spread']['samples'] == 2
    with pytest.raises(ValueError, match='epochs must be at least 2'):
        timing.measure_throughputs({}, 1, interleave=interleave)


def test_plot_skipped_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, 'matplotlib', None)
    assert report.save_plot(tmp_path / 'x.png', lambda plt: None) is None
    assert 'plot skipped' in capsys.readouterr().out
    assert not list(tmp_path.iterdir())

"""Every benchmark's CPU preset runs in smoke mode and writes its results, so none of them rots.

The benchmarks live in ``benchmarks/`` at the repository root (not in the
wheel); each module's ``main(argv)`` is called in this process, with
``--smoke`` (a couple of steps) and ``--output-dir`` in a temporary
directory. Their figures are not checked here (timings are never asserted),
except the transparency experiment's loss difference, which must be 0 up to
float rounding.
"""
import importlib
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import common  # noqa: E402
from benchmarks.models.amoebanet import amoebanetd  # noqa: E402
from benchmarks.models.resnet import resnet, resnet101  # noqa: E402

EXPERIMENTS = ['overhead', 'transparency', 'unet_memory', 'unet_speed', 'amoebanet_speed']

try:
    import matplotlib  # noqa: F401
    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False


def run_smoke(name: str, output_dir: Path) -> Dict[str, Any]:
    module = importlib.import_module(f'benchmarks.{name}')
    threads = torch.get_num_threads()
    returned = module.main(['--preset', 'cpu', '--smoke', '--output-dir', str(output_dir)])
    assert torch.get_num_threads() == threads, 'the benchmark left its thread setting behind'
    path = output_dir / f'{name}-cpu.json'
    assert path.is_file()
    document: Dict[str, Any] = json.loads(path.read_text())
    assert document == json.loads(json.dumps(returned, default=str))
    return document


def check_common(document: Dict[str, Any], name: str, output_dir: Path,
                 capsys: pytest.CaptureFixture[str]) -> None:
    assert document['experiment'] == name
    assert document['preset'] == 'cpu'
    assert document['smoke'] is True
    assert isinstance(document['settings'], dict)
    assert document['results']
    env = document['environment']
    for key in ('torch', 'torchgpipe', 'python', 'platform', 'devices', 'git_commit',
                'torch_threads'):
        assert key in env
    assert env['torch'] == torch.__version__
    assert env['torch_threads'] == 1
    assert env['devices'] and all(d.startswith('cpu') for d in env['devices'])

    out = capsys.readouterr().out
    if HAVE_MATPLOTLIB:
        assert (output_dir / f'{name}-cpu.png').is_file()
    else:
        assert 'plot skipped' in out


@pytest.mark.parametrize('name', EXPERIMENTS)
def test_cpu_preset_smoke(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    document = run_smoke(name, tmp_path)
    check_common(document, name, tmp_path, capsys)
    results: List[Dict[str, Any]] = document['results']

    if name == 'overhead':
        assert [r['name'] for r in results] == ['wrapper', 'scheduler', 'compute-bound',
                                                'memory']
        for r in results:
            assert r['ratio'] > 0
            assert r['target'] == {'wrapper': 1.05, 'scheduler': 12.0, 'compute-bound': 1.33,
                                   'memory': 0.39}[r['name']]
            assert isinstance(r['pass'], bool)
        assert document['grid'] and all('per_task_us' in g for g in document['grid'])
        assert {m: d['step_peak'] > 0 for m, d in document['memory'].items()} == {
            'unwrapped': True, 'never': True, 'except_last': True}

    elif name == 'transparency':
        assert {r['checkpoint'] for r in results} == {'always', 'except_last', 'never'}
        assert len({(r['chunks'], r['partitions']) for r in results}) >= 3
        # float64 and the same seed: equal up to float rounding.
        assert document['max_loss_difference'] < 1e-12
        assert document['max_parameter_difference'] < 1e-12

    elif name == 'unet_memory':
        assert [r['name'] for r in results] == ['naive-1', 'pipeline-1', 'pipeline-2',
                                                'pipeline-4']
        for r in results:
            assert r['parameters'] > 0 and r['memory'] > r['parameter_bytes']
            assert sum(r['balance']) > 0 and len(r['balance']) == r['partitions']
        assert results[0]['memory_ratio'] == 1.0

    else:
        for r in results:
            assert r['throughput'] > 0 and r['speedup'] > 0
            assert len(r['epoch_seconds']) == 2
            assert len(r['balance'] or [0]) == r['partitions']
        assert results[0]['speedup'] == 1.0


def test_run_all_summarizes(tmp_path: Path) -> None:
    from benchmarks import run_all

    summary = run_all.main(['--smoke', '--only', 'transparency', '--no-plot',
                            '--output-dir', str(tmp_path)])
    assert summary['smoke'] is True
    assert [f['figure'] for f in summary['figures']] == ['largest loss difference']
    assert json.loads((tmp_path / 'run_all-cpu.json').read_text()) == summary


@pytest.mark.parametrize('name', EXPERIMENTS + ['run_all'])
def test_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    module = importlib.import_module(f'benchmarks.{name}')
    with pytest.raises(SystemExit) as exc_info:
        module.main(['--help'])
    assert exc_info.value.code == 0
    out = capsys.readouterr().out
    assert '--smoke' in out and '--output-dir' in out
    if name != 'run_all':
        assert 'presets:' in out and 'cpu' in out


def test_plot_skipped_without_matplotlib(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, 'matplotlib', None)
    assert common.save_plot(tmp_path, 'x', 'cpu', lambda plt: None) is None
    assert 'plot skipped' in capsys.readouterr().out
    assert not list(tmp_path.iterdir())


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
    assert common.parameter_count(model) == 44_549_160


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

    def factory(name: str) -> common.Trainer:
        built.append(name)
        model = torch.nn.Linear(4, 1)
        return common.Trainer(model, torch.rand(8, 4), torch.rand(8, 1),
                              torch.nn.functional.mse_loss, steps_per_epoch=2,
                              devices=[torch.device('cpu')])

    results = common.measure_throughputs({'a': lambda: factory('a'), 'b': lambda: factory('b')},
                                         3, interleave=interleave)
    assert built == ['a', 'b']
    for result in results.values():
        assert len(result['epoch_seconds']) == 3
        assert result['samples_per_epoch'] == 16
        assert result['throughput'] >= result['throughput_mean'] > 0
    with pytest.raises(ValueError):
        common.measure_throughputs({}, 1, interleave=interleave)

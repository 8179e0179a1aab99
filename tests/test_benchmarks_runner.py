"""The experiment runner: output names, verdicts, usage errors, the environment, the registry.

A toy experiment (no model, no timing) runs through
:func:`benchmarks.runner.main` as every real one does, so these tests take
milliseconds; the real experiments run in ``test_benchmarks_smoke.py``.
"""
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import environment, registry, report, runner  # noqa: E402

try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    HAVE_MATPLOTLIB = True
except ImportError:
    HAVE_MATPLOTLIB = False

needs_matplotlib = pytest.mark.skipif(not HAVE_MATPLOTLIB, reason='matplotlib is not installed')


def toy_run(config: Dict[str, Any]) -> Dict[str, Any]:
    return {'results': [{'name': r['name'], 'value': config['scale'] * r['value']}
                        for r in config['rows']]}


def toy_headline(document: Dict[str, Any]) -> List[runner.Figure]:
    return [runner.Figure(f"{r['name']} value", f"{r['value']:g}", '<= 10', r['value'] <= 10)
            for r in document['results']]


TOY = runner.Experiment(
    name='toy', doc='A toy experiment.', smoke={'scale': 100},
    presets={'cpu': runner.Preset('two rows', scale=1, epochs=3,
                                  rows=[{'name': 'a', 'value': 1}, {'name': 'b', 'value': 2}])},
    run=toy_run, headline=toy_headline,
    table=lambda document: report.format_table(
        ['row', 'value'], [[r['name'], r['value']] for r in document['results']]),
    options=[runner.Option('--epochs', 'epochs', 'epochs', minimum=2,
                           why='the first epoch is a warm-up')],
    settings=True)


def run_toy(*argv: str) -> Dict[str, Any]:
    return runner.main(TOY, ['--no-plot', *argv])


def test_smoke_run_leaves_full_results_alone(tmp_path: Path) -> None:
    full = run_toy('--output-dir', str(tmp_path))
    written = (tmp_path / 'toy-cpu.json').read_text()
    smoke = run_toy('--smoke', '--output-dir', str(tmp_path))
    assert (tmp_path / 'toy-cpu.json').read_text() == written
    assert json.loads(written)['results'] == full['results']
    assert json.loads((tmp_path / 'toy-cpu-smoke.json').read_text())['results'] == \
        smoke['results'] != full['results']


def test_smoke_run_gives_no_verdicts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_toy('--output-dir', str(tmp_path))
    out = capsys.readouterr().out
    assert 'within target' in out and re.search(r'\byes\b', out)
    assert runner.SMOKE_NOTE not in out

    document = run_toy('--smoke', '--output-dir', str(tmp_path))
    out = capsys.readouterr().out
    assert runner.SMOKE_NOTE in out
    assert 'within target' not in out
    assert not re.search(r'\b(yes|NO|PASS|FAIL)\b', out)
    assert all(f['within'] is None for f in document['headline'])


@pytest.mark.parametrize('argv, message', [
    (['--epochs', '1'], '--epochs must be at least 2, got 1 (the first epoch is a warm-up); '
                        'pass --epochs 2 or more'),
    (['--threads', '0'], '--threads must be at least 1, got 0'),
    (['--settings', 'a,z'], "--settings: no row z in preset 'cpu'; choose among a,b"),
])
def test_wrong_option_is_a_usage_error(argv: List[str], message: str, tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        run_toy('--output-dir', str(tmp_path), *argv)
    assert exc_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize('name, argv, flag', [
    ('unet_speed', ['--epochs', '1'], '--epochs'),
    ('amoebanet_speed', ['--epochs', '1'], '--epochs'),
    ('amoebanet_speed', ['--batch-size', '0'], '--batch-size'),
    ('unet_memory', ['--chunks', '0'], '--chunks'),
    ('solver_speed', ['--layers', '3', '--partitions', '5'], '--partitions'),
    ('unet_example', ['--size', '40'], '--size'),
])
def test_real_experiments_check_their_options(name: str, argv: List[str], flag: str,
                                              tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc_info:
        runner.main(registry.load(name), ['--output-dir', str(tmp_path), *argv])
    assert exc_info.value.code == 2
    err = capsys.readouterr().err
    assert f'error: {flag} must be' in err and 'pass' in err
    assert 'Traceback' not in err


def test_settings_picks_rows(tmp_path: Path) -> None:
    document = run_toy('--settings', 'b', '--output-dir', str(tmp_path))
    assert [r['name'] for r in document['results']] == ['b']


def test_measure_prints_one_setting_or_each_of_a_list(
        capsys: pytest.CaptureFixture[str]) -> None:
    # A full preset's fresh process measures one setting; a smoke run's, all of them.
    measuring = dataclasses.replace(TOY, measure=lambda s: {'twice': 2 * s['n']})

    def printed(setting: Any) -> Any:
        assert runner.main(measuring, ['--measure', json.dumps(setting)]) == {}
        return json.loads(capsys.readouterr().out.strip().splitlines()[-1])

    assert printed({'n': 1}) == {'twice': 2}
    assert printed([{'n': 1}, {'n': 3}]) == [{'twice': 2}, {'twice': 6}]


def test_environment_records_cpu_dirty_tree_and_duration(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    env = run_toy('--output-dir', str(tmp_path))['environment']
    assert env['cpu_model'] and isinstance(env['cpu_model'], str)
    assert env['duration_seconds'] >= 0
    assert 'git_dirty' in env and 'git_commit' in env

    def fake_git(status: str) -> Any:
        return lambda *command: status if command[0] == 'status' else 'abc\n'

    monkeypatch.setattr(environment, 'git', fake_git(' M benchmarks/runner.py\n'))
    assert environment.environment([], 1.0)['git_dirty'] is True
    monkeypatch.setattr(environment, 'git', fake_git(''))
    assert environment.environment([], 1.0)['git_dirty'] is False


def test_tables_head_every_column_distinctly() -> None:
    with pytest.raises(ValueError, match='header of its own'):
        report.format_table(['target', 'setting', 'target'], [[1, 2, 3]])
    with pytest.raises(ValueError, match='header of its own'):
        report.format_table(['ratio', ''], [[1, 2]])


def test_registry_holds_every_experiment_module() -> None:
    declared = set()
    for path in (ROOT / 'benchmarks').glob('*.py'):
        if re.search(r'^EXPERIMENT = Experiment\(', path.read_text(), re.MULTILINE):
            declared.add(path.stem)
    assert declared == set(registry.NAMES)
    for name in registry.NAMES:
        assert registry.load(name).name == name
    with pytest.raises(KeyError, match='the experiments are'):
        registry.load('nonesuch')


def test_docs_list_every_experiment() -> None:
    docs = (ROOT / 'docs' / 'benchmarks.rst').read_text()
    for name in registry.NAMES:
        assert f'python -m benchmarks.{name}' in docs


def test_no_process_words_in_user_facing_text() -> None:
    paths = list((ROOT / 'benchmarks').rglob('*.py')) + [ROOT / 'docs' / 'benchmarks.rst']
    for path in paths:
        for word in ('SPEC', 'issue', 'session'):
            assert word not in path.read_text(), f'{word!r} in {path.relative_to(ROOT)}'


def overhead_document() -> Dict[str, Any]:
    timed = {'gpipe_ms': {'min': 1.0, 'median': 1.1, 'max': 1.3},
             'unwrapped_ms': {'min': 1.0, 'median': 1.0, 'max': 1.2}}
    rows = [dict(timed, name=name, setting='s', measured='GPipe', against='unwrapped',
                 ratio=1.0, ratio_median=1.1, target=2.0, within_target=True)
            for name in ('wrapper', 'scheduler', 'compute-bound')]
    rows[1].update(floor_ms={'min': 0.5, 'median': 0.6, 'max': 0.7}, floor_ratio=0.5,
                   gpipe_over_floor=2.0, target=12.0)
    rows.append({'name': 'memory', 'setting': 's', 'measured': "'except_last'",
                 'against': "'never'", 'measured_mib': 1.0, 'against_mib': 4.0,
                 'unwrapped_mib': 4.0, 'method': 'm', 'ratio': 0.25, 'target': 0.39,
                 'within_target': True})
    grid = [{'chunks': 8, 'partitions': 2, 'checkpoint': checkpoint, 'step_ms': timed['gpipe_ms'],
             'ratio': 2.0, 'loop_ms': 0.8, 'loop_ratio': 1.6, 'per_task_us': 50.0}
            for checkpoint in ('never', 'except_last')]
    return {'smoke': False, 'results': rows, 'threaded': rows[:1], 'grid': grid}


@needs_matplotlib
def test_overhead_plot_labels_each_ratio() -> None:
    from benchmarks import overhead

    plt.figure()
    try:
        overhead.plot(overhead_document(), plt)
        panels = plt.gcf().axes[:4]
        labels = [' '.join(t.get_text().split()) for ax in panels
                  for t in ax.get_xticklabels()]
        titles = [' '.join(ax.get_title().split()) for ax in panels]
    finally:
        plt.close('all')
    assert labels[0] == 'GPipe / unwrapped' and titles[0] == 'wrapper 1.00x'
    assert labels[3] == 'except_last / never' and titles[3] == 'memory 0.25x'


@needs_matplotlib
def test_overhead_plot_is_linear_in_microseconds_with_labels_off_the_targets() -> None:
    """Bars on linear axes from 0 (a log scale makes a ratio's bar length
    meaningless), "µs", and nothing covering a target line: the ratio panels
    label target and floor beside their marks, with no legend, and the legend
    of the per-task chart lies inside that chart."""
    from benchmarks import overhead

    plt.figure()
    try:
        overhead.plot(overhead_document(), plt)
        fig = plt.gcf()
        fig.tight_layout()
        fig.canvas.draw()
        renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
        *panels, right = fig.axes
        assert len(panels) == 4
        for ax, row in zip(panels, overhead_document()['results']):
            assert ax.get_yscale() == 'linear' and ax.get_xscale() == 'linear'
            assert ax.get_ylim()[0] == 0
            assert ax.get_legend() is None
            target, = [line for line in ax.get_lines() if line.get_linestyle() == '--']
            assert list(target.get_ydata()) == [row['target']] * 2
            y = ax.transData.transform((0, row['target']))[1]
            for text in ax.texts:
                box = text.get_window_extent(renderer)
                assert not box.y0 < y < box.y1, text.get_text()  # beside the line, not on it
        assert right.get_yscale() == 'linear' and right.get_ylim()[0] == 0
        assert 'µs' in right.get_ylabel() and 'us ' not in right.get_ylabel()
        legend = right.get_legend()
        assert legend is not None
        assert right.bbox.contains(*legend.get_window_extent(renderer).p0)
    finally:
        plt.close('all')
    assert 'per task (µs)' in overhead.table(overhead_document())


def test_overhead_table_heads_ratios_and_targets() -> None:
    from benchmarks import overhead

    text = overhead.table(overhead_document())
    assert 'within target' in text
    assert "'except_last' / 'never'" in text
    assert 'floor / unwrapped' in text and 'GPipe / floor' in text
    assert 'within target' not in overhead.table(dict(overhead_document(), smoke=True))


@needs_matplotlib
def test_transparency_plot_marks_zero_differences() -> None:
    from benchmarks import transparency

    results = [{'chunks': 1, 'partitions': 2, 'checkpoint': 'never',
                'max_loss_difference': 0.0, 'max_parameter_difference': 0.0},
               {'chunks': 4, 'partitions': 2, 'checkpoint': 'never',
                'max_loss_difference': 5e-15, 'max_parameter_difference': 3e-15}]
    plt.figure()
    try:
        transparency.plot({'losses': [2.0, 1.0], 'results': results}, plt)
        right = plt.gcf().axes[1]
        notes = [t.get_text() for t in right.texts]
        low, high = right.get_xlim()
        ticks = [t for t in right.get_xticks() if low <= t <= high]
    finally:
        plt.close('all')
    assert sum(note.startswith('0') for note in notes) == 2
    assert len(ticks) <= 6


def test_device_memory_row_without_growth_is_not_a_division_by_zero(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A smoke run's steps are so small that no rank's resident set may grow.
    from benchmarks import bubbles, distributed
    monkeypatch.setattr(distributed, 'spawn_ranks',
                        lambda *args: [{'1f1b': 0, 'zb_h1': 4096}] * 4)
    row = bubbles.device_memory_row({})
    assert row['ratio'] != row['ratio'] and not row['within_target']
    assert 'nanx' in bubbles.device_memory_text(row)

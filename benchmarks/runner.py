"""One experiment runner: the command line, the run, and what it writes, for every experiment.

An experiment module measures one thing and declares it as an
:class:`Experiment`: its presets, its smoke settings, its own options, a
``run(config)`` that measures, a ``table(document)`` and a
``plot(document, pyplot)`` that show the results, and the ``headline``
figures quoted in the summary of :mod:`benchmarks.run_all`. :func:`main`
does the rest the same way for all of them::

    python -m benchmarks.<experiment> [--preset NAME] [--smoke] [--settings A,B]
                                      [--output-dir DIR] [--no-plot] [--threads N] ...

1. parse and check the options (a wrong value is a usage error naming the
   option and the fix, never a traceback from the middle of a run);
2. build the configuration: the preset, then the smoke settings with
   ``--smoke``, then the experiment's own options;
3. run it with ``--threads`` intra-op threads (default 1), and record the
   environment (:func:`benchmarks.environment.environment`) with the run's
   duration;
4. print the table and the headline figures, with their verdicts against
   their targets, except in a smoke run, whose figures mean nothing;
5. write ``<output-dir>/<experiment>-<preset>.json`` and the plot ``.png``
   beside it (and ``<experiment>-<preset>-<name>.png`` for more plots), or
   ``<experiment>-<preset>-smoke*`` for a smoke run
   (:func:`benchmarks.report.output_path`).

Adding an experiment is a module declaring its :class:`Experiment` and one
entry in :mod:`benchmarks.registry`.
"""
import argparse
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from benchmarks import RESULTS_DIR
from benchmarks.environment import environment, threads
from benchmarks.memory import tune_malloc
from benchmarks.report import format_table, output_path, save_plot, write_json

__all__ = ['Preset', 'Option', 'Figure', 'Experiment', 'make_parser', 'configure', 'main',
           'figures_table', 'SMOKE_NOTE']

#: What a smoke run prints instead of verdicts.
SMOKE_NOTE = 'smoke run: figures are not meaningful (a couple of steps on tiny inputs)'


class Preset(dict):  # type: ignore[type-arg]
    """A named preset: a dict of settings with a one-line ``description``."""

    def __init__(self, description: str, **settings: Any) -> None:
        super().__init__(**settings)
        self.description = description


@dataclass(frozen=True)
class Option:
    """An option of one experiment, setting ``config[key]`` when it is given.

    Args:
        flag: the option, e.g. ``'--epochs'``
        key: the configuration entry it sets
        help: what it sets, for ``--help``
        type: converts the text given
        minimum: the smallest value allowed, if any
        why: why the minimum, said in the usage error
        choices: the values allowed, if only some are
    """

    flag: str
    key: str
    help: str
    type: Callable[[str], Any] = int
    minimum: Optional[int] = None
    why: str = ''
    choices: Optional[Sequence[str]] = None


@dataclass(frozen=True)
class Figure:
    """A headline figure: what it is, its value as text, and its target if it has one.

    ``within`` is whether the value meets the ``target`` (None without one).
    """

    label: str
    value: str
    target: str = ''
    within: Optional[bool] = None


@dataclass(frozen=True)
class Experiment:
    """What a benchmark measures and how to show it; :func:`main` runs it.

    Args:
        name: the module's name in ``benchmarks/``: ``python -m benchmarks.<name>``
        doc: the module's docstring; its first line describes it in ``--help``
        presets: named configurations; ``cpu`` is the default
        smoke: what ``--smoke`` changes in the preset, so that a run takes seconds
        run: measures with a configuration, returns the results (a JSON-able dict)
        table: the text table of a result document (which has ``smoke`` and
            ``settings``, the configuration)
        headline: the figures the summary of all experiments quotes
        plot: draws a result document with ``plot(document, pyplot)``
        more_plots: further figures, by name: ``<experiment>-<preset>-<name>.png``
        options: the experiment's own options
        settings: whether ``--settings`` picks some of the preset's ``rows`` by name
        check: returns a usage error for a configuration its options cannot
            make alone (two options in conflict), or None
        measure: measures one setting in a fresh process (``--measure <json>``,
            internal; see :func:`benchmarks.memory.run_measure_subprocesses`)
        tune_malloc: whether timings on CPU want :func:`benchmarks.memory.tune_malloc`
    """

    name: str
    doc: Optional[str]
    presets: Mapping[str, Preset]
    smoke: Mapping[str, Any]
    run: Callable[[Dict[str, Any]], Dict[str, Any]]
    table: Callable[[Dict[str, Any]], str]
    headline: Callable[[Dict[str, Any]], List[Figure]]
    plot: Optional[Callable[[Dict[str, Any], Any], None]] = None
    more_plots: Mapping[str, Callable[[Dict[str, Any], Any], None]] = field(default_factory=dict)
    options: Sequence[Option] = field(default_factory=tuple)
    settings: bool = False
    check: Optional[Callable[[Dict[str, Any]], Optional[str]]] = None
    measure: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None
    tune_malloc: bool = False

    @property
    def description(self) -> str:
        lines = (self.doc or '').strip().splitlines()
        return lines[0] if lines else self.name


def make_parser(experiment: Experiment) -> argparse.ArgumentParser:
    """The options of every experiment and its own; the epilog lists the presets."""
    presets = experiment.presets
    epilog = ('presets:\n' + '\n'.join(f'  {name:<12} {preset.description}'
                                       for name, preset in presets.items())
              + f'\n\noutput: <output-dir>/{experiment.name}-<preset>.json and .png '
              f'({experiment.name}-<preset>-smoke.* with --smoke)')
    parser = argparse.ArgumentParser(
        prog=f'python -m benchmarks.{experiment.name}', description=experiment.description,
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--preset', default='cpu', choices=list(presets),
                        help='named settings to run (default: cpu)')
    parser.add_argument('--smoke', action='store_true',
                        help='a couple of steps on tiny inputs, to check that the experiment '
                        'runs; its figures mean nothing, and its output is named *-smoke.*')
    if experiment.settings:
        parser.add_argument('--settings', help='comma-separated rows of the preset to run '
                            '(default: all of them)')
    for option in experiment.options:
        parser.add_argument(option.flag, dest=option.key, type=option.type, choices=option.choices,
                            help=option.help + ' (default: from the preset)')
    parser.add_argument('--output-dir', type=Path, default=RESULTS_DIR,
                        help='where the JSON and the plot go (default: benchmarks/results)')
    parser.add_argument('--no-plot', action='store_true', help='do not draw the plot')
    parser.add_argument('--threads', type=int, default=1,
                        help='intra-op threads, torch.set_num_threads (default: 1)')
    if experiment.measure is not None:
        parser.add_argument('--measure', help=argparse.SUPPRESS)
    return parser


def configure(experiment: Experiment, parser: argparse.ArgumentParser,
              args: argparse.Namespace) -> Dict[str, Any]:
    """The configuration the options ask for; a wrong option exits with a usage error."""
    if args.threads < 1:
        parser.error(f'--threads must be at least 1, got {args.threads}; '
                     'pass --threads 1 or more')
    config = dict(experiment.presets[args.preset])
    if args.smoke:
        config.update(experiment.smoke)
    for option in experiment.options:
        value = getattr(args, option.key)
        if value is None:
            continue
        if option.minimum is not None and value < option.minimum:
            parser.error(f'{option.flag} must be at least {option.minimum}, got {value}'
                         f'{" (" + option.why + ")" if option.why else ""}; '
                         f'pass {option.flag} {option.minimum} or more')
        config[option.key] = value
    if getattr(args, 'settings', None):
        names = [r['name'] for r in config['rows']]
        wanted = args.settings.split(',')
        unknown = [w for w in wanted if w not in names]
        if unknown:
            parser.error(f'--settings: no row {", ".join(unknown)} in preset {args.preset!r}; '
                         f'choose among {",".join(names)}')
        config['rows'] = [r for r in config['rows'] if r['name'] in wanted]
    error = experiment.check(config) if experiment.check else None
    if error:
        parser.error(error)
    return config


def figures_table(figures: Sequence[Tuple[str, Figure]], smoke: bool) -> str:
    """The headline figures of some experiments, with verdicts unless ``smoke``."""
    headers = ['experiment', 'figure', 'value', 'target']
    rows: List[List[str]] = [[name, f.label, f.value, f.target or '-'] for name, f in figures]
    if smoke:
        return format_table(headers, rows) + '\n' + SMOKE_NOTE
    verdicts = ['-' if f.within is None else ('yes' if f.within else 'NO') for _, f in figures]
    return format_table(headers + ['within target'],
                        [row + [v] for row, v in zip(rows, verdicts)])


def main(experiment: Experiment, argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    """Runs one experiment as its command line says; returns the document it wrote.

    With ``--measure`` (internal), measures one setting (or each of a list)
    and prints its JSON instead, returning an empty dict.
    """
    parser = make_parser(experiment)
    args = parser.parse_args(argv)
    if getattr(args, 'measure', None):
        assert experiment.measure is not None
        settings = json.loads(args.measure)
        with threads(args.threads):
            # A list: the settings of a smoke run, measured one after the other
            # (see benchmarks.memory.run_measure_subprocesses).
            measured = ([experiment.measure(s) for s in settings] if isinstance(settings, list)
                        else experiment.measure(settings))
        print(json.dumps(measured))
        return {}
    config = configure(experiment, parser, args)

    # Process-wide, so not in smoke runs, which run inside the test suite.
    if experiment.tune_malloc and config.get('device', 'cpu') == 'cpu' and not args.smoke:
        tune_malloc()
    start = time.perf_counter()
    with threads(args.threads):
        outcome = experiment.run(config)
        env = environment(outcome.get('devices', ['cpu']), time.perf_counter() - start)

    document: Dict[str, Any] = {'experiment': experiment.name, 'preset': args.preset,
                                'smoke': args.smoke, 'settings': config, 'environment': env,
                                **outcome}
    figures = experiment.headline(document)
    if args.smoke:
        # A smoke run's figures mean nothing, so they meet or miss no target.
        figures = [replace(f, within=None) for f in figures]
    document['headline'] = [vars(f) for f in figures]
    print(experiment.table(document))
    print()
    print(figures_table([(experiment.name, f) for f in figures], args.smoke))
    write_json(output_path(args.output_dir, experiment.name, args.preset, args.smoke, '.json'),
               document)
    plots = dict(experiment.more_plots)
    if experiment.plot is not None:
        plots[''] = experiment.plot
    for name, draw in ([] if args.no_plot else sorted(plots.items())):
        suffix = f'-{name}.png' if name else '.png'
        save_plot(output_path(args.output_dir, experiment.name, args.preset, args.smoke, suffix),
                  lambda plt, draw=draw: draw(document, plt))
    return document

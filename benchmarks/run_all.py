"""Runs every experiment's CPU preset, or all of them in smoke mode (what CI does).

Run from the repository root::

    python -m benchmarks.run_all            # the full CPU presets, a few minutes
    python -m benchmarks.run_all --smoke    # a couple of steps each (also: python -m benchmarks)

The experiments are those of :mod:`benchmarks.registry`, in its order. Each
writes its own JSON and plot; this command then prints the headline figures
of all of them, with their verdicts against their targets (none in a smoke
run), and writes them to ``run_all-cpu.json`` (``run_all-cpu-smoke.json``).
"""
import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from benchmarks import RESULTS_DIR, registry, runner
from benchmarks.report import output_path, write_json


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.run_all',
                                     description=(__doc__ or '').strip().splitlines()[0])
    parser.add_argument('--smoke', action='store_true',
                        help='a couple of steps each, to check that they run; output named '
                        '*-smoke.*')
    parser.add_argument('--output-dir', type=Path, default=RESULTS_DIR,
                        help='where the JSON files and plots go (default: benchmarks/results)')
    parser.add_argument('--no-plot', action='store_true', help='do not draw the plots')
    parser.add_argument('--only', help='comma-separated experiments to run (default: all of '
                        + ', '.join(registry.NAMES) + ')')
    args = parser.parse_args(argv)

    names = args.only.split(',') if args.only else list(registry.NAMES)
    unknown = [n for n in names if n not in registry.NAMES]
    if unknown:
        parser.error(f'--only: no experiment {", ".join(unknown)}; choose among '
                     + ','.join(registry.NAMES))

    figures: List[Tuple[str, runner.Figure]] = []
    seconds: Dict[str, float] = {}
    environment: Dict[str, Any] = {}
    for name in names:
        print(f'=== {name} ===', flush=True)
        experiment = registry.load(name)
        options = ['--preset', 'cpu', '--output-dir', str(args.output_dir)]
        options += ['--smoke'] * args.smoke + ['--no-plot'] * args.no_plot
        start = time.perf_counter()
        document = runner.main(experiment, options)
        seconds[name] = time.perf_counter() - start
        environment = environment or document['environment']
        figures += [(name, runner.Figure(**f)) for f in document['headline']]
        print(flush=True)

    print('=== summary (CPU presets' + (', smoke' if args.smoke else '') + ') ===')
    print(runner.figures_table(figures, args.smoke))
    print('seconds: ' + ', '.join(f'{k} {v:.0f}' for k, v in seconds.items()))
    summary = {'smoke': args.smoke, 'seconds': seconds,
               'figures': [dict(vars(f), experiment=name) for name, f in figures],
               'environment': environment}
    write_json(output_path(args.output_dir, 'run_all', 'cpu', args.smoke, '.json'), summary)
    return summary


if __name__ == '__main__':
    main(sys.argv[1:])

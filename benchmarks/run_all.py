"""Runs every experiment's CPU preset, or all of them in smoke mode (what CI does).

Run from the repository root::

    python -m benchmarks.run_all            # the full CPU presets, a few minutes
    python -m benchmarks.run_all --smoke    # a couple of steps each (also: python -m benchmarks)

Each experiment writes its own JSON and plot; this command then prints the
headline figures of all of them and writes them to ``run_all-cpu.json``.
"""
import argparse
import importlib
import json
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from benchmarks.common import RESULTS_DIR, format_table

#: The experiments, in the order they run.
EXPERIMENTS = ['overhead', 'transparency', 'unet_memory', 'unet_speed', 'amoebanet_speed']


def headline(documents: Dict[str, Dict[str, Any]]) -> List[List[str]]:
    """The figures quoted in the docs, as (experiment, figure, value) rows."""
    rows: List[List[str]] = []
    overhead = documents.get('overhead')
    if overhead:
        for r in overhead['results']:
            verdict = 'PASS' if r['pass'] else 'FAIL'
            rows.append(['overhead', f"{r['name']} ratio (target <= {r['target']}x)",
                         f"{r['ratio']:.3f}x {verdict}"])
    transparency = documents.get('transparency')
    if transparency:
        rows.append(['transparency', 'largest loss difference',
                     f"{transparency['max_loss_difference']:.3g}"])
    memory = documents.get('unet_memory')
    if memory:
        for r in memory['results']:
            if r['memory_ratio'] is not None:
                rows.append(['unet_memory', f"{r['name']} memory vs naive-1",
                             f"{r['memory_ratio']:.2f}x"])
    for name in ('unet_speed', 'amoebanet_speed'):
        speed = documents.get(name)
        if speed:
            for r in speed['results']:
                if r['speedup'] is not None:
                    rows.append([name, f"{r['name']} speed-up", f"{r['speedup']:.2f}x"])
    return rows


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = argparse.ArgumentParser(prog='python -m benchmarks.run_all',
                                     description=(__doc__ or '').strip().splitlines()[0])
    parser.add_argument('--smoke', action='store_true', help='a couple of steps each (CI)')
    parser.add_argument('--output-dir', type=Path, default=RESULTS_DIR,
                        help='where the JSON files and plots go (default: benchmarks/results)')
    parser.add_argument('--no-plot', action='store_true', help='do not draw the plots')
    parser.add_argument('--only', help='comma-separated experiments to run (default: all of '
                        + ', '.join(EXPERIMENTS) + ')')
    args = parser.parse_args(argv)

    names = args.only.split(',') if args.only else EXPERIMENTS
    unknown = set(names) - set(EXPERIMENTS)
    if unknown:
        parser.error(f'unknown experiments: {", ".join(sorted(unknown))}')

    documents: Dict[str, Dict[str, Any]] = {}
    seconds: Dict[str, float] = {}
    for name in names:
        print(f'=== {name} ===', flush=True)
        module = importlib.import_module(f'benchmarks.{name}')
        options = ['--preset', 'cpu', '--output-dir', str(args.output_dir)]
        options += ['--smoke'] * args.smoke + ['--no-plot'] * args.no_plot
        start = time.perf_counter()
        documents[name] = module.main(options)
        seconds[name] = time.perf_counter() - start
        print(flush=True)

    rows = headline(documents)
    print('=== summary (CPU presets' + (', smoke' if args.smoke else '') + ') ===')
    print(format_table(['experiment', 'figure', 'value'], rows))
    print('seconds: ' + ', '.join(f'{k} {v:.0f}' for k, v in seconds.items()))
    summary = {'smoke': args.smoke, 'seconds': seconds,
               'figures': [dict(zip(['experiment', 'figure', 'value'], r)) for r in rows],
               'environment': next(iter(documents.values()))['environment'] if documents else {}}
    path = Path(args.output_dir) / 'run_all-cpu.json'
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + '\n')
    print(f'summary: {path}')
    return summary


if __name__ == '__main__':
    main(sys.argv[1:])

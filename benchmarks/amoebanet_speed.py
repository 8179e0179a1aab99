"""AmoebaNet-D speed: throughput with m micro-batches on n partitions (Table 2).

Run from the repository root::

    python -m benchmarks.amoebanet_speed --preset cpu     # CPU devices, about a minute
    python -m benchmarks.amoebanet_speed --preset paper   # Table 2, needs 8 CUDA devices
    python -m benchmarks.amoebanet_speed --preset paper --settings m1-n2,m4-n2,m32-n2

Every pair (m, n) trains AmoebaNet-D(L, D) (``benchmarks/models/amoebanet.py``)
with GPipe on n partitions (the balance from
``torchgpipe.balance.balance_by_time``) and m micro-batches, with plain SGD
for some epochs of a synthetic dataset (one random batch fed again and again,
so no data loading is timed). With m = 1 every micro-batch is checkpointed
(``checkpoint='always'``), as in the paper, for a fair comparison with
GPipe's numbers; otherwise the default ``'except_last'``. The throughput in
samples/s leaves the first epoch out and is that of the fastest remaining
epoch (the mean is in the JSON); the speed-up is against (m, n) = (1, 2) of
the same run. On CPU the settings take turns epoch by epoch, so that a busy
spell of the machine slows them alike; on CUDA they run one after the other.

The paper does not list its batch sizes ("chosen to maximize the
throughput"); the ``paper`` preset's are this project's choice, override
them with ``--batch-size``. On CPU, the n partitions go to the CPU devices
``cpu:0..n-1``, a worker thread each with one intra-op thread.
"""
import functools
import math
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from benchmarks.common import (Preset, Trainer, auto_balance, cpu_devices, cuda_devices,
                               environment, finish, format_table, make_parser, measure_throughputs,
                               parameter_count, threads, tune_malloc)
from benchmarks.models.amoebanet import amoebanetd
from torchgpipe import GPipe

EXPERIMENT = 'amoebanet_speed'


def grid(ms: Sequence[int], ns: Sequence[int], batch: Dict[int, int]) -> List[Dict[str, Any]]:
    return [{'name': f'm{m}-n{n}', 'chunks': m, 'partitions': n, 'batch': batch[m],
             'checkpoint': 'always' if m == 1 else 'except_last'}
            for m in ms for n in ns]


PRESETS: Dict[str, Preset] = {
    'paper': Preset('Table 2: AmoebaNet-D(18, 256), 3x224x224, 10 epochs of 10,000 samples, '
                    'm in 1/4/32, n in 2/4/8 CUDA devices',
                    device='cuda', num_layers=18, num_filters=256, image_size=224,
                    num_classes=1000, samples=10000, epochs=10, balance_timeout=1.0,
                    rows=grid([1, 4, 32], [2, 4, 8], {1: 32, 4: 64, 32: 256})),
    'cpu': Preset('AmoebaNet-D(6, 64), 3x128x128, batch 32, 4 epochs of 32 samples, '
                  'm in 1/4/8, n in 2/4 CPU devices (~1 min)',
                  device='cpu', num_layers=6, num_filters=64, image_size=128, num_classes=10,
                  samples=32, epochs=4, balance_timeout=0.5,
                  rows=grid([1, 4, 8], [2, 4], {1: 32, 4: 32, 8: 32})),
}

SMOKE = dict(epochs=2, samples=1, balance_timeout=0.0, num_filters=16, image_size=64,
             batch=8)

#: Table 2 of the paper: speed-ups against (m, n) = (1, 2) of GPipe (Cloud TPUv3)
#: and of torchgpipe (NVIDIA Tesla P40), by (m, n).
PAPER_GPIPE = {(1, 2): 1.0, (1, 4): 1.13, (1, 8): 1.38, (4, 2): 1.07, (4, 4): 1.26,
               (4, 8): 1.72, (32, 2): 1.21, (32, 4): 1.84, (32, 8): 3.48}
PAPER_TORCHGPIPE = {(1, 2): 1.0, (1, 4): 1.00, (1, 8): 0.93, (4, 2): 1.54, (4, 4): 1.67,
                    (4, 8): 2.62, (32, 2): 1.77, (32, 4): 2.71, (32, 8): 4.95}


def build(config: Dict[str, Any], setting: Dict[str, Any], info: Dict[str, Any]) -> Trainer:
    """The trainer of one setting; fills ``info`` with its devices, balance and size."""
    torch.manual_seed(0)
    partitions, chunks, batch = setting['partitions'], setting['chunks'], setting['batch']
    devices = (cuda_devices(partitions) if config['device'] == 'cuda'
               else cpu_devices(partitions))
    size = config['image_size']
    model = amoebanetd(config['num_layers'], config['num_filters'],
                       num_classes=config['num_classes'])
    input = torch.rand(batch, 3, size, size)
    target = torch.randint(config['num_classes'], (batch,))

    micro_batch = input[:max(1, batch // chunks)]
    balance, method = auto_balance(model, partitions, micro_batch, devices[0],
                                   config['balance_timeout'])
    gpipe = GPipe(model, balance, devices=devices, chunks=chunks,
                  checkpoint=setting['checkpoint'])
    info.update(setting, devices=[str(d) for d in devices], parameters=parameter_count(model),
                balance=balance, balance_method=method)
    return Trainer(gpipe, input.to(devices[0]), target.to(devices[-1]), F.cross_entropy,
                   steps_per_epoch=math.ceil(config['samples'] / batch), devices=devices)


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    if config['device'] == 'cuda':
        cuda_devices(max(r['partitions'] for r in config['rows']))  # fails early if missing
    infos: Dict[str, Dict[str, Any]] = {r['name']: {} for r in config['rows']}
    factories = {r['name']: functools.partial(build, config, r, infos[r['name']])
                 for r in config['rows']}
    measured = measure_throughputs(factories, config['epochs'],
                                   interleave=config['device'] == 'cpu')
    results = [dict(infos[name], **measured[name]) for name in factories]
    baseline = next((r for r in results if (r['chunks'], r['partitions']) == (1, 2)), None)
    for r in results:
        key = (r['chunks'], r['partitions'])
        r['speedup'] = r['throughput'] / baseline['throughput'] if baseline else None
        r['paper_speedup'] = PAPER_TORCHGPIPE.get(key)
        r['paper_gpipe_speedup'] = PAPER_GPIPE.get(key)
    return {'results': results}


def grid_table(results: List[Dict[str, Any]], cell: Callable[[Dict[str, Any]], str]) -> str:
    ms = sorted({r['chunks'] for r in results})
    ns = sorted({r['partitions'] for r in results})
    by_key = {(r['chunks'], r['partitions']): r for r in results}
    rows = [[f'm = {m}'] + [cell(by_key[m, n]) if (m, n) in by_key else '' for n in ns]
            for m in ms]
    return format_table(['AmoebaNet-D'] + [f'n = {n}' for n in ns], rows)


def report(config: Dict[str, Any], outcome: Dict[str, Any]) -> None:
    results = outcome['results']
    print(f"AmoebaNet-D({config['num_layers']}, {config['num_filters']}), 3x"
          f"{config['image_size']}x{config['image_size']}, {config['device'].upper()}; "
          f"speed-up against (m, n) = (1, 2) (throughput of the fastest epoch after the "
          f"first of {config['epochs']})")
    print(grid_table(results, lambda r: (f"{r['speedup']:.2f} ({r['throughput']:.1f}/s)"
                                         if r['speedup'] is not None
                                         else f"{r['throughput']:.1f}/s")))
    print('\npaper (Table 2), torchgpipe on NVIDIA Tesla P40 (GPipe on Cloud TPUv3 in '
          'brackets):')
    paper = [{'chunks': m, 'partitions': n, 'ours': PAPER_TORCHGPIPE[m, n],
              'gpipe': PAPER_GPIPE[m, n]} for m, n in PAPER_TORCHGPIPE]
    print(grid_table(paper, lambda r: f"{r['ours']:.2f} ({r['gpipe']:.2f})"))
    print('\nbalance per setting: ' + ', '.join(f"{r['name']} {r['balance']}" for r in results))


def plot(config: Dict[str, Any], outcome: Dict[str, Any]) -> Callable[[Any], None]:
    def draw(plt: Any) -> None:
        results = outcome['results']
        for m in sorted({r['chunks'] for r in results}):
            points = sorted((r['partitions'], r['throughput']) for r in results
                            if r['chunks'] == m)
            plt.plot([p for p, _ in points], [t for _, t in points], marker='o', label=f'm = {m}')
        plt.xscale('log', base=2)
        plt.xticks(sorted({r['partitions'] for r in results}),
                   [str(n) for n in sorted({r['partitions'] for r in results})])
        plt.xlabel('partitions n')
        plt.ylabel('throughput (samples/s)')
        plt.title(f"AmoebaNet-D({config['num_layers']}, {config['num_filters']}) speed, "
                  f"{config['device'].upper()} devices")
        plt.legend()

    return draw


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = make_parser(EXPERIMENT, __doc__, PRESETS)
    parser.add_argument('--settings', help='comma-separated (m, n) pairs of the preset to run '
                        '(default: all), e.g. m1-n2,m4-n2')
    parser.add_argument('--epochs', type=int, help='epochs per setting, at least 2')
    parser.add_argument('--batch-size', type=int, help='the batch size of every setting')
    args = parser.parse_args(argv)

    config = dict(PRESETS[args.preset])
    if args.smoke:
        config.update(SMOKE)
    if args.epochs is not None:
        config['epochs'] = args.epochs
    rows = [dict(r) for r in config['rows']]
    if args.settings:
        wanted = args.settings.split(',')
        unknown = set(wanted) - {r['name'] for r in rows}
        if unknown:
            parser.error(f'unknown settings: {", ".join(sorted(unknown))}')
        rows = [r for r in rows if r['name'] in wanted]
    batch = args.batch_size or (config.pop('batch') if args.smoke else None)
    if batch is not None:
        for r in rows:
            r['batch'] = batch
    config['rows'] = rows

    if config['device'] == 'cpu' and not args.smoke:
        tune_malloc()  # process-wide, so not in smoke runs (which run inside the test suite)
    with threads(args.threads):
        outcome = run(config)
        devices = max((r['devices'] for r in outcome['results']), key=len)
        env = environment(devices)

    report(config, outcome)
    return finish(args, EXPERIMENT, config, outcome, env, plot(config, outcome))


if __name__ == '__main__':
    main(sys.argv[1:])

"""AmoebaNet-D speed: throughput with m micro-batches on n partitions (Table 2).

Run from the repository root::

    python -m benchmarks.amoebanet_speed                  # CPU devices, about a minute
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
epoch (the range over those epochs is in the table, their median and mean
in the JSON); the speed-up is against (m, n) = (1, 2) of
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

from benchmarks.balance import auto_balance
from benchmarks.devices import cpu_devices, cuda_devices
from benchmarks.memory import parameter_count
from benchmarks.models.amoebanet import amoebanetd
from benchmarks.report import format_table
from benchmarks.runner import Experiment, Figure, Option, Preset, main as run_main
from benchmarks.speed import EPOCHS, format_throughput, throughput_whiskers
from benchmarks.timing import Trainer, measure_settings
from torchgpipe import GPipe


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

#: Smoke: two settings of the grid, the baseline (m = 1, every micro-batch
#: checkpointed) and one of 'except_last' on 4 partitions, on 32x32 images.
SMOKE = dict(epochs=2, samples=1, balance_timeout=0.0, num_filters=16, image_size=32,
             batch=8, rows=grid([1], [2], {1: 8}) + grid([4], [4], {4: 8}))

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
    batch = config.get('batch')
    rows = [dict(r, batch=batch or r['batch']) for r in config['rows']]
    results = measure_settings(rows, functools.partial(build, config), config['epochs'],
                               config['device'])
    baseline = next((r for r in results if (r['chunks'], r['partitions']) == (1, 2)), None)
    for r in results:
        key = (r['chunks'], r['partitions'])
        r['speedup'] = r['throughput'] / baseline['throughput'] if baseline else None
        r['paper_speedup'] = PAPER_TORCHGPIPE.get(key)
        r['paper_gpipe_speedup'] = PAPER_GPIPE.get(key)
    return {'results': results, 'devices': max((r['devices'] for r in results), key=len)}


def grid_table(results: List[Dict[str, Any]], cell: Callable[[Dict[str, Any]], str]) -> str:
    ms = sorted({r['chunks'] for r in results})
    ns = sorted({r['partitions'] for r in results})
    by_key = {(r['chunks'], r['partitions']): r for r in results}
    rows = [[f'm = {m}'] + [cell(by_key[m, n]) if (m, n) in by_key else '' for n in ns]
            for m in ms]
    return format_table(['AmoebaNet-D'] + [f'n = {n}' for n in ns], rows)


def table(document: Dict[str, Any]) -> str:
    config, results = document['settings'], document['results']
    paper = [{'chunks': m, 'partitions': n, 'ours': PAPER_TORCHGPIPE[m, n],
              'gpipe': PAPER_GPIPE[m, n]} for m, n in PAPER_TORCHGPIPE]
    return '\n'.join([
        f"AmoebaNet-D({config['num_layers']}, {config['num_filters']}), 3x"
        f"{config['image_size']}x{config['image_size']}, {config['device'].upper()}; "
        f"speed-up against (m, n) = (1, 2) of the fastest epochs ({config['epochs']} epochs, "
        'the first not counted)',
        grid_table(results, lambda r: (f"{r['speedup']:.2f}" if r['speedup'] is not None
                                       else '-')),
        '', 'throughput per setting:',
        format_table(['setting', 'batch', 'balance', 'throughput (fastest epoch)',
                      'throughput range (epochs)'],
                     [[r['name'], r['batch'], r['balance'], *format_throughput(r)]
                      for r in results]),
        '', 'paper (Table 2), speed-up of torchgpipe on NVIDIA Tesla P40 (of GPipe on Cloud '
        'TPUv3 in brackets):',
        grid_table(paper, lambda r: f"{r['ours']:.2f} ({r['gpipe']:.2f})")])


def headline(document: Dict[str, Any]) -> List[Figure]:
    return [Figure(f"{r['name']}: speed-up against m1-n2", f"{r['speedup']:.2f}x")
            for r in document['results'] if r['speedup'] is not None]


def plot(document: Dict[str, Any], plt: Any) -> None:
    config, results = document['settings'], document['results']
    partitions = sorted({r['partitions'] for r in results})
    for m in sorted({r['chunks'] for r in results}):
        points = sorted((r for r in results if r['chunks'] == m), key=lambda r: r['partitions'])
        plt.errorbar([r['partitions'] for r in points], [r['throughput'] for r in points],
                     yerr=throughput_whiskers(points), marker='o', capsize=4, label=f'm = {m}')
    plt.xscale('log', base=2)
    plt.xticks(partitions, [str(n) for n in partitions])
    plt.xlabel('partitions n')
    plt.ylabel('throughput (samples/s): fastest epoch,\nwhisker to the slowest')
    plt.title(f"AmoebaNet-D({config['num_layers']}, {config['num_filters']}) speed, "
              f"{config['device'].upper()} devices")
    plt.legend()


EXPERIMENT = Experiment(
    name='amoebanet_speed', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run, table=table,
    headline=headline, plot=plot, settings=True, tune_malloc=True,
    options=[EPOCHS, Option('--batch-size', 'batch', 'the batch size of every setting',
                            minimum=1)])


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

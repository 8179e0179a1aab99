"""U-Net speed: throughput of U-Net(B, C) without and with GPipe on 1-8 devices (Table 4).

Run from the repository root::

    python -m benchmarks.unet_speed                   # CPU devices, about a minute
    python -m benchmarks.unet_speed --preset paper    # Table 4, needs 8 CUDA devices
    python -m benchmarks.unet_speed --preset paper --settings naive-1,pipeline-2

Naive-1 trains the plain model on one device, without pipeline parallelism
or checkpointing; Pipeline-n trains it with GPipe on n partitions (the
balance from ``torchgpipe.balance.balance_by_time``). Each setting trains
with plain SGD for some epochs of a synthetic dataset (one random batch fed
again and again, so no data loading is timed); the throughput in samples/s
leaves the first epoch out and is that of the fastest remaining epoch; the
table also shows the range over those epochs (their median and mean are in
the JSON). The speed-up is against Naive-1 of the same run. On
CPU the settings take turns epoch by epoch, so that a busy spell of the
machine slows them alike; on CUDA they run one after the other.

On CPU, the n partitions go to the CPU devices ``cpu:0..n-1``, a worker
thread each with one intra-op thread, so a pipeline can overlap its stages
on as many cores as the machine has; Naive-1 uses one core.
"""
import functools
import math
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from benchmarks.balance import auto_balance
from benchmarks.devices import cpu_devices, cuda_devices
from benchmarks.memory import parameter_count
from benchmarks.models.unet import unet
from benchmarks.report import format_table
from benchmarks.runner import Experiment, Figure, Preset, main as run_main
from benchmarks.speed import EPOCHS, format_throughput, plot_throughputs
from benchmarks.timing import Trainer, measure_settings
from torchgpipe import GPipe


def row(name: str, batch: int, chunks: Optional[int], partitions: int) -> Dict[str, Any]:
    return {'name': name, 'batch': batch, 'chunks': chunks, 'partitions': partitions}


PRESETS: Dict[str, Preset] = {
    'paper': Preset('Table 4: U-Net(5, 64), 3x192x192, 10 epochs of 10,000 samples, '
                    '1-8 CUDA devices',
                    device='cuda', num_convs=5, channels=64, image_size=192, samples=10000,
                    epochs=10, balance_timeout=1.0,
                    rows=[row('naive-1', 40, None, 1), row('pipeline-1', 80, 2, 1),
                          row('pipeline-2', 512, 32, 2), row('pipeline-4', 512, 16, 4),
                          row('pipeline-8', 640, 40, 8)]),
    'cpu': Preset('U-Net(1, 16), 3x128x128, batch 24, 4 epochs of 48 samples, '
                  '1-4 CPU devices (~1 min)',
                  device='cpu', num_convs=1, channels=16, image_size=128, samples=48, epochs=4,
                  balance_timeout=0.5,
                  rows=[row('naive-1', 24, None, 1), row('pipeline-1', 24, 2, 1),
                        row('pipeline-2', 24, 4, 2), row('pipeline-4', 24, 4, 4)]),
}

SMOKE = dict(epochs=2, samples=1, balance_timeout=0.0, image_size=32, batch=8)

#: Table 4 of the paper (NVIDIA Tesla P40): throughput (samples/s) and speed-up.
PAPER = {'naive-1': (28.500, 1.0), 'pipeline-1': (24.456, 0.858), 'pipeline-2': (35.502, 1.246),
         'pipeline-4': (67.042, 2.352), 'pipeline-8': (88.497, 3.105)}


def build(config: Dict[str, Any], setting: Dict[str, Any], info: Dict[str, Any]) -> Trainer:
    """The trainer of one setting; fills ``info`` with its devices, balance and size."""
    torch.manual_seed(0)
    partitions = setting['partitions']
    devices = (cuda_devices(partitions) if config['device'] == 'cuda'
               else cpu_devices(partitions))
    size, batch = config['image_size'], setting['batch']
    model = unet(depth=5, num_convs=config['num_convs'], base_channels=config['channels'])
    input = torch.rand(batch, 3, size, size)
    target = (torch.rand(batch, 1, size, size) > 0.5).float()

    info.update(setting, devices=[str(d) for d in devices], parameters=parameter_count(model))
    if setting['chunks'] is None:
        runner: torch.nn.Module = model.to(devices[0])
        info.update(balance=None, balance_method=None)
    else:
        micro_batch = input[:max(1, batch // setting['chunks'])]
        balance, method = auto_balance(model, partitions, micro_batch, devices[0],
                                       config['balance_timeout'])
        runner = GPipe(model, balance, devices=devices, chunks=setting['chunks'])
        info.update(balance=balance, balance_method=method)

    return Trainer(runner, input.to(devices[0]), target.to(devices[-1]),
                   F.binary_cross_entropy_with_logits,
                   steps_per_epoch=math.ceil(config['samples'] / batch), devices=devices)


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    if config['device'] == 'cuda':
        cuda_devices(max(r['partitions'] for r in config['rows']))  # fails early if missing
    batch = config.get('batch')
    rows = [dict(r, batch=batch or r['batch']) for r in config['rows']]
    results = measure_settings(rows, functools.partial(build, config), config['epochs'],
                               config['device'])
    baseline = next((r for r in results if r['name'] == 'naive-1'), None)
    for r in results:
        r['speedup'] = r['throughput'] / baseline['throughput'] if baseline else None
        r['paper_speedup'] = PAPER[r['name']][1] if r['name'] in PAPER else None
    return {'results': results, 'devices': max((r['devices'] for r in results), key=len)}


def table(document: Dict[str, Any]) -> str:
    config = document['settings']
    rows = []
    for r in document['results']:
        rows.append([r['name'], r['batch'], r['chunks'] or 'x', r['balance'] or '-',
                     *format_throughput(r),
                     f"{r['speedup']:.3f}" if r['speedup'] is not None else '-',
                     r['paper_speedup'] if r['paper_speedup'] is not None else '-'])
    return '\n'.join([
        f"U-Net({config['num_convs']}, {config['channels']}), 3x{config['image_size']}x"
        f"{config['image_size']}, {config['device'].upper()}; {config['epochs']} epochs, the "
        'first not counted',
        format_table(['U-Net', 'batch', 'micro-batches', 'balance', 'throughput (fastest epoch)',
                      'throughput range (epochs)', 'speed-up (fastest)', 'paper speed-up (P40)'],
                     rows)])


def headline(document: Dict[str, Any]) -> List[Figure]:
    return [Figure(f"{r['name']}: speed-up against naive-1", f"{r['speedup']:.2f}x")
            for r in document['results'] if r['speedup'] is not None]


def plot(document: Dict[str, Any], plt: Any) -> None:
    config = document['settings']
    plot_throughputs(plt, document['results'], [r['name'] for r in document['results']])
    plt.title(f"U-Net({config['num_convs']}, {config['channels']}) speed, "
              f"{config['device'].upper()} devices")


EXPERIMENT = Experiment(name='unet_speed', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run,
                        table=table, headline=headline, plot=plot, settings=True,
                        options=[EPOCHS], tune_malloc=True)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

"""U-Net speed: throughput of U-Net(B, C) without and with GPipe on 1-8 devices (Table 4).

Run from the repository root::

    python -m benchmarks.unet_speed --preset cpu      # CPU devices, about a minute
    python -m benchmarks.unet_speed --preset paper    # Table 4, needs 8 CUDA devices
    python -m benchmarks.unet_speed --preset paper --settings naive-1,pipeline-2

Naive-1 trains the plain model on one device, without pipeline parallelism
or checkpointing; Pipeline-n trains it with GPipe on n partitions (the
balance from ``torchgpipe.balance.balance_by_time``). Each setting trains
with plain SGD for some epochs of a synthetic dataset (one random batch fed
again and again, so no data loading is timed); the throughput in samples/s
leaves the first epoch out and is that of the fastest remaining epoch (the
mean is in the JSON). The speed-up is against Naive-1 of the same run. On
CPU the settings take turns epoch by epoch, so that a busy spell of the
machine slows them alike; on CUDA they run one after the other.

On CPU, the n partitions go to the CPU devices ``cpu:0..n-1``, a worker
thread each with one intra-op thread, so a pipeline can overlap its stages
on as many cores as the machine has; Naive-1 uses one core.
"""
import functools
import math
import sys
from typing import Any, Callable, Dict, Optional, Sequence

import torch
import torch.nn.functional as F

from benchmarks.common import (Preset, Trainer, auto_balance, cpu_devices, cuda_devices,
                               environment, finish, format_table, make_parser, measure_throughputs,
                               parameter_count, threads, tune_malloc)
from benchmarks.models.unet import unet
from torchgpipe import GPipe

EXPERIMENT = 'unet_speed'


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
    infos: Dict[str, Dict[str, Any]] = {r['name']: {} for r in config['rows']}
    factories = {r['name']: functools.partial(build, config, r, infos[r['name']])
                 for r in config['rows']}
    measured = measure_throughputs(factories, config['epochs'],
                                   interleave=config['device'] == 'cpu')
    results = [dict(infos[name], **measured[name]) for name in factories]
    baseline = next((r for r in results if r['name'] == 'naive-1'), None)
    for r in results:
        r['speedup'] = r['throughput'] / baseline['throughput'] if baseline else None
        r['paper_speedup'] = PAPER[r['name']][1] if r['name'] in PAPER else None
    return {'results': results}


def report(config: Dict[str, Any], outcome: Dict[str, Any]) -> None:
    print(f"U-Net({config['num_convs']}, {config['channels']}), 3x{config['image_size']}x"
          f"{config['image_size']}, {config['device'].upper()}; throughput of the fastest "
          f"epoch after the first of {config['epochs']}")
    rows = []
    for r in outcome['results']:
        rows.append([r['name'], r['batch'], r['chunks'] or 'x', r['balance'] or '-',
                     f"{r['throughput']:.3f}/s",
                     f"{r['speedup']:.3f}" if r['speedup'] is not None else '-',
                     r['paper_speedup'] if r['paper_speedup'] is not None else '-'])
    print(format_table(['U-Net', 'batch', 'm', 'balance', 'throughput', 'speed-up',
                        'paper (P40)'], rows))


def plot(config: Dict[str, Any], outcome: Dict[str, Any]) -> Callable[[Any], None]:
    def draw(plt: Any) -> None:
        results = outcome['results']
        names = [r['name'] for r in results]
        bars = plt.bar(names, [r['throughput'] for r in results], color='tab:blue')
        for bar, r in zip(bars, results):
            if r['speedup'] is not None:
                plt.annotate(f"{r['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                                      bar.get_height()),
                             ha='center', va='bottom')
        plt.ylabel('throughput (samples/s)')
        plt.title(f"U-Net({config['num_convs']}, {config['channels']}) speed, "
                  f"{config['device'].upper()} devices")

    return draw


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = make_parser(EXPERIMENT, __doc__, PRESETS)
    parser.add_argument('--settings', help='comma-separated rows of the preset to run '
                        '(default: all), e.g. naive-1,pipeline-2')
    parser.add_argument('--epochs', type=int, help='epochs per setting, at least 2')
    args = parser.parse_args(argv)

    config = dict(PRESETS[args.preset])
    if args.smoke:
        config.update(SMOKE)
    if args.epochs is not None:
        config['epochs'] = args.epochs
    if args.settings:
        wanted = args.settings.split(',')
        unknown = set(wanted) - {r['name'] for r in config['rows']}
        if unknown:
            parser.error(f'unknown settings: {", ".join(sorted(unknown))}')
        config['rows'] = [r for r in config['rows'] if r['name'] in wanted]
    if args.smoke:
        batch = config.pop('batch')
        config['rows'] = [dict(r, batch=batch) for r in config['rows']]

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

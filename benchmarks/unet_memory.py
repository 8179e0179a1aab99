"""U-Net memory: peak memory and parameters of U-Net(B, C) trained with and without GPipe (Table 3).

Run from the repository root::

    python -m benchmarks.unet_memory --preset cpu      # CPU, about half a minute
    python -m benchmarks.unet_memory --preset paper    # Table 3, needs 8 CUDA devices
    python -m benchmarks.unet_memory --preset paper --settings naive-1,pipeline-1

Every setting runs in a fresh process: the model is built on the ``meta``
device, balanced by an estimate of each layer's memory (twice its parameters
plus its output for one micro-batch; see ``benchmarks.common.size_balance``),
and each layer is then allocated straight on its partition's device, so
models larger than one device (or than the host) can be measured. After a
warm-up step with a tiny batch, one training step (forward, loss, backward,
plain SGD) is measured:

- on CUDA, the allocator's peak of allocated bytes on every device
  (``torch.cuda.max_memory_allocated``); the memory usage is their sum, which
  includes parameters, gradients, activations and the batch, as in the paper;
- on CPU, where all partitions share the host's memory, the memory usage is
  the parameters' bytes plus the peak increase of the process's resident set
  during the step (gradients, activations, temporaries), with freed tensors
  returned to the system at once (see ``benchmarks.common``).

Naive-1 is the plain model on one device; Pipeline-n is GPipe with n
partitions and the default checkpointing ('except_last'). The paper does not
state its number of micro-batches for this table; ``--chunks`` sets it.
"""
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from benchmarks.common import (GiB, MiB, Preset, cpu_devices, cuda_devices, environment, finish,
                               fix_malloc, format_table, make_parser, materialize, parameter_count,
                               run_measure_subprocesses, size_balance, step_peak_memory, threads)
from benchmarks.models.unet import unet
from torchgpipe import GPipe

EXPERIMENT = 'unet_memory'


def row(name: str, num_convs: int, channels: int, partitions: int,
        chunks: Optional[int]) -> Dict[str, Any]:
    return {'name': name, 'num_convs': num_convs, 'channels': channels,
            'partitions': partitions, 'chunks': chunks}


PRESETS: Dict[str, Preset] = {
    'paper': Preset('Table 3: the largest U-Net(B, C) on 1, 2, 4, 8 CUDA devices, 3x192x192, '
                    'batch 32, 8 micro-batches',
                    device='cuda', image_size=192, batch=32,
                    rows=[row('naive-1', 6, 72, 1, None), row('pipeline-1', 11, 128, 1, 8),
                          row('pipeline-2', 24, 128, 2, 8), row('pipeline-4', 24, 160, 4, 8),
                          row('pipeline-8', 48, 160, 8, 8)]),
    'cpu': Preset('U-Net(2, 8) without and with GPipe on 1, 2, 4 CPU devices, 3x128x128, '
                  'batch 32, 8 micro-batches (~30 s)',
                  device='cpu', image_size=128, batch=32,
                  rows=[row('naive-1', 2, 8, 1, None), row('pipeline-1', 2, 8, 1, 8),
                        row('pipeline-2', 2, 8, 2, 8), row('pipeline-4', 2, 8, 4, 8)]),
}

SMOKE = dict(image_size=32, batch=8)

#: Table 3 of the paper (NVIDIA Tesla P40): parameters and memory usage.
PAPER = {'naive-1': ('362.2M', '20.3 GiB'), 'pipeline-1': ('2.21B', '20.5 GiB'),
         'pipeline-2': ('4.99B', '43.4 GiB'), 'pipeline-4': ('7.80B', '79.1 GiB'),
         'pipeline-8': ('15.82B', '154.1 GiB')}


def measure(setting: Dict[str, Any]) -> Dict[str, Any]:
    """In a fresh process: the peak memory of one training step of one setting."""
    fix_malloc()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    partitions, chunks = setting['partitions'], setting['chunks']
    batch, size = setting['batch'], setting['image_size']
    devices = (cuda_devices(partitions) if setting['device'] == 'cuda'
               else cpu_devices(partitions))

    with torch.device('meta'):
        model = unet(depth=5, num_convs=setting['num_convs'],
                     base_channels=setting['channels'])
        sample = torch.empty(max(1, batch // (chunks or 1)), 3, size, size)
    parameters = parameter_count(model)
    balance, method = size_balance(model, partitions, sample)
    materialize(model, balance, devices)
    runner: torch.nn.Module = model
    if chunks is not None:
        runner = GPipe(model, balance, devices=devices, chunks=chunks)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)

    def make_step(n: int) -> Callable[[], None]:
        input = torch.rand(n, 3, size, size, device=devices[0])
        target = (torch.rand(n, 1, size, size, device=devices[-1]) > 0.5).float()

        def step() -> None:
            loss = F.binary_cross_entropy_with_logits(runner(input), target)
            loss.backward()
            optimizer.step()

        return step

    make_step(min(batch, chunks or 1))()
    optimizer.zero_grad(set_to_none=True)
    step = make_step(batch)
    memory = step_peak_memory(step, devices)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    total = memory['peak'] if setting['device'] == 'cuda' else param_bytes + memory['step_peak']
    return dict(setting, parameters=parameters, parameter_bytes=param_bytes, balance=balance,
                balance_method=method, devices=[str(d) for d in devices],
                memory=total, per_device=memory['per_device'], method=memory['method'])


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    if config['device'] == 'cuda':
        cuda_devices(max(r['partitions'] for r in config['rows']))  # fails early if missing
    settings = [dict(r, device=config['device'], batch=config['batch'],
                     image_size=config['image_size']) for r in config['rows']]
    # CPU settings each measure their own process, so two may overlap; on
    # CUDA they would share the devices.
    parallel = 2 if config['device'] == 'cpu' else 1
    results = run_measure_subprocesses(f'benchmarks.{EXPERIMENT}', settings, parallel=parallel)
    baseline = next((r for r in results if r['name'] == 'naive-1'), None)
    for r in results:
        r['memory_ratio'] = r['memory'] / baseline['memory'] if baseline else None
    return {'results': results}


def human(n: float, unit: str = 'B') -> str:
    if unit == 'B':
        return f'{n / GiB:.2f} GiB' if n >= GiB else f'{n / MiB:.1f} MiB'
    for scale, suffix in ((1e9, 'B'), (1e6, 'M'), (1e3, 'K')):
        if n >= scale:
            return f'{n / scale:.2f}{suffix}'
    return str(n)


def report(config: Dict[str, Any], outcome: Dict[str, Any]) -> None:
    results = outcome['results']
    print(f"U-Net(B, C), 3x{config['image_size']}x{config['image_size']}, batch "
          f"{config['batch']}, {config['device'].upper()} ({results[0]['method']})")
    rows = []
    for r in results:
        per_device = ', '.join(human(v) for v in r['per_device'].values())
        paper = PAPER.get(r['name'], ('-', '-')) if config['device'] == 'cuda' else ('-', '-')
        rows.append([r['name'], f"({r['num_convs']}, {r['channels']})", r['chunks'] or 'x',
                     human(r['parameters'], ''), human(r['memory']),
                     f"{r['memory_ratio']:.2f}" if r['memory_ratio'] is not None else '-',
                     per_device, r['balance']] + list(paper))
    print(format_table(['U-Net', '(B, C)', 'm', 'parameters', 'memory usage', 'vs naive',
                        'per device', 'balance', 'paper params', 'paper memory'], rows))
    if config['device'] != 'cuda':
        print('paper (Table 3, P40): ' + ', '.join(f'{k} {p} params {m}'
                                                   for k, (p, m) in PAPER.items()))


def plot(config: Dict[str, Any], outcome: Dict[str, Any]) -> Callable[[Any], None]:
    def draw(plt: Any) -> None:
        results = outcome['results']
        names = [r['name'] for r in results]
        scale, unit = (GiB, 'GiB') if config['device'] == 'cuda' else (MiB, 'MiB')
        bottoms = [0.0] * len(results)
        width = max(len(r['per_device']) for r in results)
        for d in range(width):
            values = [list(r['per_device'].values())[d] / scale if d < len(r['per_device'])
                      else 0.0 for r in results]
            if config['device'] != 'cuda':
                values = [r['memory'] / scale for r in results]
            plt.bar(names, values, bottom=bottoms,
                    label=f'device {d}' if config['device'] == 'cuda' else None)
            bottoms = [b + v for b, v in zip(bottoms, values)]
        for name, r, top in zip(names, results, bottoms):
            plt.annotate(f"({r['num_convs']}, {r['channels']})\n"
                         f"{human(r['parameters'], '')} params", (name, top),
                         ha='center', va='bottom', fontsize='small')
        plt.ylabel(f'memory usage ({unit})')
        plt.ylim(top=max(bottoms) * 1.25)
        plt.title(f"U-Net memory, {config['device'].upper()}")
        if config['device'] == 'cuda':
            plt.legend(fontsize='small')

    return draw


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = make_parser(EXPERIMENT, __doc__, PRESETS)
    parser.add_argument('--settings', help='comma-separated rows of the preset to run '
                        '(default: all), e.g. naive-1,pipeline-2')
    parser.add_argument('--chunks', type=int, help='micro-batches of every pipeline setting')
    parser.add_argument('--measure', help='(internal) measure one setting, print JSON')
    args = parser.parse_args(argv)
    if args.measure:
        with threads(args.threads):
            print(json.dumps(measure(json.loads(args.measure))))
        return {}

    config = dict(PRESETS[args.preset])
    if args.smoke:
        config.update(SMOKE)
    rows: List[Dict[str, Any]] = [dict(r) for r in config['rows']]
    if args.settings:
        wanted = args.settings.split(',')
        unknown = set(wanted) - {r['name'] for r in rows}
        if unknown:
            parser.error(f'unknown settings: {", ".join(sorted(unknown))}')
        rows = [r for r in rows if r['name'] in wanted]
    if args.chunks is not None:
        rows = [dict(r, chunks=args.chunks if r['chunks'] else None) for r in rows]
    config['rows'] = rows

    with threads(args.threads):
        outcome = run(config)
        devices = max((r['devices'] for r in outcome['results']), key=len)
        env = environment(devices)

    report(config, outcome)
    return finish(args, EXPERIMENT, config, outcome, env, plot(config, outcome))


if __name__ == '__main__':
    main(sys.argv[1:])

"""U-Net memory: peak memory and parameters of U-Net(B, C) trained with and without GPipe (Table 3).

Run from the repository root::

    python -m benchmarks.unet_memory                   # CPU, about half a minute
    python -m benchmarks.unet_memory --preset paper    # Table 3, needs 8 CUDA devices
    python -m benchmarks.unet_memory --preset paper --settings naive-1,pipeline-1

Every setting runs in a fresh process (a smoke run's settings share one):
the model is built on the ``meta`` device, balanced by an estimate of each
layer's memory (twice its parameters plus its output for one micro-batch;
see ``benchmarks.balance.size_balance``), and each layer is then allocated
straight on its partition's device, so models larger than one device (or
than the host) can be measured. After a
warm-up step with a tiny batch, one training step (forward, loss, backward,
plain SGD) is measured:

- on CUDA, the allocator's peak of allocated bytes on every device
  (``torch.cuda.max_memory_allocated``); the memory usage is their sum, which
  includes parameters, gradients, activations and the batch, as in the paper;
- on CPU, where all partitions share the host's memory, the memory usage is
  the parameters' bytes plus the peak increase of the process's resident set
  during the step (gradients, activations, temporaries), with freed tensors
  returned to the system at once (see ``benchmarks.memory``).

Naive-1 is the plain model on one device; Pipeline-n is GPipe with n
partitions and the default checkpointing ('except_last'). The paper does not
state its number of micro-batches for this table; ``--chunks`` sets it.
"""
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F

from benchmarks.balance import materialize, size_balance
from benchmarks.devices import cpu_devices, cuda_devices
from benchmarks.memory import (GiB, MiB, fix_malloc, parameter_count, run_measure_subprocesses,
                               step_peak_memory)
from benchmarks.models.unet import unet
from benchmarks.report import format_table
from benchmarks.runner import Experiment, Figure, Option, Preset, main as run_main
from torchgpipe import GPipe


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

#: Smoke: 2 micro-batches of 2, every setting measured in one fresh process
#: (see benchmarks.memory.run_measure_subprocesses).
SMOKE = dict(image_size=32, batch=4, chunks=2, one_process=True)

#: Table 3 of the paper (NVIDIA Tesla P40): parameters and memory usage.
PAPER = {'naive-1': ('362.2M', '20.3 GiB'), 'pipeline-1': ('2.21B', '20.5 GiB'),
         'pipeline-2': ('4.99B', '43.4 GiB'), 'pipeline-4': ('7.80B', '79.1 GiB'),
         'pipeline-8': ('15.82B', '154.1 GiB')}


def measure(setting: Dict[str, Any]) -> Dict[str, Any]:
    """In a fresh process: the peak memory of one training step of one setting."""
    fix_malloc()
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
    # --chunks sets the micro-batches of every pipeline row (Naive-1 has none).
    chunks = config.get('chunks')
    settings = [dict(r, device=config['device'], batch=config['batch'],
                     image_size=config['image_size'],
                     chunks=chunks if chunks and r['chunks'] else r['chunks'])
                for r in config['rows']]
    # CPU settings each measure their own process, so two may overlap; on
    # CUDA they would share the devices.
    parallel = 2 if config['device'] == 'cpu' else 1
    results = run_measure_subprocesses('benchmarks.unet_memory', settings, parallel=parallel,
                                       one_process=config.get('one_process', False))
    baseline = next((r for r in results if r['name'] == 'naive-1'), None)
    for r in results:
        r['memory_ratio'] = r['memory'] / baseline['memory'] if baseline else None
    return {'results': results, 'devices': max((r['devices'] for r in results), key=len)}


def human(n: float, unit: str = 'B') -> str:
    if unit == 'B':
        return f'{n / GiB:.2f} GiB' if n >= GiB else f'{n / MiB:.1f} MiB'
    for scale, suffix in ((1e9, 'B'), (1e6, 'M'), (1e3, 'K')):
        if n >= scale:
            return f'{n / scale:.2f}{suffix}'
    return str(n)


def table(document: Dict[str, Any]) -> str:
    config, results = document['settings'], document['results']
    rows = []
    for r in results:
        per_device = ', '.join(human(v) for v in r['per_device'].values())
        paper = PAPER.get(r['name'], ('-', '-')) if config['device'] == 'cuda' else ('-', '-')
        rows.append([r['name'], f"({r['num_convs']}, {r['channels']})", r['chunks'] or 'x',
                     human(r['parameters'], ''), human(r['memory']),
                     f"{r['memory_ratio']:.2f}" if r['memory_ratio'] is not None else '-',
                     per_device, r['balance']] + list(paper))
    lines = [f"U-Net(B, C), 3x{config['image_size']}x{config['image_size']}, batch "
             f"{config['batch']}, {config['device'].upper()} ({results[0]['method']})",
             format_table(['U-Net', '(B, C)', 'micro-batches', 'parameters', 'memory usage',
                           'memory / naive-1', 'per device', 'balance', 'paper params',
                           'paper memory'], rows)]
    if config['device'] != 'cuda':
        lines.append('paper (Table 3, P40): ' + ', '.join(f'{k} {p} params {m}'
                                                          for k, (p, m) in PAPER.items()))
    return '\n'.join(lines)


def headline(document: Dict[str, Any]) -> List[Figure]:
    return [Figure(f"{r['name']}: memory / naive-1", f"{r['memory_ratio']:.2f}x")
            for r in document['results'] if r['memory_ratio'] is not None]


def plot(document: Dict[str, Any], plt: Any) -> None:
    config, results = document['settings'], document['results']
    names = [r['name'] for r in results]
    cuda = config['device'] == 'cuda'
    scale, unit = (GiB, 'GiB') if cuda else (MiB, 'MiB')
    bottoms = [0.0] * len(results)
    if cuda:
        for d in range(max(len(r['per_device']) for r in results)):
            values = [list(r['per_device'].values())[d] / scale if d < len(r['per_device'])
                      else 0.0 for r in results]
            plt.bar(names, values, bottom=bottoms, label=f'device {d}')
            bottoms = [b + v for b, v in zip(bottoms, values)]
        plt.legend(fontsize='small')
    else:
        bottoms = [r['memory'] / scale for r in results]
        plt.bar(names, bottoms)
    for name, r, top in zip(names, results, bottoms):
        plt.annotate(f"({r['num_convs']}, {r['channels']})\n"
                     f"{human(r['parameters'], '')} params", (name, top),
                     ha='center', va='bottom', fontsize='small')
    plt.ylabel(f'memory usage ({unit})')
    plt.ylim(top=max(bottoms) * 1.25)
    plt.title(f"U-Net memory, {config['device'].upper()}")


EXPERIMENT = Experiment(
    name='unet_memory', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run, table=table,
    headline=headline, plot=plot, settings=True, measure=measure,
    options=[Option('--chunks', 'chunks', 'micro-batches of every pipeline row', minimum=1)])


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

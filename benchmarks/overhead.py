"""Overhead: GPipe's step time and memory against the unwrapped model, the SPEC's CPU targets.

Run from the repository root::

    python -m benchmarks.overhead --preset cpu

Every row is a ratio of fastest steps (forward, MSE loss, backward) measured
side by side in one run, GPipe against the unwrapped ``nn.Sequential`` on the
full batch, with one intra-op thread:

- wrapper: 32 x (Linear(64, 64) + ReLU), batch 256, chunks=1, one partition,
  checkpoint='never' -- the pure cost of the wrapper (target <= 1.05x);
- scheduler: the same 64 modules, batch 256, chunks 32, 4 partitions of 16,
  'except_last' -- every micro-batch is a separate set of tiny kernels, so
  the floor is far above 1x; what is left is Python work per task
  (target <= 12x);
- compute-bound: 8 x (Conv2d(32, 32, 3, padding=1) + ReLU) on 32x32 images,
  batch 64, chunks 8, 4 partitions, 'except_last' -- the recomputation costs
  about one extra forward (target <= 1.33x);
- memory: the MLP with batch 32768, chunks 8, 4 partitions: the peak memory
  of one step with 'except_last' against 'never', each in a fresh process
  (target <= 0.39x).

The targets are measured with all partitions on one CPU device (``'cpu'``
four times: the tasks run in the calling thread, which isolates the
scheduler's own cost). The same settings on distinct CPU devices
(``cpu:0..3``, a worker thread each, sharing this machine's cores) are
reported beside them for information. Then, for chunks 8/16/32 with 2 and 4
partitions, the scheduler's cost per micro-batch per partition:
``(GPipe step - micro-batch loop step) / (chunks * partitions)``, where the
loop runs the unwrapped model on the same micro-batches one after the other
and backpropagates once through their concatenation (the same kernels, no
pipeline; with 'except_last' the loop also runs the extra forward pass of
checkpointing), so only the scheduling is left.
"""
import json
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.common import (MiB, Preset, cpu_devices, environment, fastest_steps, finish,
                               fix_malloc, format_table, make_parser, run_measure_subprocesses,
                               step_peak_memory, threads, tune_malloc)
from torchgpipe import GPipe

EXPERIMENT = 'overhead'

PRESETS: Dict[str, Preset] = {
    'cpu': Preset('the SPEC\'s CPU performance targets, then the scheduler grid (~1 min)',
                  wrapper_rounds=400, scheduler_rounds=40, compute_rounds=12, grid_rounds=20,
                  conv_batch=64, memory_batch=32768, grid_chunks=[8, 16, 32],
                  grid_partitions=[2, 4]),
}

SMOKE = dict(wrapper_rounds=2, scheduler_rounds=2, compute_rounds=1, grid_rounds=1,
             conv_batch=8, memory_batch=2048, grid_chunks=[8], grid_partitions=[2])

TARGETS = {'wrapper': 1.05, 'scheduler': 12.0, 'compute-bound': 1.33, 'memory': 0.39}


def mlp() -> nn.Sequential:
    """32 x (Linear(64, 64) + ReLU): 64 modules."""
    layers: List[nn.Module] = []
    for _ in range(32):
        layers += [nn.Linear(64, 64), nn.ReLU()]
    return nn.Sequential(*layers)


def convnet() -> nn.Sequential:
    """8 x (Conv2d(32, 32, 3, padding=1) + ReLU): 16 modules."""
    layers: List[nn.Module] = []
    for _ in range(8):
        layers += [nn.Conv2d(32, 32, 3, padding=1), nn.ReLU()]
    return nn.Sequential(*layers)


def make_step(model: nn.Module, input: Tensor) -> Callable[[], None]:
    """Forward, MSE loss against zeros, backward (gradients accumulate; no optimizer)."""
    target = torch.zeros_like(input)

    def step() -> None:
        output = model(input)
        F.mse_loss(output, target).backward()

    return step


def make_loop_step(model: nn.Module, input: Tensor, chunks: int,
                   recompute: bool = False) -> Callable[[], None]:
    """The unwrapped model on the micro-batches one after the other, then one loss and backward.

    The same kernels as GPipe's micro-batches without the pipeline: the floor
    the scheduler's cost is measured from. With ``recompute``, every
    micro-batch but the last also runs a forward pass without gradients
    first, as checkpointing does ('except_last' runs it once more in the
    backward pass, with gradients: the same kernels).
    """
    inputs = input.chunk(chunks)
    target = torch.zeros_like(input)

    def step() -> None:
        if recompute:
            with torch.no_grad():
                for x in inputs[:-1]:
                    model(x)
        output = torch.cat([model(x) for x in inputs])
        F.mse_loss(output, target).backward()

    return step


def gpipe(model: nn.Sequential, partitions: int, chunks: int, checkpoint: str,
          distinct: bool = False) -> GPipe:
    balance = [len(model) // partitions] * partitions
    return GPipe(model, balance, devices=cpu_devices(partitions, distinct=distinct),
                 chunks=chunks, checkpoint=checkpoint)


def ratio_row(name: str, setting: str, base: float, time: float) -> Dict[str, Any]:
    ratio = time / base
    return {'name': name, 'setting': setting, 'unwrapped_ms': base * 1e3, 'gpipe_ms': time * 1e3,
            'ratio': ratio, 'target': TARGETS[name], 'pass': ratio <= TARGETS[name]}


def measure(setting: Dict[str, Any]) -> Dict[str, Any]:
    """In a fresh process: the peak memory of one MLP step in the given mode."""
    fix_malloc()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mode, batch = setting['mode'], setting['batch']
    model: nn.Module = mlp()
    if mode != 'unwrapped':
        model = gpipe(mlp(), 4, 8, mode)
    # Warm up code paths, thread pools and gradients with a small batch, so
    # that the measured step only adds its own activations and temporaries.
    make_step(model, torch.randn(64, 64))()
    step = make_step(model, torch.randn(batch, 64))
    result = step_peak_memory(step, [torch.device('cpu')])
    result.update(mode=mode, batch=batch)
    return result


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(0)
    results: List[Dict[str, Any]] = []
    threaded: List[Dict[str, Any]] = []

    # Wrapper cost.
    x = torch.randn(256, 64)
    base = mlp()
    steps = {'unwrapped': make_step(base, x),
             'gpipe': make_step(gpipe(mlp(), 1, 1, 'never'), x)}
    t = fastest_steps(steps, config['wrapper_rounds'], desc='wrapper')
    results.append(ratio_row('wrapper', "chunks=1, 1 partition, 'never', MLP batch 256",
                             t['unwrapped'], t['gpipe']))

    # Scheduler cost.
    steps = {'unwrapped': make_step(base, x),
             'gpipe': make_step(gpipe(mlp(), 4, 32, 'except_last'), x)}
    t = fastest_steps(steps, config['scheduler_rounds'], desc='scheduler')
    scheduler_setting = "chunks=32, 4 partitions, 'except_last', MLP batch 256"
    results.append(ratio_row('scheduler', scheduler_setting, t['unwrapped'], t['gpipe']))

    # Compute-bound.
    images = torch.randn(config['conv_batch'], 32, 32, 32)
    conv = convnet()
    steps = {'unwrapped': make_step(conv, images),
             'gpipe': make_step(gpipe(convnet(), 4, 8, 'except_last'), images)}
    t = fastest_steps(steps, config['compute_rounds'], desc='compute-bound')
    compute_setting = (f"chunks=8, 4 partitions, 'except_last', 8 convs batch "
                       f"{config['conv_batch']}")
    results.append(ratio_row('compute-bound', compute_setting, t['unwrapped'], t['gpipe']))

    # Memory, each mode in a fresh process.
    batch = config['memory_batch']
    modes = ('unwrapped', 'never', 'except_last')
    measured = run_measure_subprocesses(f'benchmarks.{EXPERIMENT}',
                                        [{'mode': mode, 'batch': batch} for mode in modes],
                                        parallel=2)
    memory = dict(zip(modes, measured))
    ratio = memory['except_last']['step_peak'] / memory['never']['step_peak']
    results.append({'name': 'memory',
                    'setting': f'chunks=8, 4 partitions, MLP batch {batch}',
                    'never_mib': memory['never']['step_peak'] / MiB,
                    'except_last_mib': memory['except_last']['step_peak'] / MiB,
                    'unwrapped_mib': memory['unwrapped']['step_peak'] / MiB,
                    'method': memory['never']['method'],
                    'ratio': ratio, 'target': TARGETS['memory'],
                    'pass': ratio <= TARGETS['memory']})

    # Scheduler cost per micro-batch per partition.
    grid: List[Dict[str, Any]] = []
    steps = {'unwrapped': make_step(base, x)}
    for chunks in config['grid_chunks']:
        steps[f'loop{chunks}/never'] = make_loop_step(base, x, chunks)
        steps[f'loop{chunks}/except_last'] = make_loop_step(base, x, chunks, recompute=True)
        for partitions in config['grid_partitions']:
            for checkpoint in ('never', 'except_last'):
                model = gpipe(mlp(), partitions, chunks, checkpoint)
                steps[f'{chunks}/{partitions}/{checkpoint}'] = make_step(model, x)
    t = fastest_steps(steps, config['grid_rounds'], desc='grid')
    grid_unwrapped = t['unwrapped']
    for chunks in config['grid_chunks']:
        for partitions in config['grid_partitions']:
            for checkpoint in ('never', 'except_last'):
                time = t[f'{chunks}/{partitions}/{checkpoint}']
                loop = t[f'loop{chunks}/{checkpoint}']
                grid.append({'chunks': chunks, 'partitions': partitions,
                             'checkpoint': checkpoint, 'step_ms': time * 1e3,
                             'loop_ms': loop * 1e3, 'ratio': time / t['unwrapped'],
                             'loop_ratio': loop / t['unwrapped'],
                             'per_task_us': (time - loop) / (chunks * partitions) * 1e6})
    # The same on distinct CPU devices, last: worker threads leave the
    # allocator's arenas in a state that slows the other variants slightly.
    steps = {'unwrapped': make_step(base, x),
             'threads': make_step(gpipe(mlp(), 4, 32, 'except_last', distinct=True), x)}
    t = fastest_steps(steps, config['scheduler_rounds'] // 2 or 1, desc='scheduler, threads')
    threaded.append(ratio_row('scheduler', scheduler_setting + ', cpu:0..3', t['unwrapped'],
                              t['threads']))
    steps = {'unwrapped': make_step(conv, images),
             'threads': make_step(gpipe(convnet(), 4, 8, 'except_last', distinct=True), images)}
    t = fastest_steps(steps, config['compute_rounds'] // 2 or 1, desc='compute-bound, threads')
    threaded.append(ratio_row('compute-bound', compute_setting + ', cpu:0..3', t['unwrapped'],
                              t['threads']))

    return {'results': results, 'threaded': threaded, 'grid': grid,
            'unwrapped_ms': grid_unwrapped * 1e3, 'memory': memory}


def report(outcome: Dict[str, Any]) -> None:
    rows = []
    for r in outcome['results']:
        if r['name'] == 'memory':
            detail = f"{r['except_last_mib']:.1f} MiB / {r['never_mib']:.1f} MiB"
        else:
            detail = f"{r['gpipe_ms']:.3f} ms / {r['unwrapped_ms']:.3f} ms"
        rows.append([r['name'], r['setting'], detail, f"{r['ratio']:.3f}x",
                     f"<= {r['target']}x", 'PASS' if r['pass'] else 'FAIL'])
    print(format_table(['target', 'setting', 'measured', 'ratio', 'target', ''], rows))
    print()
    print('the same on distinct CPU devices (a worker thread each; information only):')
    print(format_table(['target', 'setting', 'ratio'],
                       [[r['name'], r['setting'], f"{r['ratio']:.3f}x"]
                        for r in outcome['threaded']]))
    print()
    print(f"scheduler cost per micro-batch per partition (MLP batch 256, one CPU device; "
          f"unwrapped full batch {outcome['unwrapped_ms']:.3f} ms):")
    print(format_table(
        ['chunks', 'partitions', 'checkpoint', 'step', 'ratio', 'loop', 'loop ratio',
         'per task'],
        [[g['chunks'], g['partitions'], g['checkpoint'], f"{g['step_ms']:.2f} ms",
          f"{g['ratio']:.2f}x", f"{g['loop_ms']:.2f} ms", f"{g['loop_ratio']:.2f}x",
          f"{g['per_task_us']:.0f} us"]
         for g in outcome['grid']]))
    print('loop: the unwrapped model on the same micro-batches one after the other (with '
          "'except_last', plus a forward pass\nwithout gradients of all but the last, as "
          'checkpointing adds); per task: (step - loop) / (chunks * partitions)')


def plot(outcome: Dict[str, Any]) -> Callable[[Any], None]:
    def draw(plt: Any) -> None:
        fig = plt.gcf()
        fig.set_size_inches(10, 4.2)
        left = fig.add_subplot(1, 2, 1)
        rows = outcome['results']
        names = [r['name'] for r in rows]
        left.bar(names, [r['ratio'] for r in rows],
                 color=['tab:green' if r['pass'] else 'tab:red' for r in rows])
        left.scatter(names, [r['target'] for r in rows], marker='_', s=800, color='black',
                     label='target', zorder=3)
        left.set_yscale('log')
        left.set_ylabel('GPipe / unwrapped')
        left.set_title('CPU targets (lower is better)')
        left.legend()
        right = fig.add_subplot(1, 2, 2)
        for partitions in sorted({g['partitions'] for g in outcome['grid']}):
            for checkpoint in ('never', 'except_last'):
                points = [g for g in outcome['grid']
                          if g['partitions'] == partitions and g['checkpoint'] == checkpoint]
                right.plot([g['chunks'] for g in points], [g['per_task_us'] for g in points],
                           marker='o', label=f'{partitions} partitions, {checkpoint}')
        right.set_xlabel('chunks')
        right.set_ylabel('us per micro-batch per partition')
        right.set_title('scheduler cost per task')
        right.legend(fontsize='small')

    return draw


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    parser = make_parser(EXPERIMENT, __doc__, PRESETS)
    parser.add_argument('--measure', help='(internal) measure one memory setting, print JSON')
    args = parser.parse_args(argv)
    if args.measure:
        print(json.dumps(measure(json.loads(args.measure))))
        return {}

    config = dict(PRESETS[args.preset])
    if args.smoke:
        config.update(SMOKE)
    if not args.smoke:
        tune_malloc()  # process-wide, so not in smoke runs (which run inside the test suite)
    with threads(args.threads):
        outcome = run(config)
        env = environment(['cpu'])

    report(outcome)
    return finish(args, EXPERIMENT, config, outcome, env, plot(outcome), targets=TARGETS)


if __name__ == '__main__':
    main(sys.argv[1:])

"""Overhead: GPipe's step time and memory against the unwrapped model, the library's CPU targets.

Run from the repository root::

    python -m benchmarks.overhead

Every row measures one cost of GPipe with one intra-op thread, as the ratio
of GPipe's fastest training step (forward, MSE loss, backward) to that of a
baseline timed side by side in the same run, against the performance target
the library holds itself to on CPU:

- wrapper: 32 x (Linear(64, 64) + ReLU), batch 256, chunks=1, one partition,
  checkpoint='never', against the unwrapped ``nn.Sequential`` -- the pure
  cost of the wrapper (target <= 1.05x);
- scheduler: the same 64 modules, batch 256, chunks 32, 4 partitions of 16,
  'except_last', against the unwrapped model on the full batch. Every
  micro-batch is a separate set of tiny kernels, so even without a pipeline
  the same work costs far more than 1x: the *floor* runs the unwrapped model
  on the same 32 micro-batches in a plain loop, with the recomputation's
  extra forward (a forward without gradients of each checkpointed
  micro-batch), and no pipeline machinery. What GPipe adds to the floor is
  the Python work per task. Target: <= 12x the unwrapped step or <= 1.15x
  the floor, whichever is larger;
- compute-bound: 8 x (Conv2d(32, 32, 3, padding=1) + ReLU) on 32x32 images,
  batch 64, chunks 8, 4 partitions, 'except_last' -- the recomputation costs
  about one extra forward (target <= 1.33x the unwrapped step);
- memory: the MLP with batch 32768, chunks 8, 4 partitions: the peak memory
  of one step with 'except_last' against 'never', each in a fresh process
  (target <= 0.39x).

The targets are measured with all partitions on one CPU device (``'cpu'``
four times: the tasks run in the calling thread, which isolates the
scheduler's own cost). The same settings on distinct CPU devices
(``cpu:0..3``, a worker thread each, sharing this machine's cores) are
reported beside them for information. Then, for chunks 8/16/32 with 2 and 4
partitions, the scheduler's cost per micro-batch per partition:
``(GPipe step - loop step) / (chunks * partitions)``, where the loop is the
floor above for that number of chunks (without the extra forward for
'never'), so only the scheduling is left.
"""
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.devices import cpu_devices
from benchmarks.memory import (MiB, fix_malloc, peak_ratio, run_measure_subprocesses,
                               step_peak_memory)
from benchmarks.report import format_spread, format_table
from benchmarks.runner import Experiment, Figure, Preset, main as run_main
from benchmarks.timing import time_steps, warmup_steps
from torchgpipe import GPipe

Step = Callable[[], None]
Row = Dict[str, Any]

PRESETS: Dict[str, Preset] = {
    'cpu': Preset("the library's CPU performance targets, then the scheduler grid (~1 min)",
                  wrapper_rounds=400, scheduler_rounds=40, compute_rounds=12, grid_rounds=20,
                  conv_batch=64, memory_batch=32768, grid_chunks=[8, 16, 32],
                  grid_partitions=[2, 4]),
}

#: Smoke: no warm-up step before the timed ones, and the memory row's modes
#: measured in one fresh process (see benchmarks.memory.run_measure_subprocesses).
SMOKE = dict(wrapper_rounds=1, scheduler_rounds=1, compute_rounds=1, grid_rounds=1,
             conv_batch=8, memory_batch=2048, grid_chunks=[8], grid_partitions=[2], warmup=0,
             one_process=True)

#: The targets, as the largest ratio to the baseline allowed. The scheduler's
#: is the larger of ``scheduler`` times the unwrapped step and
#: ``scheduler_floor`` times the floor's.
TARGETS = {'wrapper': 1.05, 'scheduler': 12.0, 'scheduler_floor': 1.15, 'compute-bound': 1.33,
           'memory': 0.39}


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


def make_step(model: nn.Module, input: Tensor) -> Step:
    """Forward, MSE loss against zeros, backward (gradients accumulate; no optimizer)."""
    target = torch.zeros_like(input)

    def step() -> None:
        output = model(input)
        F.mse_loss(output, target).backward()

    return step


def make_loop_step(model: nn.Module, input: Tensor, chunks: int, recompute: bool) -> Step:
    """The floor: the unwrapped model on the micro-batches in a plain loop, one loss, backward.

    The same kernels as GPipe's micro-batches without the pipeline. With
    ``recompute``, every micro-batch but the last (those 'except_last'
    checkpoints) also runs a forward pass without gradients first: the
    recomputation's extra forward (the checkpointed forward runs without
    gradients, its recomputation with them; the loop's one forward with
    gradients stands for the latter).
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


def ms(stats: Mapping[str, float]) -> Dict[str, float]:
    """A spread of seconds in milliseconds."""
    return {k: v * 1e3 if k != 'samples' else v for k, v in stats.items()}


def timed_row(name: str, setting: str, steps: Mapping[str, Step], rounds: int,
              warmup: int) -> Row:
    """``steps['gpipe']`` against ``steps['unwrapped']``, timed side by side with the others.

    The row holds every step's spread in ms; the ratio is of the fastest
    steps (the headline), ``ratio_median`` that of the medians.
    """
    t = time_steps(steps, rounds, warmup=warmup, desc=name)
    row: Row = {'name': name, 'setting': setting, 'measured': 'GPipe', 'against': 'unwrapped',
                'ratio': t['gpipe']['min'] / t['unwrapped']['min'],
                'ratio_median': t['gpipe']['median'] / t['unwrapped']['median']}
    row.update({f'{k}_ms': ms(v) for k, v in t.items()})
    if name in TARGETS:
        row['target'] = TARGETS[name]
        row['within_target'] = row['ratio'] <= row['target']
    return row


MLP_BATCH = 256
SCHEDULER = "chunks=32, 4 partitions of 16, 'except_last', MLP batch 256"


def wrapper_row(config: Dict[str, Any]) -> Row:
    x = torch.randn(MLP_BATCH, 64)
    steps = {'unwrapped': make_step(mlp(), x),
             'gpipe': make_step(gpipe(mlp(), 1, 1, 'never'), x)}
    return timed_row('wrapper', "chunks=1, 1 partition, 'never', MLP batch 256", steps,
                     config['wrapper_rounds'], warmup_steps(config))


def scheduler_row(config: Dict[str, Any]) -> Row:
    x = torch.randn(MLP_BATCH, 64)
    base = mlp()
    steps = {'unwrapped': make_step(base, x),
             'gpipe': make_step(gpipe(mlp(), 4, 32, 'except_last'), x),
             'floor': make_loop_step(base, x, 32, recompute=True)}
    row = timed_row('scheduler', SCHEDULER, steps, config['scheduler_rounds'],
                    warmup_steps(config))
    unwrapped, floor = row['unwrapped_ms']['min'], row['floor_ms']['min']
    row['floor_ratio'] = floor / unwrapped
    row['gpipe_over_floor'] = row['gpipe_ms']['min'] / floor
    # The larger of the two bounds, as a ratio to the unwrapped step.
    row['target'] = max(TARGETS['scheduler'], TARGETS['scheduler_floor'] * row['floor_ratio'])
    row['within_target'] = row['ratio'] <= row['target']
    return row


def compute_row(config: Dict[str, Any]) -> Row:
    images = torch.randn(config['conv_batch'], 32, 32, 32)
    steps = {'unwrapped': make_step(convnet(), images),
             'gpipe': make_step(gpipe(convnet(), 4, 8, 'except_last'), images)}
    return timed_row('compute-bound', f"chunks=8, 4 partitions, 'except_last', 8 convs batch "
                     f"{config['conv_batch']}", steps, config['compute_rounds'],
                     warmup_steps(config))


def measure(setting: Dict[str, Any]) -> Dict[str, Any]:
    """In a fresh process: the peak memory of one MLP step in the given mode."""
    fix_malloc()
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


def memory_row(config: Dict[str, Any]) -> Row:
    batch = config['memory_batch']
    modes = ('unwrapped', 'never', 'except_last')
    measured = run_measure_subprocesses('benchmarks.overhead',
                                        [{'mode': mode, 'batch': batch} for mode in modes],
                                        parallel=2, one_process=config.get('one_process', False))
    mib = {mode: m['step_peak'] / MiB for mode, m in zip(modes, measured)}
    ratio = peak_ratio(mib['except_last'], mib['never'])
    return {'name': 'memory', 'setting': f'chunks=8, 4 partitions, MLP batch {batch}',
            'measured': "'except_last'", 'against': "'never'", 'measured_mib': mib['except_last'],
            'against_mib': mib['never'], 'unwrapped_mib': mib['unwrapped'],
            'method': measured[0]['method'], 'ratio': ratio, 'target': TARGETS['memory'],
            'within_target': ratio <= TARGETS['memory']}


#: The rows measured against targets, in order: ``row(config) -> dict``, each
#: with ``name``, ``setting``, ``measured`` and ``against`` (what the ratio
#: divides), ``ratio``, ``target`` and ``within_target``.
#: (What tracing costs, on and off, is measured by :mod:`benchmarks.timeline`.)
ROWS: Sequence[Callable[[Dict[str, Any]], Row]] = (wrapper_row, scheduler_row, compute_row,
                                                   memory_row)


def threaded_rows(config: Dict[str, Any]) -> List[Row]:
    """Scheduler and compute-bound on distinct CPU devices (a worker thread each), no target."""
    x = torch.randn(MLP_BATCH, 64)
    images = torch.randn(config['conv_batch'], 32, 32, 32)
    settings = [
        ('scheduler', SCHEDULER, mlp, x, 32, config['scheduler_rounds']),
        ('compute-bound', f"chunks=8, 4 partitions, 'except_last', 8 convs batch "
         f"{config['conv_batch']}", convnet, images, 8, config['compute_rounds']),
    ]
    rows = []
    for name, setting, model, input, chunks, rounds in settings:
        steps = {'unwrapped': make_step(model(), input),
                 'gpipe': make_step(gpipe(model(), 4, chunks, 'except_last', distinct=True),
                                    input)}
        row = timed_row(f'{name} (threads)', setting + ', cpu:0..3', steps, rounds // 2 or 1,
                        warmup_steps(config))
        rows.append(row)
    return rows


def grid(config: Dict[str, Any]) -> List[Row]:
    """The scheduler's cost per micro-batch per partition, over chunks and partitions."""
    x = torch.randn(MLP_BATCH, 64)
    base = mlp()
    steps = {'unwrapped': make_step(base, x)}
    for chunks in config['grid_chunks']:
        for checkpoint in ('never', 'except_last'):
            steps[f'loop{chunks}/{checkpoint}'] = make_loop_step(
                base, x, chunks, recompute=checkpoint == 'except_last')
            for partitions in config['grid_partitions']:
                model = gpipe(mlp(), partitions, chunks, checkpoint)
                steps[f'{chunks}/{partitions}/{checkpoint}'] = make_step(model, x)
    t = time_steps(steps, config['grid_rounds'], warmup=warmup_steps(config), desc='grid')
    unwrapped = t['unwrapped']['min']
    rows = []
    for chunks in config['grid_chunks']:
        for partitions in config['grid_partitions']:
            for checkpoint in ('never', 'except_last'):
                step = t[f'{chunks}/{partitions}/{checkpoint}']
                loop = t[f'loop{chunks}/{checkpoint}']['min']
                rows.append({'chunks': chunks, 'partitions': partitions,
                             'checkpoint': checkpoint, 'step_ms': ms(step),
                             'loop_ms': loop * 1e3, 'unwrapped_ms': unwrapped * 1e3,
                             'ratio': step['min'] / unwrapped, 'loop_ratio': loop / unwrapped,
                             'per_task_us': (step['min'] - loop) / (chunks * partitions) * 1e6})
    return rows


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(0)
    results = [row(config) for row in ROWS]
    # Grid first, threads last: worker threads leave the allocator's arenas in
    # a state that slows the other variants slightly.
    grid_rows = grid(config)
    return {'results': results, 'grid': grid_rows, 'threaded': threaded_rows(config),
            'devices': ['cpu'] + [str(d) for d in cpu_devices(4)], 'targets': TARGETS}


def target_text(row: Row) -> str:
    if row['name'] == 'scheduler':
        return (f"<= {row['target']:.2f}x = max({TARGETS['scheduler']:g}x, "
                f"{TARGETS['scheduler_floor']:g} x floor {row['floor_ratio']:.2f}x)")
    return f"<= {row['target']:g}x"


def table(document: Dict[str, Any]) -> str:
    results = document['results']
    timed = [r for r in results if 'gpipe_ms' in r]
    memory = next(r for r in results if r['name'] == 'memory')
    scheduler = next(r for r in results if r['name'] == 'scheduler')
    ratios = [[r['name'], r['setting'], f"{r['measured']} / {r['against']}",
               f"{r['ratio']:.3f}x",
               f"{r['ratio_median']:.3f}x" if 'ratio_median' in r else '-', target_text(r)]
              for r in results]
    headers = ['cost', 'setting', 'ratio of', 'ratio (fastest)', 'ratio (medians)', 'target']
    if not document['smoke']:
        headers.append('within target')
        ratios = [row + ['yes' if r['within_target'] else 'NO']
                  for row, r in zip(ratios, results)]
    lines = ['GPipe against a baseline in the same run, one CPU device, one thread:',
             format_table(headers, ratios), '',
             'step times, ms: fastest (median, max) of the rounds',
             format_table(['cost', 'GPipe step', 'unwrapped step'],
                          [[r['name'], format_spread(r['gpipe_ms']),
                            format_spread(r['unwrapped_ms'])] for r in timed]), '',
             f"scheduler against its floor (the unwrapped model on the same micro-batches in a "
             f"loop, with the extra forward): floor {format_spread(scheduler['floor_ms'])} ms",
             format_table(['GPipe / unwrapped', 'floor / unwrapped', 'GPipe / floor',
                           'target'],
                          [[f"{scheduler['ratio']:.2f}x", f"{scheduler['floor_ratio']:.2f}x",
                            f"{scheduler['gpipe_over_floor']:.2f}x",
                            f"GPipe <= {TARGETS['scheduler']:g}x unwrapped or <= "
                            f"{TARGETS['scheduler_floor']:g}x floor, whichever is larger"]]),
             '',
             f"memory, peak of one step ({memory['method']}): 'except_last' "
             f"{memory['measured_mib']:.1f} MiB, 'never' {memory['against_mib']:.1f} MiB, "
             f"unwrapped {memory['unwrapped_mib']:.1f} MiB", '',
             'the same on distinct CPU devices (a worker thread each; information only):',
             format_table(['cost', 'setting', 'GPipe / unwrapped (fastest)',
                           'GPipe / unwrapped (medians)'],
                          [[r['name'], r['setting'], f"{r['ratio']:.3f}x",
                            f"{r['ratio_median']:.3f}x"] for r in document['threaded']]), '',
             'scheduler cost per micro-batch per partition (MLP batch 256, one CPU device; '
             'times of the fastest step):',
             format_table(['chunks', 'partitions', 'checkpoint', 'GPipe step (ms)',
                           'GPipe median (ms)', 'GPipe / unwrapped', 'loop step (ms)',
                           'loop / unwrapped', 'per task (µs)'],
                          [[g['chunks'], g['partitions'], g['checkpoint'],
                            f"{g['step_ms']['min']:.2f}", f"{g['step_ms']['median']:.2f}",
                            f"{g['ratio']:.2f}x", f"{g['loop_ms']:.2f}", f"{g['loop_ratio']:.2f}x",
                            f"{g['per_task_us']:.0f}"] for g in document['grid']]),
             'loop: the unwrapped model on the same micro-batches one after the other (with '
             "'except_last', plus a forward pass\nwithout gradients of all but the last); "
             'per task: (GPipe step - loop step) / (chunks * partitions)']
    return '\n'.join(lines)


def headline(document: Dict[str, Any]) -> List[Figure]:
    figures = []
    for r in document['results']:
        value = f"{r['ratio']:.3f}x"
        if r['name'] == 'scheduler':
            value += f" ({r['gpipe_over_floor']:.2f}x the floor)"
        figures.append(Figure(f"{r['name']}: {r['measured']} / {r['against']}", value,
                              target_text(r), r['within_target']))
    return figures


def plot(document: Dict[str, Any], plt: Any) -> None:
    """Left, one panel per ratio: its own linear axis from 0, the bar (fastest
    steps), a whisker to the medians' ratio, the target as a dashed line
    (and the scheduler's floor as a dot), each named by a label beside it
    rather than a legend that could hide the line. Right, the scheduler's
    cost per task."""
    fig = plt.gcf()
    fig.set_size_inches(12, 4.6)
    rows = document['results']
    grid = fig.add_gridspec(1, len(rows) + 1, width_ratios=[1] * len(rows) + [3])
    # A smoke run's figures mean nothing: no verdict colours.
    colors = (['tab:blue'] * len(rows) if document['smoke'] else
              ['tab:green' if r['within_target'] else 'tab:red' for r in rows])
    for i, (r, color) in enumerate(zip(rows, colors)):
        ax = fig.add_subplot(grid[0, i])
        ratio = r['ratio']
        median = r.get('ratio_median', ratio)
        ax.bar([0], [ratio], width=0.5, color=color,
               yerr=[[max(0.0, ratio - median)], [max(0.0, median - ratio)]], capsize=4)
        top = max(ratio, median, r['target'], r.get('floor_ratio', 0.0))
        ax.set_xlim(-0.9, 0.9)
        ax.set_ylim(0, top * 1.25)
        # The target's and the floor's values beside the bar, off their marks.
        ax.axhline(r['target'], color='black', linestyle='--', linewidth=1.2)
        ax.annotate(f"target\n{r['target']:.2f}x", (-0.85, r['target']), xytext=(0, 2),
                    textcoords='offset points', ha='left', va='bottom', fontsize='x-small')
        if 'floor_ratio' in r:
            ax.plot([0.6], [r['floor_ratio']], marker='o', color='tab:gray')
            ax.annotate(f"floor\n{r['floor_ratio']:.2f}x", (0.6, r['floor_ratio']),
                        xytext=(0, -5), textcoords='offset points', ha='center', va='top',
                        fontsize='x-small', color='dimgray')
        ax.set_xticks([0])
        ax.set_xticklabels([f"{r['measured']} /\n{r['against']}".replace("'", '')],
                           fontsize='small')
        ax.set_title(f"{r['name']}\n{ratio:.2f}x", fontsize='medium')
        ax.tick_params(axis='y', labelsize='small')
        if i == 0:
            ax.set_ylabel('ratio (fastest; whisker to the medians)')
    fig.suptitle('GPipe against its CPU targets: lower is better, each ratio on a linear '
                 'scale of its own', fontsize='medium')
    right = fig.add_subplot(grid[0, len(rows)])
    for partitions in sorted({g['partitions'] for g in document['grid']}):
        for checkpoint in ('never', 'except_last'):
            points = [g for g in document['grid']
                      if g['partitions'] == partitions and g['checkpoint'] == checkpoint]
            right.plot([g['chunks'] for g in points], [g['per_task_us'] for g in points],
                       marker='o', label=f'{partitions} partitions, {checkpoint}')
    right.set_ylim(bottom=0)
    right.set_xlabel('chunks')
    right.set_ylabel('µs per micro-batch per partition')
    right.set_title('scheduler cost per task (fastest steps)')
    right.legend(fontsize='small')


EXPERIMENT = Experiment(name='overhead', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run,
                        table=table, headline=headline, plot=plot, measure=measure,
                        tune_malloc=True)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

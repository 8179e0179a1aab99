"""Schedules: what train_step's schedules gain over each other and over the drop-in way, on CPU.

Run from the repository root::

    python -m benchmarks.schedules                  # 8 convolutions on cpu:0..3 (~2 min)
    python -m benchmarks.schedules --preset cuda    # the same rows on 4 CUDA devices

:meth:`torchgpipe.GPipe.train_step` runs the forward and the backward passes
itself, each partition's backward pass in the worker of its device, in the
order of a schedule (``'1f1b'`` or ``'fill_drain'``). Three ratios, each of
steps timed side by side in one run (the fastest of the rounds, with the
medians' ratio beside it), or of peak memory measured in fresh processes:

- compute-bound: 8 x (Conv2d(32, 32, 3, padding=1) + ReLU) on 32x32 images,
  batch 64, chunks 8, 4 partitions on distinct CPU devices: ``train_step``
  1F1B with ``checkpoint='never'`` against forward + ``loss.backward()``
  with ``'except_last'`` (the drop-in way, whose backward passes run one
  after the other in the calling thread) on the same devices
  (target <= 0.80x). ``train_step`` fill-drain ``'never'`` and 1F1B
  ``'except_last'`` are timed beside them, for information;
- memory: the same model with batch 256 (activations dominate: some 32 MiB
  per layer's output for the whole batch, against 0.3 MiB of parameters),
  chunks 8, 4 partitions: the peak memory of one ``train_step`` with 1F1B
  against fill-drain, both ``'never'``, each in a fresh process
  (target <= 0.60x). With 1F1B partition ``j`` keeps at most ``4 - j``
  micro-batches' activations, with fill-drain all 8;
- parallelism: 2 partitions on ``cpu:0`` and ``cpu:1``, chunks 8, the
  compute-bound model: ``train_step`` 1F1B ``'never'`` against the unwrapped
  model with one intra-op thread (target <= 0.70x), and, for information,
  against the unwrapped model with 2 intra-op threads (the other way to use
  two cores).

Run it without ``OMP_NUM_THREADS=1`` in the environment: the runner already
gives every thread one intra-op thread (``--threads 1``), and with that
variable set, ``torch.set_num_threads(2)`` around the two-thread step made
it slower than one thread here, not faster.

Then one step each of 1F1B and fill-drain (``'never'``, 4 partitions) runs
inside :func:`torchgpipe.trace`; the JSON keeps their events, and
``schedules-<preset>-timelines.png`` draws them one above the other (an
action's event is its work: the wait for a neighbour's message is left
blank), with the devices' busy fraction from the timeline's summary.

Before all these, it prints every schedule's idle time at the zero-bubble
paper's unit costs beside its formula; :mod:`benchmarks.bubbles` measures
every schedule on two workers against 1F1B, and ZB-H1's peak memory per device.
"""
import copy
import sys
from dataclasses import asdict
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgpipe
from benchmarks.bubbles import stack_timelines, unit_rows, unit_table
from benchmarks.devices import cpu_devices, cuda_devices, synchronize
from benchmarks.environment import threads
from benchmarks.memory import (MiB, fix_malloc, peak_ratio, run_measure_subprocesses,
                               step_peak_memory)
from benchmarks.overhead import convnet, ms
from benchmarks.report import format_spread, format_table
from benchmarks.runner import Experiment, Figure, Preset, main as run_main
from benchmarks.timing import time_steps, warmup_steps
from torchgpipe import GPipe

Step = Callable[[], None]
Row = Dict[str, Any]

PRESETS: Dict[str, Preset] = {
    'cpu': Preset('8 convolutions, batch 64 (memory: 256) of 32x32, chunks 8, on cpu:0..3 '
                  '(~2 min)',
                  device='cpu', batch=64, memory_batch=256, image_size=32, chunks=8, rounds=10),
    'cuda': Preset('the same rows on 4 CUDA devices, batch 256 (memory: 1024) of 64x64',
                   device='cuda', batch=256, memory_batch=1024, image_size=64, chunks=8,
                   rounds=10),
}

#: Smoke: no warm-up step before the timed ones, and the memory row's modes
#: measured in one fresh process (see benchmarks.memory.run_measure_subprocesses).
SMOKE = dict(batch=8, memory_batch=16, image_size=8, rounds=1, warmup=0, one_process=True)

#: The targets, as the largest ratio allowed.
TARGETS = {'compute-bound': 0.80, 'memory': 0.60, 'parallelism': 0.70}

NEVER_1F1B = "train_step 1F1B 'never'"
DROP_IN = "forward + backward() 'except_last'"
#: The 1F1B step of the parallelism rows, on 2 partitions (the others run on 4).
NEVER_1F1B_2 = "train_step 1F1B 'never', 2 partitions"


def devices_of(config: Dict[str, Any], partitions: int) -> List[torch.device]:
    """The preset's devices for ``partitions``: distinct CPU devices, or CUDA devices."""
    if config['device'] == 'cuda':
        return cuda_devices(partitions)
    return cpu_devices(partitions)


def gpipe(model: nn.Sequential, devices: Sequence[torch.device], chunks: int,
          checkpoint: str) -> GPipe:
    """A copy of ``model`` split evenly over ``devices`` (the same weights for every variant)."""
    n = len(devices)
    return GPipe(copy.deepcopy(model), [len(model) // n] * n, devices=list(devices),
                 chunks=chunks, checkpoint=checkpoint)


def images(config: Dict[str, Any], batch: int, device: torch.device) -> Tensor:
    size = config['image_size']
    return torch.randn(batch, 32, size, size, device=device)


def train_step(model: GPipe, input: Tensor, schedule: str) -> Step:
    """One ``train_step`` with an MSE loss against zeros (gradients accumulate; no optimizer)."""
    target = torch.zeros_like(input, device=model.devices[-1])

    def step() -> None:
        model.train_step(input, target, F.mse_loss, schedule=schedule)
        synchronize(model.devices)
    return step


def backward_step(model: nn.Module, input: Tensor, devices: Sequence[torch.device],
                  intra_op_threads: Optional[int] = None) -> Step:
    """Forward, MSE loss against zeros, ``backward()``; with ``intra_op_threads`` for that only."""
    target = torch.zeros_like(input, device=devices[-1])

    def step() -> None:
        F.mse_loss(model(input), target).backward()
        synchronize(devices)

    if intra_op_threads is None:
        return step

    def threaded() -> None:
        with threads(intra_op_threads):
            step()
    return threaded


def ratio_row(name: str, setting: str, times: Dict[str, Dict[str, float]], measured: str,
              against: str) -> Row:
    """``times[measured]`` over ``times[against]``, with the target of ``name`` if it has one."""
    row: Row = {'name': name, 'setting': setting, 'measured': measured, 'against': against,
                'ratio': times[measured]['min'] / times[against]['min'],
                'ratio_median': times[measured]['median'] / times[against]['median'],
                'measured_ms': ms(times[measured]), 'against_ms': ms(times[against])}
    if name in TARGETS:
        row['target'] = TARGETS[name]
        row['within_target'] = row['ratio'] <= row['target']
    return row


def size_text(config: Dict[str, Any], batch: int) -> str:
    size = config['image_size']
    return f"8 convs, batch {batch} of {size}x{size}, chunks {config['chunks']}"


def compute_rows(config: Dict[str, Any]) -> Dict[str, Any]:
    """The compute-bound rows on 4 partitions, and the traced step of each schedule."""
    devices = devices_of(config, 4)
    base = convnet().to(devices[0])
    input = images(config, config['batch'], devices[0])
    chunks = config['chunks']
    never = gpipe(base, devices, chunks, 'never')
    steps = {NEVER_1F1B: train_step(never, input, '1f1b'),
             "train_step fill-drain 'never'": train_step(gpipe(base, devices, chunks, 'never'),
                                                         input, 'fill_drain'),
             "train_step 1F1B 'except_last'": train_step(
                 gpipe(base, devices, chunks, 'except_last'), input, '1f1b'),
             DROP_IN: backward_step(gpipe(base, devices, chunks, 'except_last'), input, devices)}
    times = time_steps(steps, config['rounds'], warmup=warmup_steps(config), desc='4 partitions')
    setting = f"{size_text(config, config['batch'])}, 4 partitions"
    rows = [ratio_row('compute-bound', setting, times, NEVER_1F1B, DROP_IN),
            ratio_row('fill-drain', setting, times, "train_step fill-drain 'never'", DROP_IN),
            ratio_row('1F1B, checkpointed', setting, times, "train_step 1F1B 'except_last'",
                      DROP_IN)]

    timelines = []
    for schedule, title in (('1f1b', '1F1B'), ('fill_drain', 'fill-drain')):
        with torchgpipe.trace(never) as timeline:
            train_step(never, input, schedule)()
        summary = timeline.summary()
        events = timeline.events
        timelines.append({'name': title, 'schedule': schedule,
                          'traced_step_time': summary.step_time,
                          'utilization': 1 - summary.bubble,
                          'predicted_bubble': summary.predicted_bubble,
                          'summary': str(summary),
                          'events': [asdict(e) for e in events]})
    return {'rows': rows, 'timelines': timelines, 'devices': [str(d) for d in devices]}


def parallelism_rows(config: Dict[str, Any]) -> List[Row]:
    """``train_step`` on 2 partitions against the unwrapped model on 1 and 2 intra-op threads."""
    devices = devices_of(config, 2)
    base = convnet().to(devices[0])
    input = images(config, config['batch'], devices[0])
    steps = {NEVER_1F1B_2: train_step(gpipe(base, devices, config['chunks'], 'never'), input,
                                       '1f1b'),
             'unwrapped, 1 thread': backward_step(base, input, devices[:1]),
             'unwrapped, 2 threads': backward_step(base, input, devices[:1], intra_op_threads=2)}
    times = time_steps(steps, config['rounds'], warmup=warmup_steps(config), desc='2 partitions')
    setting = f"{size_text(config, config['batch'])}, 2 partitions"
    return [ratio_row('parallelism', setting, times, NEVER_1F1B_2, 'unwrapped, 1 thread'),
            ratio_row('two threads', setting, times, NEVER_1F1B_2, 'unwrapped, 2 threads')]


def measure(setting: Dict[str, Any]) -> Dict[str, Any]:
    """In a fresh process: the peak memory of one step of the given mode.

    ``mode`` is a schedule of ``train_step`` with ``'never'`` on 4
    partitions, or ``'unwrapped'``.
    """
    fix_malloc()
    torch.manual_seed(0)
    mode, config = setting['mode'], setting['config']
    devices = devices_of(config, 4)
    base = convnet().to(devices[0])

    def make(input: Tensor) -> Step:
        if mode == 'unwrapped':
            return backward_step(base, input, devices[:1])
        return train_step(model, input, mode)
    model = gpipe(base, devices, config['chunks'], 'never')
    # Warm up code paths, thread pools and gradients with a small batch, so
    # that the measured step only adds its own activations and temporaries.
    make(images(config, 2 * config['chunks'], devices[0]))()
    result = step_peak_memory(make(images(config, config['memory_batch'], devices[0])),
                              devices if mode != 'unwrapped' else devices[:1])
    result.update(mode=mode)
    return result


def memory_row(config: Dict[str, Any]) -> Row:
    modes = ('1f1b', 'fill_drain', 'unwrapped', 'zb_h1')
    measured = run_measure_subprocesses('benchmarks.schedules',
                                        [{'mode': mode, 'config': config} for mode in modes],
                                        parallel=1 if config['device'] == 'cuda' else 2,
                                        one_process=config.get('one_process', False))
    mib = {mode: m['step_peak'] / MiB for mode, m in zip(modes, measured)}
    ratio = peak_ratio(mib['1f1b'], mib['fill_drain'])
    return {'name': 'memory',
            'setting': f"{size_text(config, config['memory_batch'])}, 4 partitions",
            'measured': NEVER_1F1B, 'against': "train_step fill-drain 'never'",
            'measured_mib': mib['1f1b'], 'against_mib': mib['fill_drain'],
            'unwrapped_mib': mib['unwrapped'], 'zb_h1_mib': mib['zb_h1'],
            'method': measured[0]['method'],
            'ratio': ratio, 'target': TARGETS['memory'],
            'within_target': ratio <= TARGETS['memory']}


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(0)
    units = unit_rows()
    compute = compute_rows(config)
    parallel = parallelism_rows(config)
    memory = memory_row(config)
    results = [compute['rows'][0], memory, parallel[0], parallel[1], *compute['rows'][1:]]
    return {'results': results, 'timelines': compute['timelines'],
            'devices': compute['devices'], 'targets': TARGETS, 'units': units}


def target_text(row: Row) -> str:
    return f"<= {row['target']:g}x" if 'target' in row else '-'


def table(document: Dict[str, Any]) -> str:
    results = document['results']
    headers = ['figure', 'setting', 'ratio of', 'ratio (fastest)', 'ratio (medians)', 'target']
    cells = [[r['name'], r['setting'], f"{r['measured']} / {r['against']}",
              f"{r['ratio']:.3f}x",
              f"{r['ratio_median']:.3f}x" if 'ratio_median' in r else '-', target_text(r)]
             for r in results]
    if not document['smoke']:
        headers.append('within target')
        cells = [row + ['-' if 'target' not in r else 'yes' if r['within_target'] else 'NO']
                 for row, r in zip(cells, results)]
    timed = {}
    for r in results:
        if 'measured_ms' in r:
            timed[r['measured']] = r['measured_ms']
            timed[r['against']] = r['against_ms']
    memory = next(r for r in results if r['name'] == 'memory')
    lines = [unit_table(document['units']), '',
             'train_step against the other ways to train, in the same run, one intra-op thread '
             'per worker:', format_table(headers, cells), '',
             'step times, ms: fastest (median, max) of the rounds',
             format_table(['step', 'time'], [[k, format_spread(v)] for k, v in timed.items()]),
             '',
             f"memory, peak of one step ({memory['method']}): 1F1B {memory['measured_mib']:.1f} "
             f"MiB, fill-drain {memory['against_mib']:.1f} MiB, unwrapped "
             f"{memory['unwrapped_mib']:.1f} MiB; ZB-H1 {memory['zb_h1_mib']:.1f} MiB (every "
             'partition in one process: ZB-H1 keeps min(p, m) micro-batches on each)']
    for t in document['timelines']:
        lines += ['', f"traced step, {t['name']}: {t['summary']}",
                  f"utilization: {t['utilization']:.0%} (ideal, "
                  f"1 - (n-1)/(m+n-1): {1 - t['predicted_bubble']:.0%})"]
    return '\n'.join(lines)


def headline(document: Dict[str, Any]) -> List[Figure]:
    figures = [Figure(f"idle of {r['schedule']} / 1f1b, unit costs", f"{r['ratio']:.2f}x",
                      f"<= {r['target']:g}x", r['within_target'])
               for r in document['units'] if 'target' in r]
    return figures + [
        Figure(f"{r['name']}: {r['measured']} / {r['against']}", f"{r['ratio']:.3f}x",
               target_text(r) if 'target' in r else '', r.get('within_target'))
        for r in document['results'] if r['name'] in TARGETS or r['name'] == 'two threads']


def plot(document: Dict[str, Any], plt: Any) -> None:
    """The ratios as bars, green or red against their targets, grey without one."""
    rows = document['results']
    figure = plt.gcf()
    figure.set_size_inches(10, 4.6)
    axes = plt.gca()
    x = range(len(rows))
    ratios = [r['ratio'] for r in rows]
    # A whisker from the fastest steps' ratio (the bar) to the medians' ratio.
    medians = [r.get('ratio_median', r['ratio']) for r in rows]
    whiskers = [[max(0.0, r - m) for r, m in zip(ratios, medians)],
                [max(0.0, m - r) for r, m in zip(ratios, medians)]]
    # A smoke run's figures mean nothing: no verdict colours.
    colors = ['tab:gray' if 'target' not in r else 'tab:blue' if document['smoke'] else
              'tab:green' if r['within_target'] else 'tab:red' for r in rows]
    axes.bar(x, ratios, yerr=whiskers, capsize=4, color=colors)
    targeted = [i for i, r in enumerate(rows) if 'target' in r]
    axes.scatter(targeted, [rows[i]['target'] for i in targeted], marker='_', s=900,
                 color='black', label='target', zorder=3)
    axes.axhline(1.0, color='black', linewidth=0.5)
    axes.set_xticks(list(x))
    axes.set_xticklabels([f"{r['name']}\n{r['measured']}\n/ {r['against']}".replace("'", '')
                          .replace('train_step ', '').replace(' + backward()', '\n+ backward()')
                          for r in rows], fontsize='x-small')
    axes.set_ylabel('ratio (fastest; whisker to the medians)')
    axes.set_title('train_step against the other ways to train (lower is better; grey: '
                   'no target)', fontsize='medium')
    axes.legend(fontsize='small')
    figure.tight_layout()


def plot_timelines(document: Dict[str, Any], plt: Any) -> None:
    """The traced steps of 1F1B and fill-drain, one above the other, on one time scale."""
    timelines = document['timelines']
    stack_timelines(plt, timelines, [
        f"{t['name']} ('never', {len(document['devices'])} partitions, "
        f"{document['settings']['chunks']} micro-batches): traced step "
        f"{t['traced_step_time'] * 1e3:.0f} ms, utilization {t['utilization']:.0%}"
        for t in timelines], 2.4)


EXPERIMENT = Experiment(name='schedules', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run,
                        table=table, headline=headline, plot=plot,
                        more_plots={'timelines': plot_timelines}, measure=measure,
                        tune_malloc=True)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

"""Each schedule's bubble: from the schedule itself at the paper's costs, and measured on CPU.

Run from the repository root::

    python -m benchmarks.bubbles                  # 2 CPU workers, 4 CPU ranks (~3 min)
    python -m benchmarks.bubbles --preset cuda    # 2 GPUs; memory per GPU

Three parts:

- the unit table (``python -m benchmarks.schedules`` prints it too): for
  ``p = 4`` workers and ``m = 8`` micro-batches, with the zero-bubble
  paper's costs (``F = I = W = 1``, ``B = 2``, halved for the half-size
  partitions of two per worker), the idle time per worker of each built-in
  schedule, computed from its actions
  (:func:`torchgpipe.engine.simulator.idle`), beside its formula
  (:data:`torchgpipe.engine.generators.BUILT_INS`) and as a ratio of 1F1B's
  (targets: interleaved 1F1B, ``v = 2``, <= 0.55x; ZB-H1 <= 0.40x; ZBV <= 0.20x);
- the measured rows: the parallelism workload (2 workers, ``cpu:0`` and
  ``cpu:1``), ``checkpoint='never'``: ZB-H1's step against 1F1B's, timed side
  by side (target <= 1.05x), and its idle time per worker against 1F1B's,
  from traced steps (target <= 0.5x); interleaved 1F1B (``[cpu:0, cpu:1] *
  2``) and ZBV (``[cpu:0, cpu:1, cpu:1, cpu:0]``) on 4 partitions beside them,
  for information;
- memory per device: the memory workload (batch 256) on 4 CPU ranks (2 in a
  smoke run) of :class:`~torchgpipe.distributed.DistributedGPipe`, a process
  each, so that each device's memory is its process's: ZB-H1 keeps ``min(p, m)``
  micro-batches on every rank, which 1F1B's first rank already keeps; the
  largest rank's peak, ZB-H1 over 1F1B (target <= 1.05x). On CUDA, each
  device's own peak, in one process, says as much: the cuda preset skips it.
"""
import copy
import os
import sys
from dataclasses import asdict
from fractions import Fraction
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
from torch import nn

import torchgpipe
from benchmarks.report import format_table
from benchmarks.runner import Experiment, Figure, Preset, main as run_main
from benchmarks.timing import time_steps, warmup_steps
from torchgpipe import GPipe
from torchgpipe.engine.generators import BUILT_INS, SCHEDULES, named
from torchgpipe.engine.schedule import Action
from torchgpipe.engine.simulator import idle, unit_cost

Row = Dict[str, Any]
Step = Callable[[], None]

PRESETS: Dict[str, Preset] = {
    'cpu': Preset('8 convolutions, batch 64 (memory: 256) of 32x32, chunks 8, on cpu:0 and cpu:1 '
                  '(memory: 4 CPU ranks) (~3 min)',
                  device='cpu', batch=64, memory_batch=256, image_size=32, chunks=8, rounds=10),
    'cuda': Preset('the same on 2 CUDA devices, batch 256 (memory: 1024) of 64x64',
                   device='cuda', batch=256, memory_batch=1024, image_size=64, chunks=8,
                   rounds=10),
}

#: Smoke: 4 micro-batches, no warm-up step before the timed ones, one traced
#: step per schedule, and the memory per device on 2 ranks (2 processes to
#: start, not 4).
SMOKE = dict(batch=8, memory_batch=16, image_size=8, chunks=4, rounds=1, warmup=0, traces=1,
             memory_ranks=2)

#: The unit table's targets: each schedule's idle time per worker over 1F1B's.
UNIT_TARGETS = {'interleaved_1f1b': 0.55, 'zb_h1': 0.40, 'zbv': 0.20}
#: The measured targets, on the parallelism workload.
ZERO_BUBBLE_TARGETS = {'zb_h1 step': 1.05, 'zb_h1 idle': 0.5}


def unit_rows(p: int = 4, m: int = 8) -> List[Row]:
    """Each built-in schedule's idle time per worker at the paper's costs, and its formula."""
    rows = []
    base = None
    for name in SCHEDULES:
        n = 2 * p if name in ('interleaved_1f1b', 'zbv') else p
        v = n // p

        def cost(action: Action, v: int = v) -> Fraction:
            return unit_cost(action) / v
        schedule = named(name, m, n, p)
        waiting = idle(schedule.workers, n, cost)
        base = waiting if name == '1f1b' else base
        facts = BUILT_INS[name]
        rows.append({'schedule': name, 'p': p, 'm': m, 'v': v, 'idle': float(waiting),
                     'formula': facts.formula,
                     'formula_value': float(facts.bubble(p, v, Fraction(1), Fraction(2),
                                                         Fraction(1)))})
    for row in rows:
        row['ratio'] = row['idle'] / float(base) if base else 0.0
        if row['schedule'] in UNIT_TARGETS:
            row['target'] = UNIT_TARGETS[row['schedule']]
            row['within_target'] = row['ratio'] <= row['target']
    return rows


def unit_table(rows: Sequence[Row]) -> str:
    cells = [[r['schedule'], str(r['v']), f"{r['idle']:g}", r['formula'],
              f"{r['formula_value']:g}", f"{r['ratio']:.2f}x",
              f"<= {r['target']:g}x" if 'target' in r else '-',
              '-' if 'target' not in r else 'yes' if r['within_target'] else 'NO']
             for r in rows]
    p, m = rows[0]['p'], rows[0]['m']
    return '\n'.join([
        f'idle time per worker from each schedule itself, p = {p}, m = {m}, F = I = W = 1 '
        '(B = 2), per worker\'s share of the model:',
        format_table(['schedule', 'v', 'idle', 'formula', 'by formula', 'x 1F1B', 'target',
                      'within target'], cells)])


def layouts(devices: Sequence[torch.device]) -> Dict[str, List[torch.device]]:
    """The devices of each measured schedule on two workers ``a``, ``b``."""
    a, b = devices
    return {'1f1b': [a, b], 'zb_h1': [a, b], 'interleaved_1f1b': [a, b, a, b],
            'zbv': [a, b, b, a]}


def pipelines(model: nn.Sequential, devices: Sequence[torch.device], chunks: int
              ) -> Dict[str, GPipe]:
    """A GPipe per measured schedule, on its devices, the same weights, ``'never'``."""
    result = {}
    for schedule, on in layouts(devices).items():
        n = len(on)
        result[schedule] = GPipe(copy.deepcopy(model), [len(model) // n] * n, devices=on,
                                 chunks=chunks, checkpoint='never')
    return result


def zero_bubble_rows(model: nn.Sequential, input: torch.Tensor, devices: Sequence[torch.device],
                     config: Dict[str, Any],
                     make_step: Callable[[GPipe, torch.Tensor, str], Step]) -> List[Row]:
    """ZB-H1 against 1F1B on two workers: step time side by side, idle time from traces."""
    gpipes = pipelines(model, devices, config['chunks'])
    steps = {schedule: make_step(g, input, schedule) for schedule, g in gpipes.items()}
    times = time_steps(steps, config['rounds'], warmup=warmup_steps(config),
                       desc='schedules, 2 workers')
    # The idle time per worker of traced steps: the least of a few (noise only
    # adds); the events of that step are kept for the chart.
    idle_ms: Dict[str, float] = {}
    traced: Dict[str, Row] = {}
    for schedule, g in gpipes.items():
        for _ in range(config.get('traces', 3)):
            with torchgpipe.trace(g) as timeline:
                steps[schedule]()
            summary = timeline.summary()
            waited = sum(d.idle for d in summary.devices) / len(summary.devices) * 1e3
            if waited < idle_ms.get(schedule, float('inf')):
                idle_ms[schedule] = waited
                traced[schedule] = {'traced_step_time': summary.step_time,
                                    'utilization': 1 - summary.bubble,
                                    'summary': str(summary),
                                    'events': [asdict(e) for e in timeline.events]}
    rows: List[Row] = []
    for schedule in gpipes:
        row: Row = {'schedule': schedule, 'step_ms': times[schedule]['min'] * 1e3,
                    'step_ratio': times[schedule]['min'] / times['1f1b']['min'],
                    'step_ratio_median': times[schedule]['median'] / times['1f1b']['median'],
                    'idle_ms': idle_ms[schedule],
                    'idle_ratio': idle_ms[schedule] / idle_ms['1f1b'],
                    'devices': [str(d) for d in layouts(devices)[schedule]],
                    **traced[schedule]}
        if schedule == 'zb_h1':
            row['targets'] = {'step': ZERO_BUBBLE_TARGETS['zb_h1 step'],
                              'idle': ZERO_BUBBLE_TARGETS['zb_h1 idle']}
            row['within_target'] = (row['step_ratio'] <= row['targets']['step']
                                    and row['idle_ratio'] <= row['targets']['idle'])
        rows.append(row)
    return rows


def zero_bubble_table(rows: Sequence[Row], setting: str) -> str:
    cells = [[r['schedule'], ' '.join(r['devices']), f"{r['step_ms']:.1f}",
              f"{r['step_ratio']:.3f}x ({r['step_ratio_median']:.3f}x)",
              f"{r['idle_ms']:.1f}", f"{r['idle_ratio']:.2f}x",
              '-' if 'targets' not in r else
              f"step <= {r['targets']['step']:g}x, idle <= {r['targets']['idle']:g}x",
              '-' if 'targets' not in r else 'yes' if r['within_target'] else 'NO']
             for r in rows]
    return '\n'.join([
        f'every schedule on two workers ({setting}), against 1F1B, in the same run:',
        format_table(['schedule', 'devices', 'step ms', 'x 1F1B (medians)', 'idle ms/worker',
                      'idle x 1F1B', 'target', 'within target'], cells)])


#: The memory target: ZB-H1's peak over 1F1B's, on the device that holds the most.
MEMORY_TARGET = 1.05


def rank_memory(rank: int, world_size: int, port: int, config: Dict[str, Any],
                results: Any) -> None:
    """One rank of the memory measurement: the peak each schedule's step adds to this process."""
    import torch.distributed as dist

    from benchmarks.memory import fix_malloc, step_peak_memory
    from benchmarks.overhead import convnet
    from torchgpipe.distributed import DistributedGPipe

    fix_malloc()
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank,
                            world_size=world_size)
    torch.manual_seed(0)
    model = convnet()
    pipe = DistributedGPipe(model, [len(model) // world_size] * world_size,
                            chunks=config['chunks'], checkpoint='never')
    size = config['image_size']

    def step(batch: int, schedule: str) -> Step:
        input = torch.randn(batch, 32, size, size)
        target = torch.zeros_like(input)

        def run() -> None:
            pipe.train_step(input, target, torch.nn.functional.mse_loss, schedule=schedule)
        return run
    peaks = {}
    for schedule in ('1f1b', 'zb_h1'):
        # Warm up code paths and buffers with a small batch first.
        step(2 * config['chunks'], schedule)()
        dist.barrier()
        peaks[schedule] = step_peak_memory(step(config['memory_batch'], schedule),
                                           [torch.device('cpu')])['step_peak']
        dist.barrier()
    gathered: List[Any] = [None] * world_size
    dist.all_gather_object(gathered, peaks)
    if rank == 0:
        results.put(gathered)
    dist.barrier()
    os._exit(0)  # no Python shutdown: see docs/scaling_out.rst, "Ending a job"


def device_memory_row(config: Dict[str, Any], ranks: int = 4) -> Row:
    """ZB-H1's peak memory against 1F1B's, per device: ``ranks`` CPU processes, one each."""
    from benchmarks.distributed import spawn_ranks
    from benchmarks.memory import peak_ratio
    per_rank = spawn_ranks(rank_memory, ranks, config, 600)
    mib = {s: [p[s] / 2**20 for p in per_rank] for s in ('1f1b', 'zb_h1')}
    ratio = peak_ratio(max(mib['zb_h1']), max(mib['1f1b']))
    return {'ranks': ranks, 'per_rank_mib': mib, 'ratio': ratio, 'target': MEMORY_TARGET,
            'within_target': ratio <= MEMORY_TARGET}


def device_memory_text(row: Row) -> str:
    per = row['per_rank_mib']
    return (f"peak memory per device, {row['ranks']} CPU ranks (a process each, "
            f"'never'): 1F1B {', '.join(f'{v:.1f}' for v in per['1f1b'])} MiB, ZB-H1 "
            f"{', '.join(f'{v:.1f}' for v in per['zb_h1'])} MiB; the largest, ZB-H1 / 1F1B: "
            f"{row['ratio']:.3f}x (target <= {row['target']:g}x)")


def stack_timelines(plt: Any, rows: Sequence[Row], titles: Sequence[str], height: float) -> None:
    """Traced steps (rows with ``events``), one chart above the other, on one time scale."""
    from benchmarks.timeline import row_events
    from torchgpipe.timeline import segments
    from torchgpipe.timeline.events import draw_timeline
    figure = plt.gcf()
    figure.set_size_inches(12, height * len(rows) + 1.0)
    axes = figure.subplots(len(rows), 1, sharex=True)
    for k, (ax, row, title) in enumerate(zip(axes, rows, titles)):
        # One legend, below the last chart (the runner's tight layout makes room for it).
        last = k == len(rows) - 1
        draw_timeline(ax, segments(row_events(row)), title, legend=last)
        if not last:
            ax.set_xlabel('')
    # Shared x: the longest step sets the scale, so the lengths compare at a glance.
    axes[0].set_xlim(0, max(r['traced_step_time'] for r in rows) * 1e3)


def plot_every(document: Dict[str, Any], plt: Any) -> None:
    """The traced step of every schedule on two workers, one above the other, on one scale."""
    rows = document['results']
    stack_timelines(plt, rows, [
        f"{r['schedule']} on {' '.join(r['devices'])}: traced step "
        f"{r['traced_step_time'] * 1e3:.0f} ms, idle {r['idle_ms']:.0f} ms per worker "
        f"({r['idle_ratio']:.2f}x 1F1B's)" for r in rows], 2.0)


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    from benchmarks.overhead import convnet
    from benchmarks.schedules import devices_of, images, train_step
    torch.manual_seed(0)
    devices = devices_of(config, 2)
    model = convnet().to(devices[0])
    input = images(config, config['batch'], devices[0])
    rows = zero_bubble_rows(model, input, devices, config, train_step)
    memory = (device_memory_row(config, config.get('memory_ranks', 4))
              if config['device'] == 'cpu' else None)
    return {'units': unit_rows(), 'results': rows, 'device_memory': memory,
            'devices': [str(d) for d in devices]}


def table(document: Dict[str, Any]) -> str:
    settings = document['settings']
    lines = [unit_table(document['units']), '',
             zero_bubble_table(document['results'],
                               f"8 convs, batch {settings['batch']} of {settings['image_size']}"
                               f"x{settings['image_size']}, chunks {settings['chunks']}, "
                               "'never'")]
    if document['device_memory'] is not None:
        lines += ['', device_memory_text(document['device_memory'])]
    return '\n'.join(lines)


def headline(document: Dict[str, Any]) -> List[Figure]:
    figures = [Figure(f"idle of {r['schedule']} / 1f1b, unit costs", f"{r['ratio']:.2f}x",
                      f"<= {r['target']:g}x", r['within_target'])
               for r in document['units'] if 'target' in r]
    for r in document['results']:
        if 'targets' in r:
            figures += [Figure(f"{r['schedule']} / 1f1b, step on 2 workers",
                               f"{r['step_ratio']:.3f}x", f"<= {r['targets']['step']:g}x",
                               r['step_ratio'] <= r['targets']['step']),
                        Figure(f"{r['schedule']} / 1f1b, idle per worker (traced)",
                               f"{r['idle_ratio']:.2f}x", f"<= {r['targets']['idle']:g}x",
                               r['idle_ratio'] <= r['targets']['idle'])]
    device = document['device_memory']
    if device is not None:
        figures.append(Figure('zb_h1 / 1f1b, peak memory of the largest device',
                              f"{device['ratio']:.3f}x", f"<= {device['target']:g}x",
                              device['within_target']))
    return figures


EXPERIMENT = Experiment(name='bubbles', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run,
                        table=table, headline=headline, plot=plot_every, tune_malloc=True)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

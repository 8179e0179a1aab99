"""Each schedule's bubble: from the schedule itself at the paper's costs, and measured on CPU.

Two parts of ``python -m benchmarks.schedules``:

- the unit table: for ``p = 4`` workers and ``m = 8`` micro-batches, with
  the zero-bubble paper's costs (``F = I = W = 1``, ``B = 2``, halved for
  the half-size partitions of two per worker), the idle time per worker of
  each built-in schedule, computed from its actions
  (:func:`torchgpipe.train.schedule.idle`), beside its formula
  (:data:`torchgpipe.train.generators.BUBBLES`) and as a ratio of 1F1B's
  (targets: interleaved 1F1B, ``v = 2``, <= 0.55x; ZB-H1 <= 0.40x; ZBV <= 0.20x);
- the measured rows: the parallelism workload (2 workers, ``cpu:0`` and
  ``cpu:1``), ``checkpoint='never'``: ZB-H1's step against 1F1B's, timed side
  by side (target <= 1.05x), and its idle time per worker against 1F1B's,
  from traced steps (target <= 0.5x); interleaved 1F1B (``[cpu:0, cpu:1] *
  2``) and ZBV (``[cpu:0, cpu:1, cpu:1, cpu:0]``) on 4 partitions beside them,
  for information.
"""
import copy
from fractions import Fraction
from typing import Any, Callable, Dict, List, Sequence

import torch
from torch import nn

import torchgpipe
from benchmarks.report import format_table
from benchmarks.timing import time_steps
from torchgpipe import GPipe
from torchgpipe.train.generators import BUBBLES, SCHEDULES, named
from torchgpipe.train.schedule import Action, idle, unit_cost

Row = Dict[str, Any]
Step = Callable[[], None]

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
        bubble = BUBBLES[name]
        rows.append({'schedule': name, 'p': p, 'm': m, 'v': v, 'idle': float(waiting),
                     'formula': bubble.text,
                     'formula_value': float(bubble.value(p, v, Fraction(1), Fraction(2),
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
                     chunks: int, rounds: int,
                     make_step: Callable[[GPipe, torch.Tensor, str], Step]) -> List[Row]:
    """ZB-H1 against 1F1B on two workers: step time side by side, idle time from traces."""
    gpipes = pipelines(model, devices, chunks)
    steps = {schedule: make_step(g, input, schedule) for schedule, g in gpipes.items()}
    times = time_steps(steps, rounds, desc='schedules, 2 workers')
    # The idle time per worker of traced steps: the least of a few (noise only adds).
    idle_ms: Dict[str, float] = {}
    for schedule, g in gpipes.items():
        samples = []
        for _ in range(3):
            with torchgpipe.trace(g) as timeline:
                steps[schedule]()
            summary = timeline.summary()
            samples.append(sum(d.idle for d in summary.devices) / len(summary.devices) * 1e3)
        idle_ms[schedule] = min(samples)
    rows: List[Row] = []
    for schedule in gpipes:
        row: Row = {'schedule': schedule, 'step_ms': times[schedule]['min'] * 1e3,
                    'step_ratio': times[schedule]['min'] / times['1f1b']['min'],
                    'step_ratio_median': times[schedule]['median'] / times['1f1b']['median'],
                    'idle_ms': idle_ms[schedule],
                    'idle_ratio': idle_ms[schedule] / idle_ms['1f1b'],
                    'devices': [str(d) for d in layouts(devices)[schedule]]}
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

"""Timeline: what each part of the pipeline contributes, on measured timelines (Table 1, Figure 7).

Run from the repository root::

    python -m benchmarks.timeline                  # U-Net on CPU devices cpu:0..3 (~1 min)
    python -m benchmarks.timeline --preset paper   # Table 1: U-Net(5, 64), 4 CUDA devices

As in Section 4.1 of the paper, the components are added one at a time to a
baseline that has the clock-cycle schedule only:

- ``baseline``: no fork/join dependencies between micro-batches, copies on
  the compute streams, and no portals: the model is the fully sequential
  U-Net in which every skip tensor is an input and an output of each layer
  it passes over, so it is copied through every partition in between;
- ``+dependency``: the fork/join dependencies that fix the order of the
  backward pass;
- ``+streams``: copies on copy streams of their own;
- ``+portals``: skips through portals, straight to the partition that pops
  them. This is torchgpipe as it is;
- ``no checkpointing``: the last, with ``checkpoint='never'``.

The settings take turns step by step (so that a busy spell of the machine
slows them alike); the table gives the fastest step, the range of the
others, the throughput and the speed-up over the baseline. Then each
setting runs one more step inside :func:`torchgpipe.trace`: its utilization
(the devices' busy fraction) and peak memory come from that step's summary,
and its timeline is one chart of the plot, the paper's Figure 7 drawn from
measurements. The JSON keeps every event of those steps.

Last, the cost of tracing itself: the full setting's step timed with and
without :func:`torchgpipe.trace` side by side, and the work tracing adds to
a step when it is off (a few checks per task), timed alone.

On CPU, copy streams change nothing (a copy between CPU devices is the
identity), and the backward pass runs in one thread whatever the
dependencies say; what the dependencies fix there is the order.
"""
import contextlib
import copy
import sys
import timeit
from dataclasses import asdict
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgpipe
from benchmarks.balance import auto_balance
from benchmarks.devices import cpu_devices, cuda_devices, synchronize
from benchmarks.models.unet import unet
from benchmarks.report import format_table
from benchmarks.runner import Experiment, Figure, Preset, main as run_main
from benchmarks.timing import time_steps, warmup_steps
from torchgpipe import GPipe
from torchgpipe.foundation.stream import current_stream
from torchgpipe.runtime.traits import RunState
from torchgpipe.skip.skippable import Skippable
from torchgpipe.timeline import Event, segments

#: The settings of Table 1 and one more: (name, dependency, streams, portals, checkpoint).
SETTINGS = [('baseline', False, False, False, 'except_last'),
            ('+dependency', True, False, False, 'except_last'),
            ('+streams', True, True, False, 'except_last'),
            ('+portals', True, True, True, 'except_last'),
            ('no checkpointing', True, True, True, 'never')]

PRESETS: Dict[str, Preset] = {
    'cpu': Preset('U-Net(1, 8), 3x64x64, batch 32, 8 micro-batches, 4 CPU devices (~1 min)',
                  device='cpu', num_convs=1, channels=8, image_size=64, batch=32, chunks=8,
                  partitions=4, rounds=8, balance_timeout=0.5),
    'paper': Preset('Table 1: U-Net(5, 64), 3x192x192, batch 128, 8 micro-batches, '
                    '4 CUDA devices',
                    device='cuda', num_convs=5, channels=64, image_size=192, batch=128, chunks=8,
                    partitions=4, rounds=10, balance_timeout=1.0),
}

#: Smoke: 2 micro-batches (half the events to trace and draw), no warm-up step
#: before the timed ones.
SMOKE = dict(channels=2, image_size=32, batch=8, chunks=2, rounds=1, balance_timeout=0.0,
             warmup=0)

#: Table 1 of the paper (4 NVIDIA Tesla P40): throughput (samples/s), utilization, memory (GiB).
PAPER = {'baseline': (30.662, 0.44, 52.2), '+dependency': (41.306, 0.59, 19.1),
         '+streams': (55.191, 0.71, 30.0), '+portals': (58.477, 0.75, 23.5)}


class Carry(nn.Module):
    """Runs a layer of a model with skips, carrying the skips in its input and output tuples.

    The fully sequential form of a model without portals (Section 3.3 of
    the paper): the skips alive at a layer's input (``before``) follow the
    tensor in its input tuple, those alive at its output (``after``) in its
    output tuple, so every partition between a stash and its pop receives
    the skip and passes it on.
    """

    def __init__(self, layer: nn.Module, before: Sequence[Tuple[Any, str]],
                 after: Sequence[Tuple[Any, str]]) -> None:
        super().__init__()
        self.layer = layer
        self.before = list(before)
        self.after = list(after)

    def forward(self, input: Any) -> Any:
        x, *carried = (input,) if isinstance(input, Tensor) else input
        skips = dict(zip(self.before, carried))
        layer = self.layer
        if isinstance(layer, Skippable):
            def keep(name: str, tensor: Optional[Tensor]) -> None:
                skips[layer.namespaced(name)] = tensor

            def give(name: str) -> Optional[Tensor]:
                return skips.pop(layer.namespaced(name))
            x = layer.dispatch(x, keep, give)
        else:
            x = layer(x)
        if not self.after:
            return x
        return (x, *(skips[key] for key in self.after))


def without_portals(model: nn.Sequential) -> nn.Sequential:
    """The same layers (shared, not copied), each skip carried from its stash to its pop."""
    alive: List[Tuple[Any, str]] = []
    layers = []
    for layer in model:
        before = list(alive)
        if isinstance(layer, Skippable):
            alive = [key for key in alive if key not in set(layer.poppable())]
            alive += list(layer.stashable())
        layers.append(Carry(layer, before, alive))
    return nn.Sequential(*layers)


@contextlib.contextmanager
def components(dependency: bool, streams: bool) -> Iterator[None]:
    """Switches off the fork/join dependencies and the copy streams of every GPipe within."""
    with contextlib.ExitStack() as stack:
        if not dependency:
            # No fork, no phony to join: no micro-batch waits for another.
            stack.enter_context(mock.patch('torchgpipe.engine.pipeline.fork_off',
                                           lambda batch: None))
        if not streams:
            def compute_streams(self: RunState, devices: Sequence[torch.device],
                                chunks: int) -> List[List[Any]]:
                return [[current_stream(d)] * chunks for d in devices]
            stack.enter_context(mock.patch.object(RunState, 'ensure_copy_streams',
                                                  compute_streams))
        yield


def build(config: Dict[str, Any]) -> Dict[str, Any]:
    """The models of every setting, their balance, and the batch."""
    torch.manual_seed(0)
    n = config['partitions']
    devices = cuda_devices(n) if config['device'] == 'cuda' else cpu_devices(n)
    size, batch = config['image_size'], config['batch']
    model = unet(depth=5, num_convs=config['num_convs'], base_channels=config['channels'])
    input = torch.rand(batch, 3, size, size, device=devices[0])
    target = (torch.rand(batch, 1, size, size, device=devices[-1]) > 0.5).float()
    sample = input[:max(1, batch // config['chunks'])]
    balance, method = auto_balance(model, n, sample, devices[0], config['balance_timeout'])
    return {'model': model, 'devices': devices, 'input': input, 'target': target,
            'balance': balance, 'balance_method': method}


def make_step(model: GPipe, input: Tensor, target: Tensor, dependency: bool, streams: bool,
              devices: Sequence[torch.device]) -> Callable[[], None]:
    """One SGD step of a setting, with its components switched as it says."""
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        with components(dependency, streams):
            optimizer.zero_grad()
            output = model(input)
            F.binary_cross_entropy_with_logits(output, target).backward()
            optimizer.step()
        synchronize(devices)
    return step


def tracing_off_cost(tasks: int, copies: int) -> float:
    """Seconds a step spends on what tracing adds to it when it is off.

    The pipeline then checks, per task, whether a profiler runs and (twice)
    whether a timeline records; per copy, whether a timeline records, after
    binding the copy into a closure. This times exactly that, for one step.
    """
    timeline = None

    def checks() -> None:
        for _ in range(tasks):
            if torch.autograd.profiler._is_profiler_enabled:
                pass
            if timeline is not None:
                pass
            if timeline is not None:
                pass
        for _ in range(copies):
            def copy() -> None:
                pass
            if timeline is None:
                copy()
    number = 200
    return min(timeit.repeat(checks, number=number, repeat=5)) / number


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    built = build(config)
    devices, balance = built['devices'], built['balance']
    input, target = built['input'], built['target']
    models: Dict[str, GPipe] = {}
    steps: Dict[str, Callable[[], None]] = {}
    for name, dependency, streams, portals, checkpoint in SETTINGS:
        layers = built['model'] if portals else without_portals(built['model'])
        # Every setting trains its own copy of the same weights.
        model = GPipe(copy.deepcopy(layers), balance, devices=devices, chunks=config['chunks'],
                      checkpoint=checkpoint)
        models[name] = model
        steps[name] = make_step(model, input, target, dependency, streams, devices)
    times = time_steps(steps, config['rounds'], warmup=warmup_steps(config), desc='settings')

    rows = []
    for name, dependency, streams, portals, checkpoint in SETTINGS:
        with torchgpipe.trace(models[name]) as timeline:
            steps[name]()
        summary = timeline.summary()
        rows.append({
            'name': name, 'dependency': dependency, 'streams': streams, 'portals': portals,
            'checkpoint': checkpoint, 'step': times[name],
            'throughput': config['batch'] / times[name]['min'],
            'speedup': times['baseline']['min'] / times[name]['min'],
            'utilization': 1 - summary.bubble,
            'peak_memory': max(summary.peak_memory.values()),
            'traced_step_time': summary.step_time,
            'critical_path_time': summary.critical_path_time,
            'summary': str(summary),
            'events': [asdict(e) for e in timeline.events],
        })

    # The cost of tracing, on the full setting.
    full = steps['+portals']
    model = models['+portals']

    def traced() -> None:
        with torchgpipe.trace(model):
            full()
    cost = time_steps({'untraced': full, 'traced': traced}, config['rounds'],
                      warmup=warmup_steps(config), desc='tracing')
    m, n = config['chunks'], config['partitions']
    off = tracing_off_cost(tasks=m * n, copies=m * (n - 1) + m * n)
    tracing = {'untraced': cost['untraced'], 'traced': cost['traced'],
               'on_over_off': cost['traced']['min'] / cost['untraced']['min'],
               'off_seconds': off, 'off_fraction': off / cost['untraced']['min']}
    return {'devices': [str(d) for d in devices], 'balance': balance,
            'balance_method': built['balance_method'], 'results': rows, 'tracing': tracing}


def table(document: Dict[str, Any]) -> str:
    rows = document['results']
    lines = [format_table(
        ['setting', 'fastest step (ms)', 'range (ms)', 'samples/s', 'speed-up',
         'utilization', 'peak memory (MiB)', 'paper samples/s', 'paper speed-up'],
        [[r['name'], f"{r['step']['min'] * 1e3:.1f}",
          f"{r['step']['min'] * 1e3:.1f}-{r['step']['max'] * 1e3:.1f}",
          f"{r['throughput']:.1f}", f"{r['speedup']:.2f}x", f"{r['utilization']:.0%}",
          f"{r['peak_memory'] / 2**20:.0f}",
          f"{PAPER[r['name']][0]:.1f}" if r['name'] in PAPER else '-',
          f"{PAPER[r['name']][0] / PAPER['baseline'][0]:.2f}x" if r['name'] in PAPER else '-']
         for r in rows])]
    full = next(r for r in rows if r['name'] == '+portals')
    lines.append(f"summary of the traced step with every component:\n{full['summary']}")
    t = document['tracing']
    lines.append(f"tracing on: step {t['traced']['min'] * 1e3:.1f} ms against "
                 f"{t['untraced']['min'] * 1e3:.1f} ms off ({t['on_over_off']:.3f}x); "
                 f"tracing off adds {t['off_seconds'] * 1e6:.2f} us a step "
                 f"({t['off_fraction']:.4%} of the step)")
    return '\n'.join(lines)


def headline(document: Dict[str, Any]) -> List[Figure]:
    rows = {r['name']: r for r in document['results']}
    t = document['tracing']
    figures = [Figure('all components: speed-up over the baseline',
                      f"{rows['+portals']['speedup']:.2f}x"),
               Figure('tracing on / off, step time', f"{t['on_over_off']:.3f}x"),
               Figure('tracing off: share of the step it costs', f"{t['off_fraction']:.4%}",
                      target='< 0.1%', within=t['off_fraction'] < 1e-3)]
    return figures


def row_events(row: Dict[str, Any]) -> List[Event]:
    """The events of a setting's traced step, back from the JSON document."""
    return [Event(**{**e, 'pieces': tuple(map(tuple, e['pieces']))}) for e in row['events']]


def chart_title(row: Dict[str, Any]) -> str:
    return (f"{row['name']}: {row['traced_step_time'] * 1e3:.0f} ms, "
            f"utilization {row['utilization']:.0%}")


def plot(document: Dict[str, Any], plt: Any) -> None:
    """Figure 7: the timeline of every setting's traced step, one chart each, on one time scale.

    The longest step sets the scale of all, so that their lengths compare at
    a glance; the time axis is labelled under the last chart only, and the
    legend sits below that label. The legend belongs to the last chart's
    axes, so the runner's tight layout makes room for it.
    """
    from matplotlib.patches import Patch
    from matplotlib.transforms import offset_copy

    from torchgpipe.timeline.events import COLORS, LABELS, draw_timeline
    rows = document['results']
    figure = plt.gcf()
    figure.set_size_inches(12, 2.1 * len(rows) + 0.8)
    axes = figure.subplots(len(rows), 1, sharex=True)
    kinds = set()
    for k, (ax, row) in enumerate(zip(axes, rows)):
        events = row_events(row)
        kinds |= {e.kind for e in events}
        draw_timeline(ax, segments(events), chart_title(row), legend=False)
        if k < len(rows) - 1:
            ax.set_xlabel('')
    axes[0].set_xlim(0, max(row['traced_step_time'] for row in rows) * 1e3)
    # Anchored 36 points below the last chart: under its tick labels and its x label.
    below = offset_copy(axes[-1].transAxes, fig=figure, y=-36, units='points')
    axes[-1].legend(handles=[Patch(color=COLORS[k], label=LABELS[k])
                             for k in COLORS if k in kinds],
                    loc='upper center', bbox_to_anchor=(0.5, 0), bbox_transform=below,
                    ncol=len(kinds), frameon=False)


def plot_full(document: Dict[str, Any], plt: Any) -> None:
    """The timeline of the full setting (every component) alone, larger."""
    from torchgpipe.timeline.events import draw_timeline
    row = next(r for r in document['results'] if r['name'] == '+portals')
    plt.gcf().set_size_inches(12, 4)
    draw_timeline(plt.gca(), segments(row_events(row)),
                  f"U-Net, {len(document['devices'])} partitions, "
                  f"{document['settings']['chunks']} micro-batches, every component: "
                  f"{row['traced_step_time'] * 1e3:.0f} ms, utilization {row['utilization']:.0%}")


EXPERIMENT = Experiment(
    name='timeline', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run, table=table,
    headline=headline, plot=plot, more_plots={'full': plot_full})


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

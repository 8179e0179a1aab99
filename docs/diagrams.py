"""Draws the diagrams of the documentation as SVG files in ``docs/_static/``.

Run it by hand after changing a figure (``python docs/diagrams.py``); the
Sphinx build (``docs/conf.py``) also runs it when matplotlib is installed.
The output is deterministic (fixed SVG ids, no timestamp), so redrawing an
unchanged figure leaves its file unchanged, and the SVGs are committed for
builds without matplotlib.

Every figure is drawn from the same rules the code follows; the comments say
which function of torchgpipe each one illustrates.
"""
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import matplotlib

matplotlib.use('svg')

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), '_static')

plt.rcParams.update({
    'svg.hashsalt': 'torchgpipe',  # stable ids in the SVG
    'svg.fonttype': 'none',        # text stays text (small files, crisp)
    'font.family': 'sans-serif',
    'font.size': 10,
})

# One colour per device (colour-blind friendly), and a light tint of each.
DEVICE_COLORS = ['#4C72B0', '#DD8452', '#55A868', '#C44E52']
LIGHT = {'#4C72B0': '#C9D6EA', '#DD8452': '#F4D5C2', '#55A868': '#CAE5D1', '#C44E52': '#EDC7C8'}
GRAY = '#B0B0B0'
INK = '#222222'


# -- helpers -----------------------------------------------------------------

def new_figure(width: float, height: float, xlim: Tuple[float, float],
               ylim: Tuple[float, float]) -> Tuple[Figure, Axes]:
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(*xlim)
    ax.set_ylim(*ylim)
    ax.axis('off')
    return fig, ax


def save(fig: Figure, name: str) -> None:
    os.makedirs(OUT, exist_ok=True)
    fig.savefig(os.path.join(OUT, name), format='svg', facecolor='white',
                metadata={'Date': None, 'Creator': None})
    plt.close(fig)


def box(ax: Axes, x: float, y: float, w: float, h: float, text: str = '',
        color: str = 'white', edge: str = INK, textcolor: str = INK, size: float = 10,
        style: str = 'round,pad=0,rounding_size=0.08', linestyle: str = '-') -> None:
    """A box with its lower-left corner at (x, y)."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle=style, facecolor=color,
                                edgecolor=edge, linewidth=1, linestyle=linestyle))
    if text:
        ax.text(x + w / 2, y + h / 2, text, ha='center', va='center', color=textcolor,
                fontsize=size)


def arrow(ax: Axes, start: Tuple[float, float], end: Tuple[float, float],
          color: str = INK, dashed: bool = False, rad: float = 0.0, width: float = 1.2,
          head: float = 10) -> None:
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle='-|>', mutation_scale=head,
                                 color=color, linewidth=width,
                                 linestyle=(0, (4, 3)) if dashed else '-',
                                 connectionstyle=f'arc3,rad={rad}', shrinkA=0, shrinkB=0))


def label(ax: Axes, x: float, y: float, text: str, size: float = 10, ha: str = 'center',
          va: str = 'center', color: str = INK, weight: str = 'normal',
          style: str = 'normal') -> None:
    ax.text(x, y, text, ha=ha, va=va, fontsize=size, color=color, fontweight=weight,
            fontstyle=style)


# -- the schedule (torchgpipe.engine.pipeline.clock_cycles) ---------------------------

def clock_cycles(m: int, n: int) -> List[List[Tuple[int, int]]]:
    """The same schedule as torchgpipe.engine.pipeline.clock_cycles."""
    return [[(k - j, j) for j in range(max(1 + k - m, 0), min(1 + k, n))]
            for k in range(m + n - 1)]


def draw_schedule() -> None:
    """Forward tasks by clock cycle, then the backward pass in reverse, with the bubble."""
    m, n = 4, 3
    forward = m + n - 1
    total = 2 * forward
    fig, ax = new_figure(9.2, 2.9, (-1.6, total + 0.2), (-1.25, n + 0.75))

    for j in range(n):
        y = n - 1 - j
        label(ax, -0.15, y + 0.4, f'device {j}', ha='right')
        for t in range(total):
            box(ax, t + 0.04, y + 0.04, 0.92, 0.72, color='#F2F2F2', edge='#DDDDDD')

    for k, schedule in enumerate(clock_cycles(m, n)):
        for i, j in schedule:
            color = DEVICE_COLORS[j]
            box(ax, k + 0.04, n - 1 - j + 0.04, 0.92, 0.72, f'F{i},{j}', color=color,
                edge=color, textcolor='white')
    # Backward: the last device starts with the last micro-batch; each device
    # runs micro-batches m-1 .. 0, each after the same micro-batch's backward
    # on the next device (fork/join and the data dependencies).
    for k in range(forward):
        for i, j in clock_cycles(m, n)[k]:
            t = forward + (m - 1 - i) + (n - 1 - j)
            color = DEVICE_COLORS[j]
            box(ax, t + 0.04, n - 1 - j + 0.04, 0.92, 0.72, f'B{i},{j}', color=LIGHT[color],
                edge=color)

    for k in range(total):
        label(ax, k + 0.5, -0.25, str(k), size=8, color='#555555')
    label(ax, -0.15, -0.25, 'time step', size=8, ha='right', color='#555555')
    ax.plot([forward, forward], [-0.05, n - 0.15], color=INK, linewidth=1, linestyle=':')
    label(ax, forward / 2, n + 0.4, f'forward: {m + n - 1} clock cycles for m = {m}, n = {n}')
    label(ax, forward + forward / 2, n + 0.4, 'backward: the same schedule, reversed')
    box(ax, 0.5, -1.1, 0.5, 0.4, color='#F2F2F2', edge='#DDDDDD')
    label(ax, 1.15, -0.9, 'idle: the bubble, (n - 1) / (m + n - 1) of the time', ha='left',
          size=9)
    save(fig, 'clock_cycles.svg')


def draw_bubble() -> None:
    """The bubble fraction (n - 1) / (m + n - 1) against the number of micro-batches."""
    fig = plt.figure(figsize=(6.4, 3.2))
    ax = fig.add_axes((0.11, 0.16, 0.85, 0.78))
    ms = list(range(1, 65))
    for n, color in zip((2, 4, 8), DEVICE_COLORS):
        ax.plot(ms, [100 * (n - 1) / (m + n - 1) for m in ms], color=color, linewidth=2,
                label=f'n = {n} partitions')
    ax.set_xscale('log', base=2)
    ax.set_xticks([1, 2, 4, 8, 16, 32, 64])
    ax.set_xticklabels(['1', '2', '4', '8', '16', '32', '64'])
    ax.set_xlabel('m, micro-batches (chunks)')
    ax.set_ylabel('bubble (% of the time idle)')
    ax.set_ylim(0, 100)
    ax.grid(True, color='#E5E5E5')
    ax.legend(frameon=False)
    for side in ('top', 'right'):
        ax.spines[side].set_visible(False)
    save(fig, 'bubble.svg')


# -- fork and join (torchgpipe.foundation.dependency) -------------------------------------

def draw_fork_join() -> None:
    fig, ax = new_figure(8.6, 3.3, (0, 10.6), (-0.3, 4.3))
    w, h = 1.9, 0.7
    rows = {'i': 2.9, 'i+1': 0.9}
    for name, y in rows.items():
        label(ax, 0.05, y + h / 2, f'micro-batch {name}', ha='left', size=9)
        box(ax, 1.9, y, w, h, f'F({name}, j-1)', color=DEVICE_COLORS[0], edge=DEVICE_COLORS[0],
            textcolor='white')
        box(ax, 7.0, y, w, h, f'F({name}, j)', color=DEVICE_COLORS[1], edge=DEVICE_COLORS[1],
            textcolor='white')
    # micro-batch i: output of F(i, j) is forked.
    yi = rows['i'] + h / 2
    arrow(ax, (3.8, yi), (7.0, yi))
    box(ax, 9.2, rows['i'] + 0.1, 1.0, 0.5, 'Fork', color='white')
    arrow(ax, (8.9, yi), (9.2, yi))
    # micro-batch i+1: input of F(i+1, j) is joined.
    yj = rows['i+1'] + h / 2
    box(ax, 4.9, rows['i+1'] + 0.1, 1.0, 0.5, 'Join', color='white')
    arrow(ax, (3.8, yj), (4.9, yj))
    arrow(ax, (5.9, yj), (7.0, yj))
    # The phony: from Fork of micro-batch i to Join of micro-batch i+1.
    arrow(ax, (9.7, rows['i'] + 0.1), (5.4, rows['i+1'] + 0.6), dashed=True, color='#777777',
          rad=-0.15)
    label(ax, 7.5, 2.2, 'phony (empty tensor)', size=9, color='#555555', style='italic')
    label(ax, 5.3, 4.05, 'forward: Fork and Join are identities on the data; the phony adds '
          'one edge to the graph', size=9)
    label(ax, 5.3, 0.2, 'backward: Fork(i) waits for the phony\'s gradient, which only comes '
          'once B(i+1, j) has passed Join,', size=9)
    label(ax, 5.3, -0.15, 'so on device j, B(i+1, j) runs before B(i, j) (and before the '
          'recomputation of F(i, j))', size=9)
    save(fig, 'fork_join.svg')


# -- copy streams (torchgpipe.foundation.copy, torchgpipe.foundation.stream) ------------

def draw_copy_streams() -> None:
    """Device j's streams; on each device, micro-batch i has a copy stream of its own."""
    fig, ax = new_figure(9.0, 4.0, (-2.9, 13.0), (-0.5, 6.0))
    blue, red = DEVICE_COLORS[0], DEVICE_COLORS[3]
    f, c = 1.6, 0.8  # durations of a computation and of a copy

    def lane(y: float, name: str) -> None:
        label(ax, -0.2, y + 0.25, name, ha='right', size=9)
        ax.plot([0, 10], [y, y], color='#DDDDDD', linewidth=1)

    def task(x: float, y: float, w: float, text: str, color: str) -> None:
        box(ax, x, y, w, 0.5, text, color=color, edge='white', textcolor='white',
            size=9 if color == blue else 8)

    # (a) Copies on the compute stream: everything runs one after the other.
    label(ax, -2.8, 5.6, '(a) copies on the default stream', ha='left', weight='bold', size=9)
    lane(4.7, 'default stream')
    t = 0.0
    for i in range(3):
        task(t, 4.7, c, f'recv {i}', red)
        task(t + c, 4.7, f, f'F({i}, j)', blue)
        task(t + c + f, 4.7, c, f'send {i}', red)
        t += 2 * c + f
    label(ax, t + 0.2, 4.95, 'done', ha='left', size=9, style='italic')

    # (b) Copies on copy streams: they overlap the computation.
    label(ax, -2.8, 3.7, '(b) copies on copy streams', ha='left', weight='bold', size=9)
    lane(2.8, 'compute stream')
    for i in range(3):
        lane(2.0 - 0.8 * i, f'copy stream {i}')
        start = c + i * f
        task(start, 2.8, f, f'F({i}, j)', blue)
        task(start - c if i == 0 else start - f, 2.0 - 0.8 * i, c, f'recv {i}', red)
        task(start + f, 2.0 - 0.8 * i, c, f'send {i}', red)
    end = c + 3 * f + c
    label(ax, end + 0.2, 0.65, 'done', ha='left', size=9, style='italic')
    label(ax, 11.5, 2.2, 'F(i, j) waits for\nrecv i only; sends\nand receives overlap\n'
          'the computation', size=9)
    save(fig, 'copy_streams.svg')


# -- checkpoint and recompute (torchgpipe.runtime.checkpoint) --------------------------

def draw_checkpoint() -> None:
    fig, ax = new_figure(9.0, 3.2, (-0.2, 12.4), (-1.9, 2.4))
    names = ['input', 'Checkpoint', 'output', 'Wait', 'Recompute', 'output\'', 'Copy']
    colors = ['white', DEVICE_COLORS[0], 'white', '#EEEEEE', DEVICE_COLORS[2], 'white',
              '#EEEEEE']
    xs = [0.0, 1.6, 3.55, 5.1, 6.65, 8.6, 10.15]
    ws = [1.2, 1.55, 1.2, 1.15, 1.55, 1.2, 1.15]
    y, h = 0.6, 0.7
    for x, w, name, color in zip(xs, ws, names, colors):
        filled = color not in ('white', '#EEEEEE')
        box(ax, x, y, w, h, name, color=color, edge=color if filled else INK,
            textcolor='white' if filled else INK, size=9,
            style='round,pad=0,rounding_size=0.08' if name not in ('input', 'output',
                                                                   'output\'') else 'square,pad=0')
    for (x0, w0), x1 in zip(zip(xs, ws), xs[1:]):
        arrow(ax, (x0 + w0, y + h / 2), (x1, y + h / 2))
    label(ax, 6.1, 2.0, 'forward on device j: F(i, j) runs once without keeping activations',
          size=9)
    # Backward order, numbered under the nodes.
    steps = [(10.72, '1', 'copy dx back\n(copy stream)'),
             (7.42, '2', 'recompute F\'(i, j)\n(compute stream)'),
             (5.67, '3', 'wait for\nthe copy'),
             (2.37, '4', 'B(i, j) through the\nrecomputed graph')]
    for x, number, text in steps:
        ax.add_patch(plt.Circle((x, -0.05), 0.22, facecolor=INK, edgecolor=INK))
        label(ax, x, -0.05, number, color='white', size=9, weight='bold')
        label(ax, x, -0.95, text, size=8.5)
    for (x0, _, _), (x1, _, _) in zip(steps, steps[1:]):
        arrow(ax, (x0 - 0.3, -0.05), (x1 + 0.3, -0.05), color='#777777', dashed=True)
    label(ax, 12.3, -0.05, 'backward', ha='right', size=9, style='italic', color='#555555')
    save(fig, 'checkpoint.svg')


# -- portals (torchgpipe.skip.portal) ------------------------------------------

def draw_portals() -> None:
    fig, ax = new_figure(9.0, 3.4, (-0.3, 13.3), (-0.5, 4.3))

    def pipeline(x0: float, title: str, direct: bool) -> None:
        label(ax, x0 + 2.9, 4.0, title, weight='bold', size=9)
        if direct:
            layers = [('stash', 0), ('layer', 1), ('pop', 2)]
        else:
            layers = [('layer 1', 0), ('layer 2', 1), ('layer 3', 2)]
        for k, (name, j) in enumerate(layers):
            x = x0 + k * 2.2
            color = DEVICE_COLORS[j]
            box(ax, x - 0.1, 0.0, 1.6, 3.5, color=LIGHT[color], edge=LIGHT[color])
            label(ax, x + 0.7, 0.25, f'device {j}', size=8.5)
            box(ax, x + 0.1, 2.3, 1.2, 0.6, name, color=color, edge=color, textcolor='white',
                size=9)
            if k:
                arrow(ax, (x - 0.9, 2.6), (x + 0.1, 2.6))
        if direct:
            arrow(ax, (x0 + 0.7, 2.3), (x0 + 5.1, 2.3), color=DEVICE_COLORS[3], rad=0.35,
                  width=1.6)
            label(ax, x0 + 2.9, 0.95, 'one copy, device 0 to 2\n(PortalCopy)', size=8.5,
                  color=DEVICE_COLORS[3])
        else:
            arrow(ax, (x0 + 0.7, 2.3), (x0 + 2.9, 2.3), color=DEVICE_COLORS[3], rad=0.4,
                  width=1.6)
            arrow(ax, (x0 + 2.9, 2.3), (x0 + 5.1, 2.3), color=DEVICE_COLORS[3], rad=0.4,
                  width=1.6)
            label(ax, x0 + 2.9, 0.95, 'copied to every device\nin between', size=8.5,
                  color=DEVICE_COLORS[3])

    pipeline(0.0, '(a) skip tensor passed along as an output', direct=False)
    pipeline(7.0, '(b) @skippable with portals', direct=True)
    save(fig, 'portals.svg')


# -- workers (torchgpipe.runtime.worker) -----------------------------------------------

def draw_workers() -> None:
    fig, ax = new_figure(9.0, 3.3, (-0.2, 13.4), (-0.6, 4.3))
    # The calling thread: the scheduler of torchgpipe.engine.pipeline.Pipeline.run.
    box(ax, 0.0, -0.3, 2.8, 4.1, '', color='#F2F2F2', edge=INK)
    label(ax, 1.4, 2.6, 'calling thread', weight='bold', size=9)
    label(ax, 1.4, 1.6, 'each clock cycle:\nfence (copies,\ndependencies),\nput tasks, '
          'get results,\nfinalize', size=8.5)
    devices = [('cuda:0', [0]), ('cuda:1', [1, 2]), ('cuda:2', [3])]
    for d, (device, partitions) in enumerate(devices):
        color = DEVICE_COLORS[d]
        yy = 3.05 - d * 1.4
        box(ax, 4.0, yy, 1.2, 0.5, 'in queue', color='white', size=8)
        box(ax, 4.0, yy - 0.6, 1.2, 0.5, 'out queue', color='white', size=8)
        box(ax, 6.2, yy - 0.6, 3.0, 1.1, '', color=LIGHT[color], edge=color)
        label(ax, 7.7, yy + 0.22, f'worker thread ({device})', size=8.5)
        parts = ', '.join(str(p) for p in partitions)
        label(ax, 7.7, yy - 0.3, f'partition{"s" if len(partitions) > 1 else ""} {parts}',
              size=8.5)
        arrow(ax, (2.8, yy + 0.25), (4.0, yy + 0.25), width=1)
        arrow(ax, (5.2, yy + 0.25), (6.2, yy + 0.25), width=1)
        arrow(ax, (6.2, yy - 0.35), (5.2, yy - 0.35), width=1)
        arrow(ax, (4.0, yy - 0.35), (2.8, yy - 0.35), width=1)
    label(ax, 11.4, 2.7, 'one thread per\ndistinct device;\npartitions on one\n'
          'device share it', size=8.5)
    label(ax, 11.4, 0.6, 'a single distinct\ndevice: no thread,\ntasks run in the\n'
          'calling thread', size=8.5)
    save(fig, 'workers.svg')


def draw_portal_functions() -> None:
    """What PortalBlue, PortalCopy and PortalOrange do, forward and backward."""
    fig, ax = new_figure(9.0, 3.6, (-0.2, 13.2), (-1.4, 4.1))
    columns = [(0.0, 0, 'stashing partition', 'PortalBlue',
                'hides the stashed\ntensor; its phony is\njoined into the\nlayer output'),
               (4.5, 2, 'fence of the pop\'s partition', 'PortalCopy',
                'moves the tensor to\nthe pop\'s device on\nthe copy streams'),
               (9.0, 2, 'popping partition', 'PortalOrange',
                'returns the tensor\nto the pop, back\nin the graph')]
    for x, j, title, name, text in columns:
        color = DEVICE_COLORS[j]
        label(ax, x + 2.0, 3.8, title, size=9, weight='bold')
        box(ax, x + 0.6, 2.6, 2.8, 0.7, name, color=color, edge=color, textcolor='white')
        label(ax, x + 2.0, 2.25, text, size=8.5, va='top')
    box(ax, 4.9, -0.45, 3.4, 0.7, 'Portal: tensor, grad', color='#F2F2F2', size=9)
    for x in (0.0, 4.5, 9.0):
        arrow(ax, (x + 2.0, 0.75), (6.6 + (x - 4.5) * 0.25, 0.3), color='#777777', dashed=True,
              width=1)
    arrow(ax, (3.4, 2.95), (5.1, 2.95))
    arrow(ax, (7.9, 2.95), (9.6, 2.95))
    label(ax, 6.6, -0.95, 'backward, in reverse: PortalOrange puts the gradient in the portal,\n'
          'PortalCopy moves it back, PortalBlue returns it to the stashed tensor', size=8.5)
    save(fig, 'portal_functions.svg')


FIGURES: Dict[str, Callable[[], None]] = {
    'clock_cycles.svg': draw_schedule,
    'bubble.svg': draw_bubble,
    'fork_join.svg': draw_fork_join,
    'copy_streams.svg': draw_copy_streams,
    'checkpoint.svg': draw_checkpoint,
    'portals.svg': draw_portals,
    'workers.svg': draw_workers,
    'portal_functions.svg': draw_portal_functions,
}


def main(names: Optional[Sequence[str]] = None) -> None:
    for name, draw in FIGURES.items():
        if names is None or name in names:
            draw()


if __name__ == '__main__':
    main()

"""What a timeline records, and what is computed from it: summaries, critical path, traces.

An :class:`Event` is one task or copy of a step, with the pieces of time its
own work ran in, named as a schedule writes actions
(:func:`~torchgpipe.engine.schedule.notation`): ``1F0``, ``1F'0`` (its
recomputation), ``1B0`` (``1I0``, ``1W0``), ``1C0`` (a copy into partition 1).
:func:`summarize` turns a step's events into a :class:`Summary`, :func:`plot_timeline` into a
Gantt chart (matplotlib, an optional dependency). Nothing here reads clocks: that is
:class:`~torchgpipe.timeline.Timeline`'s work.
"""
import os
from bisect import insort
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from torchgpipe.engine.schedule import Action, depends_on, notation
from torchgpipe.foundation.record import PREFIXES

__all__ = ['Event', 'Summary', 'DeviceSummary', 'PartitionSummary']

#: The kinds that keep a device busy (copies run on copy streams).
COMPUTE_KINDS = ('forward', 'recompute', 'backward', 'input', 'weight')
#: The kind of the events of each kind of action.
KINDS = {'F': 'forward', 'B': 'backward', 'I': 'input', 'W': 'weight'}
#: How the rows of what is not a device's compute end: its copies, its rank's messages.
SIDE_TRACKS = (' copies', ' messages')


@dataclass(frozen=True)
class Event:
    """One task of the pipeline, as it ran; times in seconds since the trace began."""

    #: ``'forward'``, ``'recompute'``, ``'backward'``, ``'input'`` (I), ``'weight'``
    #: (W), ``'copy'``, or across ranks ``'send'`` and ``'receive'`` (the wait).
    kind: str
    #: The micro-batch ``i``.
    micro_batch: int
    #: The partition ``j``; for a copy, the one it copies to (from, backward); for
    #: a message, the sender or receiver.
    partition: int
    #: The device the task ran on; for a copy, the device of its partition.
    device: str
    #: The row of the timeline, the device or its copies (the rank or its messages).
    track: str
    #: The name of the thread that ran it.
    thread: str
    #: When the task began and ended.
    start: float
    end: float
    #: Which traced call of the GPipe it belongs to, from 0.
    step: int
    #: The intervals in which the task's own work ran (one per autograd node, backward).
    pieces: Tuple[Tuple[float, float], ...] = ()
    #: Whether the task raised an exception.
    failed: bool = False
    #: What a copy moved and in which pass (``'skip, backward'``), or which message.
    detail: str = ''
    #: The rank of the process that ran it, across processes; else ``None``.
    rank: Optional[int] = None

    @property
    def name(self) -> str:
        """The task as a schedule writes actions, ``1F0`` for the forward pass of micro-batch
        0 on partition 1 (``jF'i`` a recomputation, ``jCi`` a copy, ``jSi`` and ``jRi`` a
        message sent and received)."""
        return notation(self.partition, PREFIXES[self.kind], self.micro_batch)

    @property
    def duration(self) -> float:
        """From start to end, in seconds."""
        return self.end - self.start

    @property
    def busy(self) -> float:
        """The time the task's own work ran in seconds, at most its duration."""
        return sum(end - start for start, end in self.pieces)


@dataclass(frozen=True)
class DeviceSummary:
    """How one device spent a step."""

    device: str
    #: Seconds in which at least one task ran on the device.
    busy: float
    #: The rest of the step.
    idle: float

    @property
    def bubble(self) -> float:
        """The idle fraction of the step."""
        total = self.busy + self.idle
        return self.idle / total if total > 0 else 0.0


@dataclass(frozen=True)
class PartitionSummary:
    """Seconds of each kind of task one partition ran in a step, over all micro-batches."""

    partition: int
    device: str
    forward: float
    recompute: float
    #: The backward passes, whole or split (I and W).
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.recompute + self.backward


@dataclass(frozen=True)
class Summary:
    """What a step cost, device by device; see :meth:`Timeline.summary`."""

    step: int
    #: Micro-batches and partitions of the step.
    micro_batches: int
    partitions: int
    #: The time from the first task's start to the last task's end, in seconds.
    step_time: float
    devices: List[DeviceSummary]
    #: The time each partition's tasks ran, to compare for ``balance``.
    partition_times: List[PartitionSummary]
    #: The chain of tasks, each waiting for the one before, that ends last.
    critical_path: List[Event]
    #: The peak memory of the trace per device in bytes (the allocator's on CUDA,
    #: the process's resident size on CPU, one figure for every CPU device).
    peak_memory: Dict[str, int]
    #: What the step was, ``'forward'`` (a call and its backward pass) or
    #: ``"train_step (schedule '1f1b')"``.
    kind: str = 'forward'
    #: The formula and value of the schedule's bubble (``None`` for GPipe's).
    expected: Optional[Tuple[str, float]] = None

    @property
    def bubble(self) -> float:
        """The idle fraction of the step over all devices."""
        idle = sum(d.idle for d in self.devices)
        total = sum(d.busy + d.idle for d in self.devices)
        return idle / total if total > 0 else 0.0

    @property
    def predicted_bubble(self) -> float:
        """The bubble of the step's schedule for equal tasks and no overhead, GPipe's
        ``(n-1) / (m+n-1)`` or a train_step schedule's (with F = I = W and B = 2)."""
        if self.expected is not None:
            return self.expected[1]
        n, m = self.partitions, self.micro_batches
        return (n - 1) / (m + n - 1)

    @property
    def formula(self) -> str:
        """The formula :attr:`predicted_bubble` follows."""
        return '(n-1)/(m+n-1)' if self.expected is None else self.expected[0]

    @property
    def critical_path_time(self) -> float:
        """The time the tasks of the critical path ran."""
        return sum(e.busy for e in self.critical_path)

    def __str__(self) -> str:
        ms = 1e3
        lines = [f'step {self.step}, {self.kind}: {self.micro_batches} micro-batches, '
                 f'{self.partitions} partitions, {self.step_time * ms:.2f} ms',
                 f'{"device":<12} {"busy ms":>9} {"idle ms":>9} {"bubble":>7} {"peak MiB":>9}']
        for d in self.devices:
            peak = self.peak_memory.get(d.device)
            peak_text = '-' if peak is None else f'{peak / 2**20:.1f}'
            lines.append(f'{d.device:<12} {d.busy * ms:>9.2f} {d.idle * ms:>9.2f} '
                         f'{d.bubble:>7.1%} {peak_text:>9}')
        lines.append(f'bubble {self.bubble:.1%} measured, {self.predicted_bubble:.1%} by '
                     f'{self.formula}')
        lines.append(f'{"partition":<12} {"forward":>9} {"recompute":>9} {"backward":>9} '
                     f'{"total ms":>9}')
        for p in self.partition_times:
            lines.append(f'{p.partition:<12} {p.forward * ms:>9.2f} {p.recompute * ms:>9.2f} '
                         f'{p.backward * ms:>9.2f} {p.total * ms:>9.2f}')
        path = ' '.join(e.name for e in self.critical_path)
        lines.append(f'critical path: {self.critical_path_time * ms:.2f} ms in tasks of '
                     f'{self.step_time * ms:.2f} ms: {path}')
        return '\n'.join(lines)


def summarize(step: int, micro_batches: int, devices: Sequence[str], kind: str,
              events: List[Event], peak_memory: Dict[str, int],
              expected: Optional[Tuple[str, float]] = None) -> Summary:
    """The summary of step ``step`` (of ``micro_batches``, a partition on each of ``devices``)
    from its ``events``; the other arguments are :class:`Summary`'s fields."""
    if not events:
        return Summary(step, micro_batches, len(devices), 0.0, [], [], [], peak_memory, kind,
                       expected)
    window = max(e.end for e in events) - min(e.start for e in events)

    device_summaries: List[DeviceSummary] = []
    for device in dict.fromkeys(devices):
        busy = union_length(piece for e in events
                            if e.track == device and e.kind in COMPUTE_KINDS
                            for piece in e.pieces)
        device_summaries.append(DeviceSummary(device, busy, window - busy))

    partition_times: List[PartitionSummary] = []
    for j, device in enumerate(devices):
        total = {'forward': 0.0, 'recompute': 0.0, 'backward': 0.0}
        for e in events:
            if e.partition == j and e.kind in COMPUTE_KINDS:
                # A split backward pass (I, W) counts as the backward pass.
                total[e.kind if e.kind in total else 'backward'] += e.busy
        partition_times.append(PartitionSummary(j, device, **total))

    return Summary(step, micro_batches, len(devices), window, device_summaries,
                   partition_times, critical_path(events, len(devices)), peak_memory, kind,
                   expected)


def chart_title(summaries: Sequence[Summary]) -> str:
    """The title of a chart of these steps, such as ``step 2: 4 partitions, 8 micro-batches:
    bubble 40% (formula 27%)``; over several steps, each figure's range."""
    def spread(values: Iterable[float], spec: str) -> str:
        texts = [format(v, spec) for v in sorted(values)]
        return texts[0] if texts[0] == texts[-1] else f'{texts[0]} to {texts[-1]}'

    which = 'step' if len(summaries) == 1 else 'steps'
    return (f'{which} {spread((s.step for s in summaries), "d")}: '
            f'{spread((s.partitions for s in summaries), "d")} partitions, '
            f'{spread((s.micro_batches for s in summaries), "d")} micro-batches: '
            f'bubble {spread((s.bubble for s in summaries), ".0%")} '
            f'(formula {spread((s.predicted_bubble for s in summaries), ".0%")})')


def segments(events: Sequence[Event]) -> List[Tuple[Event, float, float]]:
    """The events' pieces on each track, runs of one event's merged: the boxes a chart
    draws, never overlapping on a track."""
    found: List[Tuple[Event, float, float]] = []
    by_track: Dict[str, List[Tuple[float, float, int]]] = {}
    for index, e in enumerate(events):
        by_track.setdefault(e.track, []).extend((a, b, index) for a, b in e.pieces)
    for pieces in by_track.values():
        pieces.sort()
        run_start, run_end, owner = pieces[0]
        for start, end, index in pieces[1:]:
            if index == owner:
                run_end = max(run_end, end)
                continue
            found.append((events[owner], run_start, run_end))
            run_start, run_end, owner = start, end, index
        found.append((events[owner], run_start, run_end))
    return found


def union_length(intervals: Iterable[Tuple[float, float]]) -> float:
    """The total length covered by intervals, overlaps counted once."""
    total = 0.0
    reach = float('-inf')
    for start, end in sorted(intervals):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def critical_path(events: Sequence[Event], n: int) -> List[Event]:
    """The chain of tasks, each waiting for the one before it, that ends the step.

    From the task that ends last, walks back to whichever predecessor ended
    last before it started: the task before it on its device, or one it waits for
    (:func:`~torchgpipe.engine.schedule.depends_on`; a recomputation as its backward pass).
    """
    tasks = [e for e in events if e.kind in COMPUTE_KINDS]
    if not tasks:
        return []
    by_key = {(e.kind, e.micro_batch, e.partition): e for e in tasks}
    by_track: Dict[str, List[Tuple[float, int]]] = {}
    for index, e in enumerate(tasks):
        insort(by_track.setdefault(e.track, []), (e.end, index))

    def predecessors(e: Event) -> List[Event]:
        found: List[Event] = []
        # The latest task on the same device that ended before this started.
        for end, index in reversed(by_track[e.track]):
            if end <= e.start and tasks[index] is not e:
                found.append(tasks[index])
                break
        action = Action('B' if e.kind == 'recompute' else PREFIXES[e.kind], e.micro_batch,
                        e.partition)
        for need in depends_on(action, n, lambda i, j: ('input', i, j) in by_key):
            producer = by_key.get((KINDS[need.kind.value], need.i, need.j))
            if producer is not None and producer.end <= e.start:
                found.append(producer)
        return found

    path = [max(tasks, key=lambda e: e.end)]
    while True:
        before = predecessors(path[-1])
        if not before:
            break
        path.append(max(before, key=lambda e: e.end))
    path.reverse()
    return path


def chrome_trace(events: Sequence[Event]) -> Dict[str, Any]:
    """The events (of one process or every rank) as a Chrome trace,
    ``{'traceEvents': [...], 'displayTimeUnit': 'ms'}``, the JSON of Perfetto and
    ``chrome://tracing``: a process per rank (``torchgpipe`` for a GPipe), a track per
    device (or rank) and per its copies or messages; a message between ranks is a flow from
    the sender's ``send`` slice to the receiver's ``receive``::

        rank 0           [ 0F0 ]
        rank 0 messages         [S]─┐
        rank 1 messages    [   R    ]◄┘      the receive waited from its start
        rank 1                       [ 1F0 ]
    """
    pids = {rank: (0 if rank is None else rank)
            for rank in sorted({e.rank for e in events}, key=lambda r: -1 if r is None else r)}
    tracks = sorted({(e.rank, e.track) for e in events},
                    key=lambda t: (pids[t[0]], t[1].endswith(SIDE_TRACKS), t[1]))
    tids = {track: k for k, track in enumerate(tracks)}
    trace_events: List[Dict[str, Any]] = []
    for rank, pid in pids.items():
        trace_events.append({'ph': 'M', 'name': 'process_name', 'pid': pid, 'tid': 0,
                             'args': {'name': 'torchgpipe' if rank is None else f'rank {rank}'}})
    for (rank, track), tid in tids.items():
        for name, value in (('thread_name', {'name': track}),
                            ('thread_sort_index', {'sort_index': tid})):
            trace_events.append({'ph': 'M', 'name': name, 'pid': pids[rank], 'tid': tid,
                                 'args': value})
    for e, start, end in segments(events):
        args: Dict[str, Any] = {'micro_batch': e.micro_batch, 'partition': e.partition,
                                'kind': e.kind, 'step': e.step, 'device': e.device,
                                'thread': e.thread}
        if e.rank is not None:
            args['rank'] = e.rank
        if e.failed:
            args['failed'] = True
        if e.detail:
            args['detail'] = e.detail
        trace_events.append({'name': e.name, 'cat': e.kind, 'ph': 'X', 'pid': pids[e.rank],
                             'tid': tids[e.rank, e.track], 'ts': start * 1e6,
                             'dur': (end - start) * 1e6, 'args': args})
    for flow, (sent, received) in enumerate(messages(events)):
        # A flow binds to the slice around its timestamp: mid-send, and the receive's end.
        for phase, e, at in (('s', sent, (sent.start + sent.end) / 2),
                             ('f', received, received.end - min(received.duration / 2, 1e-6))):
            trace_events.append({'name': e.detail, 'cat': 'message', 'ph': phase, 'id': flow,
                                 'pid': pids[e.rank], 'tid': tids[e.rank, e.track],
                                 'ts': at * 1e6, **({'bp': 'e'} if phase == 'f' else {})})
    return {'traceEvents': trace_events, 'displayTimeUnit': 'ms'}


def messages(events: Sequence[Event]) -> List[Tuple[Event, Event]]:
    """Each message between ranks whose sending and receiving were both recorded (named
    alike on both sides, once per step)."""
    sent = {(e.step, e.detail): e for e in events if e.kind == 'send'}
    return [(sent[e.step, e.detail], e) for e in events
            if e.kind == 'receive' and (e.step, e.detail) in sent]


#: A colour per kind, and the legend's words for it.
COLORS: Dict[str, str] = {'forward': '#4c72b0', 'recompute': '#8fb0de', 'backward': '#dd8452',
                          'input': '#c44e52', 'weight': '#e8c07d', 'copy': '#55a868',
                          'send': '#555555', 'receive': '#cccccc'}
LABELS: Dict[str, str] = {'forward': 'forward F', 'recompute': "recompute F'",
                          'backward': 'backward B', 'input': 'input gradients I',
                          'weight': 'weight gradients W', 'copy': 'copy',
                          'send': 'send S', 'receive': 'wait to receive R'}
#: The kinds whose boxes are light: their text is black.
LIGHT = ('recompute', 'weight', 'receive')


def plot_timeline(segments: Sequence[Tuple[Event, float, float]],
                  path: Union[str, 'os.PathLike[str]'], title: Optional[str]) -> None:
    """Writes a chart of ``segments`` (as :func:`segments` gives them) to
    ``path``: a row per track, a box per segment, its action inside (``1F0``)."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            'Timeline.plot draws with matplotlib, which is not installed: '
            'pip install matplotlib (Timeline.save writes a JSON trace without it)',
            name=exc.name) from exc
    matplotlib.use('Agg', force=False)
    import matplotlib.pyplot as plt

    rows = len({e.track for e, _, _ in segments})
    figure, axes = plt.subplots(figsize=(12, 0.6 * rows + 1.6))
    try:
        draw_timeline(axes, segments, title)
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)


def draw_timeline(axes: Any, segments: Sequence[Tuple[Event, float, float]],
                  title: Optional[str] = None, *, legend: bool = True) -> None:
    """Draws the chart of :func:`plot_timeline` on matplotlib ``axes``, for a figure of one's
    own; ``legend`` puts the colours' legend below it."""
    from matplotlib.patches import Patch

    # Devices (or ranks) top to bottom in order, each followed by its
    # copies' (or messages') row.
    tracks = sorted({e.track for e, _, _ in segments}, key=side_last)
    rows = {track: k for k, track in enumerate(tracks)}
    end = max((b for _, _, b in segments), default=0.0)
    start = min((a for _, a, _ in segments), default=0.0)
    scale = 1e3  # milliseconds

    for e, a, b in segments:
        y = len(tracks) - 1 - rows[e.track]
        left, width = (a - start) * scale, (b - a) * scale
        # A copy between CPU devices takes microseconds: a sliver, without edge.
        sliver = (end - start) * scale / 800
        edge = 'black' if e.failed else 'white' if width > sliver else 'none'
        axes.barh(y, max(width, sliver), left=left, height=0.8, color=COLORS[e.kind],
                  edgecolor=edge, linewidth=0.5)
        # The action ('1F0') where it fits, else its micro-batch.
        for text in (e.name, str(e.micro_batch)):
            if width > len(text) * (end - start) * scale / 150:
                axes.text(left + width / 2, y, text, ha='center', va='center', fontsize=7,
                          color='black' if e.kind in LIGHT else 'white')
                break
    axes.set_yticks(range(len(tracks)), list(reversed(tracks)))
    axes.set_xlabel('time (ms)')
    axes.set_xlim(0, max((end - start) * scale, 1e-3))
    if legend:
        kinds = [k for k in COLORS if any(e.kind == k for e, _, _ in segments)]
        axes.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in kinds],
                    loc='upper center', bbox_to_anchor=(0.5, -0.18 - 0.1 / max(len(tracks), 1)),
                    ncol=len(kinds) or 1, frameon=False)
    if title:
        axes.set_title(title)


def side_last(track: str) -> Tuple[str, bool]:
    """Sorts a device's (or rank's) row of copies (or messages) right after its own."""
    for suffix in SIDE_TRACKS:
        if track.endswith(suffix):
            return track.removesuffix(suffix), True
    return track, False

"""The timeline of a pipeline: every task, where and when it really ran.

:func:`trace` records, for each step of a :class:`~torchgpipe.GPipe` inside it,
every forward task, recomputation, backward task and copy between devices,
measured rather than simulated, each named as a schedule writes its actions
(partition, kind, micro-batch): ``jFi`` for the forward pass of micro-batch
``i`` on partition ``j``, ``jF'i`` for its recomputation, ``jBi`` for its
backward pass. Paper, Figure 7, drawn from a run, a row per device (whose
partition's index the names leave out)::

    cpu:0  F0 F1 F2 F3                  F'3 B3 F'2 B2 ...
    cpu:1     F0 F1 F2 F3            F'3 B3 F'2 B2 ...
    cpu:2        F0 F1 F2 F3      F'3 B3 ...
    cpu:3           F0 F1 F2 F3 B3 B2 ...

How each kind is caught:

- forward tasks are timed by the worker that runs them, around the task;
- copies between devices are timed where the scheduler issues them;
- backward tasks and recomputations happen inside the autograd engine: when
  a forward task is done, the pipeline hands its output to the recorder,
  which walks the task's part of the autograd graph (from its outputs down
  to its inputs' nodes, the parameters' accumulators and the portals of skip
  connections) and hooks every node of it. ``jBi`` spans from the first of
  its nodes to start to the last to finish, once per backward pass (a graph
  kept by ``retain_graph=True`` gives one per pass).

The engine may run nodes of other tasks in between (on CPU it runs every
node of a backward pass in one thread, by its own priorities), so an event
keeps the *pieces* of time in which its own work ran; busy times add those up.

On CPU the times are wall-clock (:func:`time.perf_counter`). On CUDA they are
CUDA events recorded on the stream that ran the work, so they measure the
device rather than the launch; they are read once the device is synchronized.

Outside :func:`trace` none of this runs: a pipeline checks once per task
whether a recorder is attached.
"""
import json
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import (Any, Callable, Dict, Generator, Iterable, List, Optional,
                    Sequence, Tuple, TypeVar, Union)

import torch
from torch import Tensor

from torchgpipe.checkpoint import Recompute
from torchgpipe.copy import Copy, Wait
from torchgpipe.dependency import Fork, Join
from torchgpipe.gpipe import GPipe
from torchgpipe.skip.portal import PortalBlue, PortalCopy, PortalOrange
from torchgpipe.timeline.clock import Clock, Stamp, peak_rss, reset_peak_rss
from torchgpipe.timeline.events import (DeviceSummary, Event, PartitionSummary, Summary,
                                        chart_title, segments, summarize)

__all__ = ['trace', 'Timeline', 'Event', 'StepInfo', 'Summary', 'DeviceSummary',
           'PartitionSummary', 'segments']


T = TypeVar('T')


@dataclass
class Span:
    """An event being recorded: stamps not yet read."""

    kind: str
    micro_batch: int
    partition: int
    device: torch.device
    track: str
    step: int
    detail: str = ''
    thread: str = ''
    pieces: List[Tuple[Stamp, Stamp]] = field(default_factory=list)
    failed: bool = False


@dataclass
class StepInfo:
    """One traced call of the GPipe."""

    #: How many micro-batches the input was split into.
    micro_batches: int
    #: The device of each partition.
    devices: List[str]
    #: What the step was; see :attr:`Summary.kind`.
    kind: str = 'forward'
    #: Its schedule's bubble, formula and value, if not GPipe's.
    bubble: Optional[Tuple[str, float]] = None


class Timeline:
    """What :func:`torchgpipe.trace` yields: the events recorded, and views of them.

    The events of a step are complete once its backward pass is done; read
    them after the ``with`` block, or at least after ``backward()``.
    """

    def __init__(self) -> None:
        self.clock = Clock()
        self.closed = False
        #: Each traced call of the GPipe, in order; events refer to them by index.
        self.steps: List[StepInfo] = []
        self._spans: List[Span] = []
        self._lock = threading.Lock()
        self._peak_memory: Dict[str, int] = {}

    # Recording; called by the pipeline. ------------------------------------

    def begin_step(self, micro_batches: int, devices: Sequence[torch.device],
                   kind: str = 'forward', bubble: Optional[Tuple[str, float]] = None) -> int:
        """Starts a step; returns its index."""
        self.steps.append(StepInfo(micro_batches, [str(d) for d in devices], kind, bubble))
        return len(self.steps) - 1

    def _add(self, span: Span) -> Span:
        span.thread = threading.current_thread().name
        with self._lock:
            self._spans.append(span)
        return span

    def timed(self, kind: str, i: int, j: int, device: torch.device,
              function: Callable[[], T]) -> Callable[[], T]:
        """Wraps a task to record it when it runs, wherever that is."""
        step = len(self.steps) - 1

        def run() -> T:
            span = self._add(Span(kind, i, j, device, str(device), step))
            start = self.clock.stamp(device)
            try:
                return function()
            except BaseException:
                span.failed = True
                raise
            finally:
                span.pieces.append((start, self.clock.stamp(device)))
        return run

    def copied(self, i: int, j: int, device: torch.device, what: str,
               copy: Callable[[], Optional[Tensor]]) -> None:
        """Runs a copy into partition ``j`` and records it, if anything was copied, both ways.

        Args:
            what: ``'input'`` or ``'skip'``
            copy: makes the copy; returns a copied tensor, or ``None`` if
                nothing had to move
        """
        span = Span('copy', i, j, device, f'{device} copies', len(self.steps) - 1,
                    f'{what}, forward')
        start = self.clock.stamp(device)
        copied = copy()
        span.pieces.append((start, self.clock.stamp(device)))
        if copied is None:
            return
        self._add(span)
        if copied.grad_fn is not None:
            self._hook(copied.grad_fn, {}, Span('copy', i, j, device, span.track, span.step,
                                                f'{what}, backward'))

    def watch_backward(self, i: int, j: int, device: torch.device, outputs: Iterable[Tensor],
                       boundary: Iterable[Any]) -> None:
        """Hooks the autograd nodes of task ``(i, j)``'s backward pass and recomputation.

        Args:
            outputs: the task's outputs (after its recomputation was attached)
            boundary: the nodes of the task's inputs: the walk stops there
        """
        recompute, glue, ends = node_classes()
        step = len(self.steps) - 1
        stop = set(boundary)
        seen = set()
        stack = [x.grad_fn for x in outputs if x.grad_fn is not None]
        runs: Dict[str, Dict[int, Span]] = {'recompute': {}, 'backward': {}}
        while stack:
            node = stack.pop()
            if node in stop or node in seen:
                continue
            seen.add(node)
            forward_class = getattr(node, '_forward_cls', None)
            if type(node).__name__ == 'AccumulateGrad' or forward_class in ends:
                continue
            if forward_class is recompute:
                self._hook(node, runs['recompute'], Span('recompute', i, j, device,
                                                         str(device), step))
            elif forward_class not in glue:
                self._hook(node, runs['backward'], Span('backward', i, j, device,
                                                        str(device), step))
            stack.extend(n for n, _ in node.next_functions if n is not None)

    def _hook(self, node: Any, spans: Dict[int, Span], template: Span) -> None:
        # One span per backward pass (graph task) through the task's nodes,
        # opened by the first of them to start. Each node adds the piece of
        # time from its start to its end. Nodes of one task run on one
        # device's thread, in order, so on CUDA too the first stamp taken is
        # the earliest on that device's stream.
        started: Dict[int, Stamp] = {}

        def pre(grad_outputs: Any) -> None:
            if self.closed:
                return
            key = graph_task_id()
            if key not in spans:
                spans[key] = self._add(replace(template))
            started[key] = self.clock.stamp(template.device)

        def post(grad_inputs: Any, grad_outputs: Any) -> None:
            start = started.pop(graph_task_id(), None)
            if start is not None and not self.closed:
                spans[graph_task_id()].pieces.append((start, self.clock.stamp(template.device)))

        node.register_prehook(pre)
        node.register_hook(post)

    # Memory. ----------------------------------------------------------------

    def start_memory(self, devices: Iterable[torch.device]) -> None:
        for device in devices:
            if device.type == 'cuda':
                torch.cuda.reset_peak_memory_stats(device)
        reset_peak_rss()

    def stop_memory(self, devices: Iterable[torch.device]) -> None:
        rss = peak_rss()
        for device in devices:
            if device.type == 'cuda':
                self._peak_memory[str(device)] = torch.cuda.max_memory_allocated(device)
            else:
                self._peak_memory[str(device)] = rss

    # Views. -----------------------------------------------------------------

    @property
    def events(self) -> List[Event]:
        """Every event recorded so far, by start time."""
        with self._lock:
            spans = list(self._spans)
        events: List[Event] = []
        for s in spans:
            if not s.pieces:
                continue
            pieces = tuple((self.clock.seconds(a, s.device), self.clock.seconds(b, s.device))
                           for a, b in list(s.pieces))
            events.append(Event(s.kind, s.micro_batch, s.partition, str(s.device), s.track,
                                s.thread, min(a for a, _ in pieces), max(b for _, b in pieces),
                                s.step, pieces, s.failed, s.detail))
        events.sort(key=lambda e: (e.start, e.end))
        return events

    def summary(self, step: Optional[int] = None) -> Summary:
        """The cost of a step: busy and idle time per device, bubble, critical path, memory.

        Args:
            step (int, optional): which traced call, from 0; negative counts
                from the end (default: the last one)

        Returns:
            Summary: printable; its fields are documented in :class:`Summary`

        Raises:
            ValueError: no step was traced, or ``step`` is out of range
        """
        index = self._step_index(step)
        return self._summarize(index, [e for e in self.events if e.step == index])

    def _check_traced(self) -> None:
        """Raises ValueError if no step was traced: there is nothing to show."""
        if not self.steps:
            raise ValueError('the trace recorded no step: call the GPipe inside '
                             '"with torchgpipe.trace(model)"')

    def _step_index(self, step: Optional[int]) -> int:
        """The index of ``step`` (default: the last one), from 0.

        Raises:
            ValueError: no step was traced, or ``step`` is out of range
        """
        self._check_traced()
        index = len(self.steps) - 1 if step is None else step
        if not -len(self.steps) <= index < len(self.steps):
            raise ValueError(f'step must be in [{-len(self.steps)}, {len(self.steps) - 1}] '
                             f'(the trace has {len(self.steps)} steps), got {step}')
        return index % len(self.steps)

    def _summarize(self, index: int, events: List[Event]) -> Summary:
        """The summary of step ``index``, from its events."""
        info = self.steps[index]
        return summarize(index, info.micro_batches, info.devices, info.kind, events,
                         dict(self._peak_memory), info.bubble)

    def chrome_trace(self) -> Dict[str, Any]:
        """The events as a Chrome trace (the ``traceEvents`` format Perfetto reads)."""
        events = self.events
        tracks = sorted({e.track for e in events}, key=lambda t: (t.endswith(' copies'), t))
        tids = {track: k for k, track in enumerate(tracks)}
        trace_events: List[Dict[str, Any]] = [
            {'ph': 'M', 'name': 'process_name', 'pid': 0, 'tid': 0,
             'args': {'name': 'torchgpipe'}}]
        for track, tid in tids.items():
            trace_events.append({'ph': 'M', 'name': 'thread_name', 'pid': 0, 'tid': tid,
                                 'args': {'name': track}})
            trace_events.append({'ph': 'M', 'name': 'thread_sort_index', 'pid': 0, 'tid': tid,
                                 'args': {'sort_index': tid}})
        for e, start, end in segments(events):
            args: Dict[str, Any] = {'micro_batch': e.micro_batch, 'partition': e.partition,
                                    'kind': e.kind, 'step': e.step, 'device': e.device,
                                    'thread': e.thread}
            if e.failed:
                args['failed'] = True
            if e.detail:
                args['detail'] = e.detail
            trace_events.append({'name': e.name, 'cat': e.kind, 'ph': 'X', 'pid': 0,
                                 'tid': tids[e.track], 'ts': start * 1e6,
                                 'dur': (end - start) * 1e6, 'args': args})
        return {'traceEvents': trace_events, 'displayTimeUnit': 'ms'}

    def save(self, path: Union[str, 'os.PathLike[str]']) -> None:
        """Writes the timeline as a Chrome trace JSON file.

        Open it in https://ui.perfetto.dev or ``chrome://tracing``: one track
        per device and per device's copies; each event's ``args`` hold its
        ``micro_batch``, ``partition`` and ``kind``.

        Args:
            path: where to write, usually ``*.json``
        """
        Path(path).write_text(json.dumps(self.chrome_trace()))

    def plot(self, path: Union[str, 'os.PathLike[str]'], *, step: Optional[int] = None,
             title: Optional[str] = None) -> None:
        """Draws the timeline as a Gantt chart, one row per device, like the paper's Figure 7.

        Args:
            path: the image file to write (``.png``, or any format matplotlib knows)
            step (int, optional): draw only this step, counted as in
                :meth:`summary` (default: every step)
            title (str, optional): the chart's title (default: the figures
                of what is drawn: the steps, partitions and micro-batches,
                and the measured bubble beside the paper's formula; for
                several steps, the lowest and the highest of them)

        Raises:
            ValueError: no step was traced, or ``step`` is out of range, as
                in :meth:`summary`; no file is written then
            ModuleNotFoundError: matplotlib is not installed
        """
        from torchgpipe.timeline.plot import plot_timeline
        # Checked before anything is drawn: an empty chart would hide the mistake.
        self._check_traced()
        indices = range(len(self.steps)) if step is None else [self._step_index(step)]
        by_step: Dict[int, List[Event]] = {k: [] for k in indices}
        events = [e for e in self.events if e.step in by_step]
        for e in events:
            by_step[e.step].append(e)
        if title is None:
            title = chart_title([self._summarize(k, found) for k, found in by_step.items()])
        plot_timeline(segments(events), path, title)


def node_classes() -> Tuple[type, Tuple[type, ...], Tuple[type, ...]]:
    """The autograd functions a walk through a task's backward pass tells apart.

    Returns:
        :class:`~torchgpipe.checkpoint.Recompute`; the glue between tasks,
        walked through but not recorded (fork/join, copy/wait); and the
        portals of skips, where the task ends
    """
    return Recompute, (Fork, Join, Copy, Wait), (PortalBlue, PortalOrange, PortalCopy)


def graph_task_id() -> int:
    """The id of the backward pass running in this thread."""
    return int(torch._C._current_graph_task_id())


@contextmanager
def trace(module: Any) -> Generator[Timeline, None, None]:
    """Records the timeline of every forward and backward pass of a GPipe within the context.

    Args:
        module (GPipe): the pipeline to watch

    Yields:
        Timeline: the recorder; read :attr:`~torchgpipe.timeline.Timeline.events`,
        :meth:`~torchgpipe.timeline.Timeline.summary`,
        :meth:`~torchgpipe.timeline.Timeline.save` or
        :meth:`~torchgpipe.timeline.Timeline.plot` once the backward pass is done

    Raises:
        TypeError: ``module`` is not a GPipe
        RuntimeError: the GPipe is traced already

    Example::

        >>> import torchgpipe
        >>> model = GPipe(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
        ...               balance=[2, 1], devices=['cpu:0', 'cpu:1'], chunks=4)
        >>> with torchgpipe.trace(model) as timeline:
        ...     model(torch.randn(16, 8)).sum().backward()
        >>> sorted(e.name for e in timeline.events if e.kind == 'forward')
        ['0F0', '0F1', '0F2', '0F3', '1F0', '1F1', '1F2', '1F3']
        >>> summary = timeline.summary()  # print() it for a table
        >>> summary.micro_batches, summary.partitions
        (4, 2)
        >>> timeline.save('timeline.json')  # doctest: +SKIP
        >>> timeline.plot('timeline.png')  # doctest: +SKIP
    """
    if not isinstance(module, GPipe):
        raise TypeError(f'trace() watches a GPipe, got {type(module).__name__}: wrap the model '
                        'first, e.g. trace(GPipe(model, balance, chunks=...))')
    state = module._run_state
    if state.recorder is not None:
        raise RuntimeError('this GPipe is traced already: nest no trace() of the same GPipe '
                           'in another; one trace records every step inside it')
    timeline = Timeline()
    devices = list(dict.fromkeys(module.devices))
    timeline.start_memory(devices)
    state.recorder = timeline
    try:
        yield timeline
    finally:
        state.recorder = None
        timeline.stop_memory(devices)
        timeline.closed = True

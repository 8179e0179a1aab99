"""How a timeline records: the :class:`Timeline` the engine calls as its recorder, reading
wall-clock time on CPU, CUDA events on the stream that ran the work, and the process's peak
resident size on CPU."""
import json
import os
import resource
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import (Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, TypeVar,
                    Union)

import torch
from torch import Tensor

from torchgpipe.foundation.copy import Copy, Wait
from torchgpipe.foundation.dependency import Fork, Join
from torchgpipe.runtime.checkpoint import Recompute
from torchgpipe.skip.portal import PortalBlue, PortalCopy, PortalOrange
from torchgpipe.timeline.events import (Event, Summary, chart_title, chrome_trace,
                                        plot_timeline, segments, summarize)

__all__: List[str] = []

T = TypeVar('T')

# A moment: seconds from perf_counter on CPU, or a CUDA event to be read later.
Stamp = Union[float, Any]


class Clock:
    """Stamps moments on CPU or on a CUDA stream, and reads them in seconds since the start."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        # Per CUDA device: an event recorded at the origin, after a synchronize.
        self.cuda_origins: Dict[int, Any] = {}

    def stamp(self, device: torch.device) -> Stamp:
        if device.type != 'cuda':
            return time.perf_counter()
        index = device.index if device.index is not None else torch.cuda.current_device()
        if index not in self.cuda_origins:
            # The first use of a device: its events are read against this one.
            torch.cuda.synchronize(index)
            origin: Any = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            origin.record(torch.cuda.default_stream(index))
            torch.cuda.synchronize(index)
            self.cuda_origins[index] = (origin, time.perf_counter() - self.origin)
        event: Any = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(index))
        return event

    def seconds(self, stamp: Stamp, device: torch.device) -> float:
        if isinstance(stamp, float):
            return stamp - self.origin
        index = device.index if device.index is not None else torch.cuda.current_device()
        origin, offset = self.cuda_origins[index]
        stamp.synchronize()
        return float(offset + origin.elapsed_time(stamp) / 1e3)


def proc_status(key: str) -> Optional[int]:
    """A ``kB`` field of ``/proc/self/status`` in bytes, or ``None`` where there is none."""
    try:
        with open('/proc/self/status') as status:
            for line in status:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Resets the process's peak resident size (Linux); returns whether it could."""
    try:
        with open('/proc/self/clear_refs', 'w') as clear_refs:
            clear_refs.write('5')
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """The process's peak resident size in bytes, since :func:`reset_peak_rss` where it works."""
    peak = proc_status('VmHWM')
    if peak is not None:
        return peak
    # Elsewhere: the peak since the process started (kilobytes on Linux, bytes on macOS).
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(maxrss if sys.platform == 'darwin' else maxrss * 1024)

#: What a walk through a task's backward pass tells apart besides the recomputation: the
#: glue between tasks, walked through but not recorded; and the portals, where it ends.
GLUE = (Fork, Join, Copy, Wait)
ENDS = (PortalBlue, PortalOrange, PortalCopy)


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
    """What :func:`torchgpipe.trace` yields: the events recorded, and views of them. A
    step's events are complete once its backward pass is done. Across processes, ``places``
    names the row of each partition's tasks (``'rank 1'``), and ``rank`` this process."""

    def __init__(self, places: Optional[Sequence[str]] = None,
                 rank: Optional[int] = None) -> None:
        self.places = None if places is None else list(places)
        self.rank = rank
        #: The events of the other ranks, once gathered (see :meth:`gather`).
        self.gathered: List[Event] = []
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
        self.steps.append(StepInfo(micro_batches, [self.place(j, d) for j, d in enumerate(devices)],
                                   kind, bubble))
        return len(self.steps) - 1

    def place(self, j: int, device: torch.device) -> str:
        """The row of partition ``j``'s tasks: its device's, or its rank's."""
        return str(device) if self.places is None else self.places[j]

    def _add(self, span: Span) -> Span:
        span.thread = threading.current_thread().name
        with self._lock:
            self._spans.append(span)
        return span

    def timed(self, kind: str, i: int, j: int, device: torch.device,
              function: Callable[[], T]) -> T:
        """Runs a task, recorded."""
        span = Span(kind, i, j, device, self.place(j, device), len(self.steps) - 1)
        return self.timed_span(span, function)

    def copied(self, i: int, j: int, device: torch.device, what: str,
               copy: Callable[[], Optional[Tensor]]) -> None:
        """Runs ``copy`` into partition ``j`` (``what``: ``'input'`` or ``'skip'``) and records
        it both ways, if it copied anything (it returns the tensor, or ``None``)."""
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

    def messaged(self, kind: str, i: int, j: int, device: torch.device, message: str,
                 work: Callable[[], T]) -> T:
        """Runs the sending or receiving (``kind``) of a message between ranks, recorded; a
        receive spans its wait."""
        span = Span(kind, i, j, device, f'{self.place(j, device)} messages',
                    len(self.steps) - 1, message)
        return self.timed_span(span, work)

    def timed_span(self, span: Span, work: Callable[[], T]) -> T:
        """Runs ``work``, recorded as ``span``, failed if it raises."""
        self._add(span)
        start = self.clock.stamp(span.device)
        try:
            return work()
        except BaseException:
            span.failed = True
            raise
        finally:
            span.pieces.append((start, self.clock.stamp(span.device)))

    def watch_backward(self, i: int, j: int, device: torch.device, outputs: Iterable[Tensor],
                       boundary: Iterable[Any]) -> None:
        """Hooks the autograd nodes of task ``(i, j)``'s backward pass and recomputation, from
        its ``outputs`` down to the nodes of its inputs (``boundary``)."""
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
            if type(node).__name__ == 'AccumulateGrad' or forward_class in ENDS:
                continue
            if forward_class is Recompute:
                self._hook(node, runs['recompute'], Span('recompute', i, j, device,
                                                         str(device), step))
            elif forward_class not in GLUE:
                self._hook(node, runs['backward'], Span('backward', i, j, device,
                                                        str(device), step))
            stack.extend(n for n, _ in node.next_functions if n is not None)

    def _hook(self, node: Any, spans: Dict[int, Span], template: Span) -> None:
        # One span per backward pass (graph task), opened by the first node to start;
        # each node adds its piece of time (a task's nodes run in order on one thread).
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

    def stop_memory(self, places: Dict[str, torch.device]) -> None:
        """Reads the peak memory of each device, under the name of its row."""
        rss = peak_rss()
        for place, device in places.items():
            if device.type == 'cuda':
                self._peak_memory[place] = torch.cuda.max_memory_allocated(device)
            else:
                self._peak_memory[place] = rss

    def gather(self, group: Any, device: torch.device) -> None:
        """Takes in the events and the peak memory of every rank of ``group`` (each calls it;
        ``device``: one its backend communicates from)::

            rank 0: events of rank 0 ─┐                 ┌─► rank 0: events of ranks 0, 1, 2
            rank 1: events of rank 1 ─┼─ all_gather ────┼─► rank 1: events of ranks 0, 1, 2
            rank 2: events of rank 2 ─┘   (JSON bytes)  └─► rank 2: events of ranks 0, 1, 2

        As JSON, never pickled: a rank reads another's data, not its code.
        """
        # Imported here: ``import torchgpipe`` loads no torchgpipe.distributed.
        from torchgpipe.processes.core import all_gather_bytes
        mine = {'events': [asdict(e) for e in self.events], 'memory': self._peak_memory}
        for data in all_gather_bytes(json.dumps(mine).encode(), group, device):
            record: Dict[str, Any] = json.loads(data)
            for fields in record['events']:
                if fields['rank'] != self.rank:
                    fields['pieces'] = tuple((float(a), float(b)) for a, b in fields['pieces'])
                    self.gathered.append(Event(**fields))
            self._peak_memory.update({str(k): int(v) for k, v in record['memory'].items()})

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
                                s.step, pieces, s.failed, s.detail, self.rank))
        events.extend(self.gathered)
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

    def _step_index(self, step: Optional[int]) -> int:
        """The index of ``step`` (default: the last), from 0; ValueError if out of range, or
        if no step was traced: there is nothing to show."""
        if not self.steps:
            raise ValueError('the trace recorded no step: call the GPipe inside '
                             '"with torchgpipe.trace(model)"')
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
        """The events as a Chrome trace (:func:`~torchgpipe.timeline.events.chrome_trace`)."""
        return chrome_trace(self.events)

    def save(self, path: Union[str, 'os.PathLike[str]']) -> None:
        """Writes the timeline as a Chrome trace JSON file.

        Open it in https://ui.perfetto.dev or ``chrome://tracing``: a track per
        device and per device's copies (across processes, a process per rank, each
        message an arrow from sender to receiver).

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
            title (str, optional): the chart's title (default: the steps,
                partitions, micro-batches, and the bubble measured and by formula)

        Raises:
            ValueError: no step was traced, or ``step`` is out of range
            ModuleNotFoundError: matplotlib is not installed
        """
        # Checked before anything is drawn: an empty chart would hide the mistake.
        chosen = self._step_index(step)
        indices = range(len(self.steps)) if step is None else [chosen]
        by_step: Dict[int, List[Event]] = {k: [] for k in indices}
        events = [e for e in self.events if e.step in by_step]
        for e in events:
            by_step[e.step].append(e)
        if title is None:
            title = chart_title([self._summarize(k, found) for k, found in by_step.items()])
        plot_timeline(segments(events), path, title)


def graph_task_id() -> int:
    """The id of the backward pass running in this thread."""
    return int(torch._C._current_graph_task_id())

"""A timeline as a Chrome trace: the ``traceEvents`` JSON of Perfetto and ``chrome://tracing``.

A process per rank (``torchgpipe`` for a GPipe), a track per device (or
rank) and per its copies or messages; a message between ranks is a flow
from the sender's ``send`` slice to the receiver's ``receive``::

    rank 0           [ 0F0 ]
    rank 0 messages         [S]─┐
    rank 1 messages    [   R    ]◄┘      the receive waited from its start
    rank 1                       [ 1F0 ]
"""
from typing import Any, Dict, List, Sequence, Tuple

from torchgpipe.timeline.events import SIDE_TRACKS, Event, segments

__all__: List[str] = []


def chrome_trace(events: Sequence[Event]) -> Dict[str, Any]:
    """The events (of one process or every rank) as a Chrome trace,
    ``{'traceEvents': [...], 'displayTimeUnit': 'ms'}``."""
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

"""A trace across processes: every rank's events, gathered into each rank's timeline::

    rank 0: events of rank 0 ─┐                 ┌─► rank 0: events of ranks 0, 1, 2
    rank 1: events of rank 1 ─┼─ all_gather ────┼─► rank 1: events of ranks 0, 1, 2
    rank 2: events of rank 2 ─┘   (JSON bytes)  └─► rank 2: events of ranks 0, 1, 2

As JSON, never pickled: a rank reads another's data, not its code. The
clocks start right after a barrier that opens the trace.
"""
import json
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from torchgpipe.timeline.events import Event

__all__: List[str] = []


def gather(events: List[Event], memory: Dict[str, int], group: Optional[dist.ProcessGroup],
           device: torch.device) -> Tuple[List[Event], Dict[str, int]]:
    """Every rank's events and peak memory (by track), on every rank of ``group``; ``device``
    is one the group's backend communicates from."""
    # Imported here: ``import torchgpipe`` loads no torchgpipe.distributed.
    from torchgpipe.distributed.ranks import all_gather_bytes
    mine = json.dumps({'events': [asdict(e) for e in events], 'memory': memory}).encode()
    everyone: List[Event] = []
    peaks: Dict[str, int] = {}
    for data in all_gather_bytes(mine, group, device):
        record: Dict[str, Any] = json.loads(data)
        everyone.extend(decode(e) for e in record['events'])
        peaks.update({str(k): int(v) for k, v in record['memory'].items()})
    everyone.sort(key=lambda e: (e.start, e.end))
    return everyone, peaks


def decode(fields: Dict[str, Any]) -> Event:
    """An event from its JSON fields (lists back to tuples)."""
    fields['pieces'] = tuple((float(a), float(b)) for a, b in fields['pieces'])
    return Event(**fields)


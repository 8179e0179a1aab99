"""The recording interface: what the engine tells an attached recorder, and labels.

The engine calls this module, never the timeline: a :class:`Recorder` sits
in a GPipe's run state while :func:`torchgpipe.trace` is active, ``None``
otherwise (one check per task). :class:`~torchgpipe.timeline.Timeline`
implements it; :func:`label` names tasks for PyTorch's profiler.
"""
from contextlib import nullcontext
from typing import (Any, Callable, ContextManager, Iterable, List, Optional, Protocol, Sequence,
                    Tuple, TypeVar)

import torch
from torch import Tensor

__all__: List[str] = []

T = TypeVar('T')

#: How the name of an event of each kind starts.
PREFIXES = {'forward': 'F', 'recompute': "F'", 'backward': 'B', 'input': 'I', 'weight': 'W',
            'copy': 'C', 'send': 'S', 'receive': 'R'}


def label(kind: str, task: Tuple[int, int]) -> ContextManager[Any]:
    """Labels task ``(i, j)`` for a profiler as ``torchgpipe jFi`` (a schedule's notation),
    formatted only if a profiler records."""
    # A process-wide flag, cheaper than a record_function per task. The notation is
    # written again as this module is a leaf (tests/timeline/test_timeline.py checks both).
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(f'torchgpipe {task[1]}{PREFIXES[kind]}{task[0]}')
    return nullcontext()


class Recorder(Protocol):
    """What the engine calls on a recorder attached to a GPipe."""

    def begin_step(self, micro_batches: int, devices: Sequence[torch.device],
                   kind: str = 'forward', bubble: Optional[Tuple[str, float]] = None) -> int:
        """Starts a step (a call of the GPipe, or a train_step); returns its index. ``bubble``:
        its formula and value, if not GPipe's."""

    def timed(self, kind: str, i: int, j: int, device: torch.device,
              function: Callable[[], T]) -> T:
        """Runs and records the work of task ``(i, j)`` of a kind (``'forward'``...)."""

    def copied(self, i: int, j: int, device: torch.device, what: str,
               copy: Callable[[], Optional[Tensor]]) -> None:
        """Runs and records a copy into partition ``j`` (``what``: ``'input'`` or ``'skip'``)."""

    def watch_backward(self, i: int, j: int, device: torch.device, outputs: Iterable[Tensor],
                       boundary: Iterable[Any]) -> None:
        """Watches the backward pass of task ``(i, j)``, from its outputs to ``boundary``."""

    def messaged(self, kind: str, i: int, j: int, device: torch.device, message: str,
                 work: Callable[[], T]) -> T:
        """Runs and records ``work``, which sends (``'send'``) or waits for (``'receive'``) the
        message ``message`` of micro-batch ``i`` between ranks, on partition ``j``'s side."""


def run_task(recorder: Optional[Recorder], kind: str, i: int, j: int, device: torch.device,
             work: Callable[[], T]) -> T:
    """Runs the work of task ``(i, j)`` of a kind, labelled, recorded if a recorder is given."""
    with label(kind, (i, j)):
        return work() if recorder is None else recorder.timed(kind, i, j, device, work)

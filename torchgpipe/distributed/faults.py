"""What a rank raises when another fails, stops answering, or disagrees, and the words for it.

A step across processes ends on every rank, whatever happens on one:

- a rank that fails tells the others (:class:`PeerFailed`, with its error);
- a connection that breaks (a rank killed, between steps too) is a
  :class:`PeerFailed` naming the rank lost and what this rank was doing;
- a rank that sends nothing within the step timeout (stopped, stuck in a
  layer) is a :class:`StepTimeout`, naming the rank, its partition, and the
  message this rank waited for (its micro-batch, and the action it is for).

Point-to-point operations raise ``RuntimeError`` for all of these, as
anything else may; :func:`disconnected` marks theirs.
"""
from contextlib import contextmanager
from typing import Iterator, List, Optional

from torchgpipe.train.mailbox import Activation, Gradient, Key, Skip, SkipGradient
from torchgpipe.train.schedule import Action, Kind

__all__: List[str] = []


class PeerFailed(RuntimeError):
    """Another rank of the pipeline failed during the step, or stopped answering."""


class StepTimeout(PeerFailed):
    """Another rank sent nothing this rank waited for within the step timeout."""


class Disconnected(RuntimeError):
    """A point-to-point operation of torch.distributed failed: its connection broke or timed out."""


class TimedOut(Disconnected):
    """A point-to-point operation did not end by the step's deadline.

    Args:
        seconds: the step timeout
    """

    def __init__(self, message: str, seconds: float) -> None:
        super().__init__(message)
        self.seconds = seconds


@contextmanager
def disconnected() -> Iterator[None]:
    """Raises what a point-to-point operation raises (``RuntimeError``) as :class:`Disconnected`.

    Only those operations: a ``RuntimeError`` of anything else, such as a
    copy, is no lost connection.
    """
    try:
        yield
    except TimedOut:
        raise
    except RuntimeError as exc:
        raise Disconnected(str(exc)) from exc


@contextmanager
def lost(rank: Optional[int], j: Optional[int], doing: str) -> Iterator[None]:
    """Raises a broken or timed-out connection to ``rank`` (any: ``None``) as PeerFailed.

    torch.distributed raises it sending as receiving (gloo: "Connection
    closed by peer"), and :class:`~torchgpipe.distributed.wire.Channels` as
    :class:`Disconnected`: code that restarts a job on ``PeerFailed`` must
    see it as one.
    """
    try:
        yield
    except Disconnected as exc:
        peer = 'a rank' if rank is None else f'rank {rank} (partition {j})'
        if isinstance(exc, TimedOut):
            raise StepTimeout(f'{peer} did not answer within the step timeout '
                              f'({exc.seconds:g} s), while this rank was {doing}: it is '
                              'stopped, stuck, or far behind') from exc
        raise PeerFailed(f'lost {peer} while {doing}: {exc}') from exc


def waiting_for(key: Key) -> str:
    """What a rank waits for when it waits for the message of ``key``."""
    if isinstance(key, Activation):
        return (f'waiting for the input of micro-batch {key.i} (action '
                f'{Action(Kind.F, key.i, key.j)})')
    if isinstance(key, Gradient):
        return (f'waiting for the gradient of the output of micro-batch {key.i} (action '
                f'{Action(Kind.B, key.i, key.j)}, or {Action(Kind.I, key.i, key.j)})')
    name = key.key[1]
    if isinstance(key, Skip):
        return f"waiting for skip '{name}' of micro-batch {key.i}"
    assert isinstance(key, SkipGradient)
    return f"waiting for the gradient of skip '{name}' of micro-batch {key.i}"

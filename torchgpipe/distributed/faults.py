"""What a rank raises when another fails, stops answering, or disagrees, and the words for it.

A step across processes ends on every rank, whatever happens on one:

- a rank that fails tells the others (:class:`PeerFailed`, with its error);
- a connection that breaks (a rank killed, between steps too) is a
  :class:`PeerFailed` naming the rank lost and what this rank was doing;
- a rank that sends nothing within the step timeout (stopped, stuck in a
  layer) is a :class:`StepTimeout`, naming the rank, its partition, and the
  message this rank waited for (its micro-batch, and the action it is for);
- a rank that waits for another which waits in turn names the rank where
  the waiting starts, and the ranks between (:func:`timed_out`).

Whatever the error, ``PeerFailed.rank`` is the rank at fault, as named.

Point-to-point operations raise ``RuntimeError`` for all of these, as
anything else may; :func:`disconnected` marks theirs.
"""
from contextlib import contextmanager
from typing import Any, Iterator, List, Optional, Sequence, Tuple

from torchgpipe.engine.mailbox import Activation, Gradient, Key, Skip, SkipGradient
from torchgpipe.engine.schedule import Action, Kind

__all__: List[str] = []


class PeerFailed(RuntimeError):
    """Another rank of the pipeline failed during the step, or stopped answering.

    Attributes:
        rank (int or None): the global rank at fault, the one the message
            names first (``None``: unknown)
    """

    def __init__(self, message: str, rank: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank


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
    closed by peer"), and :class:`~torchgpipe.distributed.channels.Channels` as
    :class:`Disconnected`: code that restarts a job on ``PeerFailed`` must
    see it as one.
    """
    try:
        yield
    except TimedOut as exc:
        raise timed_out([(rank, j)], doing, exc.seconds) from exc
    except Disconnected as exc:
        raise lost_in([(rank, j)], doing, exc) from exc


#: The ranks a rank waited for, each with the partition waited for: the
#: first, then the rank that one waited for in turn, and so on.
Chain = Sequence[Tuple[Optional[int], Optional[int]]]


def peer(rank: Optional[int], j: Optional[int]) -> str:
    return 'a rank' if rank is None else f'rank {rank} (partition {j})'


def via(chain: Chain) -> str:
    """Whom the waiting went through, before the last rank of ``chain``: ``''`` if none."""
    if len(chain) < 2:
        return ''
    return f' from {peer(*chain[0])}' + ''.join(f', which was waiting for {peer(*link)}'
                                               for link in chain[1:])


def timed_out(chain: Chain, doing: str, seconds: float) -> 'StepTimeout':
    """The last rank of ``chain`` sent nothing within the step timeout.

    ``doing``: what this rank waited for, from the first rank of ``chain``.
    """
    return StepTimeout(f'{peer(*chain[-1])} did not answer within the step timeout '
                       f'({seconds:g} s), while this rank was {doing}{via(chain)}: it is '
                       'stopped, stuck, or far behind', chain[-1][0])


def lost_in(chain: Chain, doing: str, error: BaseException) -> PeerFailed:
    """The connection to the last rank of ``chain`` broke."""
    return PeerFailed(f'lost {peer(*chain[-1])} while {doing}{via(chain)}: {error}',
                      chain[-1][0])


def failed(chain: Chain, doing: str, word: Any) -> PeerFailed:
    """The last rank of ``chain`` sent word of its failure (``word['error']``)."""
    rank = chain[-1][0] if word['rank'] is None else word['rank']
    if len(chain) < 2:
        return PeerFailed(f'{peer(*chain[-1])} failed: {word["error"]}', rank)
    return PeerFailed(f'{peer(*chain[-1])} failed, while this rank was {doing}{via(chain)}: '
                      f'{word["error"]}', rank)


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

"""What a rank raises when another fails, stops answering, or disagrees, and the words for it.

A step across processes ends on every rank, whatever happens on one: a rank that fails
tells the others (:class:`PeerFailed`, with its error); a broken connection (a rank killed,
between steps too) is a :class:`PeerFailed` naming the rank lost and what this rank was
doing; a rank that sends nothing within the step timeout is a :class:`StepTimeout` naming
it, its partition and the message waited for, or the rank where a chain of waiting ranks
starts (:func:`timed_out`). ``PeerFailed.rank`` is the rank at fault, as named.
Point-to-point operations raise ``RuntimeError`` for all of these, as anything else may:
:mod:`~torchgpipe.transport.channels` raises theirs as :class:`Disconnected`.

A rank blocked with the failed one in a collective of another group (a data-parallel
peer's FSDP2 reduce-scatter) hears no word: it raises when the collective times out. The
failed rank also leaves its word in the job's store (``leave_word``), which that rank
reads then (``word_left``) to name it too.
"""
import json
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, cast

from torchgpipe.transport.codec import DTYPES, Unreadable

from torchgpipe.engine.mailbox import Activation, Gradient, Key, Skip, SkipGradient
from torchgpipe.engine.schedule import Action, Kind
from torchgpipe.foundation.validation import describe

__all__: List[str] = []

#: What a rank says as a step starts (see Wire.agree): its step, what it lacks, its problem.
Said = Tuple[Dict[str, Any], List[str], Optional[str]]


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


class TimedOut(Exception):
    """A point-to-point operation did not end by the step's deadline."""


#: The ranks waited for, with their partitions: the first, the one it waited for, and so on.
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
    """The last rank of ``chain`` sent nothing within the step timeout, while this rank
    was ``doing`` (waiting for the first rank of ``chain``)."""
    return StepTimeout(f'{peer(*chain[-1])} did not answer within the step timeout '
                       f'({seconds:g} s), while this rank was {doing}{via(chain)}: it is '
                       'stopped, stuck, or far behind', chain[-1][0])


def lost_in(chain: Chain, doing: str, error: BaseException) -> PeerFailed:
    """The connection to the last rank of ``chain`` broke."""
    return PeerFailed(f'lost {peer(*chain[-1])} while {doing}{via(chain)}: {error}',
                      chain[-1][0])


def failed(chain: Chain, doing: str, word: Any) -> PeerFailed:
    """The last rank of ``chain`` sent word of its failure (``word['error']``), or of the
    failure of ``word['rank']``, another, that stopped it."""
    rank = chain[-1][0] if word['rank'] is None else word['rank']
    what = 'failed' if rank == chain[-1][0] else 'stopped, as another rank failed'
    if len(chain) < 2:
        return PeerFailed(f'{peer(*chain[-1])} {what}: {word["error"]}', rank)
    return PeerFailed(f'{peer(*chain[-1])} {what}, while this rank was {doing}{via(chain)}: '
                      f'{word["error"]}', rank)


#: Where a failed rank leaves word of its failure, in the store every rank of the job shares.
STORE_KEY = 'torchgpipe/failure'


def job_store() -> Any:
    """torch.distributed's default store, which every rank of the job shares, or ``None``."""
    from torch.distributed import distributed_c10d
    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):  # no default group (or none such)
        return None


def leave_word(rank: int, j: int, error: BaseException) -> None:
    """Leaves word in the job's store that ``rank`` (partition ``j``) failed with ``error``."""
    store = job_store()
    word = {'rank': rank, 'partition': j, 'time': time.time(),
            'error': f'{type(error).__name__}: {error}'[:4096]}
    try:
        if store is not None:
            store.set(STORE_KEY, json.dumps(word))
    except RuntimeError:
        pass  # a courtesy to other groups' ranks: the failure itself is raised here


def word_left(me: int, since: float) -> Optional[PeerFailed]:
    """What to raise for the failure another rank left word of after ``since`` (seconds
    since the epoch, the last moment this rank knew all was well), or ``None``."""
    store = job_store()
    try:
        if store is None or not store.check([STORE_KEY]):
            return None
        word = json.loads(store.get(STORE_KEY))
    except RuntimeError:
        return None
    if word['rank'] == me or word['time'] < since:
        return None
    return PeerFailed(f"{peer(word['rank'], word['partition'])} failed: {word['error']}",
                      word['rank'])


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


class Mismatch(ValueError):
    """The ranks of a pipeline were called for different steps."""


def refusal(said: Dict[int, Said], first: int) -> Optional[Mismatch]:
    """Why the ranks cannot run the step each ``said`` (see :meth:`Wire.agree`), if they
    cannot; a rank given no data takes the sizes of ``first``, the first partition's rank."""
    errors = [(rank, error) for rank, (_, _, error) in sorted(said.items()) if error is not None]
    if errors:
        rank, error = errors[0]
        return Mismatch(f'rank {rank} cannot run the step: {error}')
    missing = [(rank, what) for rank, (_, lacking, _) in sorted(said.items()) for what in lacking]
    if missing:
        rank, what = missing[0]
        return Mismatch(describe(f'rank {rank} holds the {"first" if what == "input" else "last"} '
                                 f'partition and needs the {what}', f'{what}: None',
                                 f"pass it on rank {rank}: the first partition's rank needs "
                                 "the input, the last one's the target, and the others may "
                                 'pass None'))
    # The first partition's input is not shared: another rank may be given other data, or none.
    steps = {rank: {k: v for k, v in step.items() if k != 'input'}
             for rank, (step, _, _) in said.items()}
    sizes = steps[first]['micro-batches']
    # A rank given no data (None) runs the micro-batches of the first partition's rank.
    if any({**step, 'micro-batches': step['micro-batches'] or sizes} != steps[first]
           for step in steps.values()):
        return Mismatch(f'the ranks of the pipeline run different steps ({by_rank(steps)}); '
                        'give every rank the same mini-batch, chunks and schedule')
    return None


def by_rank(values: Dict[int, Any]) -> str:
    """Every rank's value, as a :class:`Mismatch` says them: ``rank 0: ...; rank 1: ...``."""
    return '; '.join(f'rank {rank}: {value}' for rank, value in sorted(values.items()))


def checked(word: Any, rank: int) -> Dict[str, Any]:
    """``word``, if it is one :class:`Wire` sends (of the start of a step, its end, or a
    failure), else ``Unreadable``."""
    def text(x: Any) -> bool:
        return x is None or type(x) is str

    def listed(x: Any, n: int) -> bool:
        return type(x) is list and len(x) == n
    # By its keys, whether the values of a word are those Wire sends.
    shapes: Dict[Tuple[str, ...], Callable[..., bool]] = {
        ('error', 'rank'): lambda error, at: type(error) is str and (at is None or type(at) is int),
        ('waiting',): lambda at: listed(at, 2) and all(type(x) is int for x in at),
        ('agree',): lambda said: listed(said, 3) and type(said[0]) is dict and text(said[2])
        and type(said[1]) is list and all(w in ('input', 'target') for w in said[1]),
        ('done',): lambda done: listed(done, 2) and text(done[0]) and tensors_described(done[1])}
    fits = shapes.get(tuple(word)) if type(word) is dict else None
    if fits is None or not fits(*word.values()):
        raise Unreadable(f'a word from rank {rank} is none this library sends: {word!r}'[:300])
    return cast(Dict[str, Any], word)


def read_header(data: bytes, rank: int) -> Tuple[Any, Any, Any]:
    """A message's header, sent by ``rank``: its key, its body and its tensors' shapes and
    types; ``Unreadable`` if it is none this library writes."""
    try:
        key, body, metas = json.loads(data.decode())
        if not tensors_described(metas):
            raise ValueError(f'not tensors: {metas!r}'[:200])
        key = tuple(key)
        hash(key)  # of plain values, as Wire.key_id makes it
    except (ValueError, TypeError, UnicodeDecodeError, RecursionError) as exc:
        raise Unreadable(f'a message from rank {rank} is none this library writes (not a '
                         f'header: {exc}); only the ranks of the pipeline may reach its ports'
                         ) from exc
    return key, body, metas


def tensors_described(metas: Any) -> bool:
    """Whether ``metas`` describes tensors: a shape and a type each."""
    return type(metas) is list and all(
        type(m) is list and len(m) == 2 and type(m[0]) is list and
        all(type(n) is int and n >= 0 for n in m[0]) and m[1] in DTYPES for m in metas)

"""The wire: a training step's messages between partitions in different processes.

:class:`~torchgpipe.engine.step.Step` sends and takes its messages through a
:class:`~torchgpipe.engine.mailbox.Mailbox`. :class:`Wire` is the mailbox of
the partitions of one process, whose neighbours may live in other processes:
a message to another rank is described with its key in a header of data
alone (:mod:`torchgpipe.distributed.codec`), and sent with torch.distributed's
point-to-point operations as that header and a payload of its tensors
(:class:`~torchgpipe.distributed.channels.Channels`); a message between
two partitions of this process (two virtual stages of one rank) stays in
the mailbox.

Sends never wait (``isend``): a rank only waits for what it needs, so a
schedule that :meth:`~torchgpipe.schedules.Schedule.check` accepts runs
without deadlock. Between two ranks, messages arrive in the order they were
sent, whatever the backend (NCCL has no tags), which need not be the order
the receiving rank takes them in (with several partitions per rank, or a
schedule of one's own). So every message carries its key, and a rank
waiting for one key keeps the messages that come before it, by key, for
the actions that will take them::

    rank 0 sends    Activation(0, 1)  Activation(0, 3)  Gradient(0, 1)
    rank 1 takes    Activation(0, 1)  Gradient(0, 1)    Activation(0, 3)
                                      ▲ receives Activation(0, 3) first: kept
"""
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

from torch import Tensor

# Channels: imported from here too, by DistributedGPipe.
from torchgpipe.distributed.channels import Channels as Channels
from torchgpipe.distributed.codec import Unreadable
from torchgpipe.distributed.faults import (Disconnected, PeerFailed, TimedOut, failed, lost,
                                           lost_in, timed_out, waiting_for)
from torchgpipe.engine.mailbox import (Activation, Gradient, Key, Mailbox, Skip, SkipGradient,
                                       SkipKey)
from torchgpipe.foundation.record import Recorder
from torchgpipe.foundation.validation import describe

__all__: List[str] = []

#: The route of a skip, (the partition that stashes it, the one that pops it).
Route = Tuple[int, int]
#: What a rank says as a step starts (see Wire.agree): its step, what it
#: lacks, and why it cannot run the step, if it cannot.
Said = Tuple[Dict[str, Any], List[str], Optional[str]]


class Mismatch(ValueError):
    """The ranks of a pipeline were called for different steps."""


class Wire(Mailbox):
    """The mailbox of this process's partitions, whose neighbours may be in other processes.

    Args:
        channels: the channels to the other ranks
        ranks: the global rank of each partition
        me: the global rank of this process
        routes: the route of each skip that crosses partitions, by key
        recorder: records each message to or from another rank, inside
            :func:`torchgpipe.trace`
    """

    def __init__(self, channels: Channels, ranks: Sequence[int], me: int,
                 routes: Dict[SkipKey, Route], recorder: Optional[Recorder] = None) -> None:
        super().__init__()
        self.channels = channels
        self.recorder = recorder
        self.ranks = ranks
        self.me = me
        self.routes = routes
        #: Every other rank of the pipeline, once.
        self.others = [r for r in dict.fromkeys(ranks) if r != me]
        #: The skips by index, which every rank numbers alike (in the order of
        #: the layers), while a skip's namespace differs from process to process.
        self.skips = list(routes)
        self.index = {key: k for k, key in enumerate(self.skips)}
        #: Whether this rank has told the others why it stops (see tell).
        self.told = False
        channels.alarm = self.tell

    def ends(self, key: Key) -> Route:
        """The partitions a message goes from and to."""
        if isinstance(key, Activation):
            return key.j - 1, key.j
        if isinstance(key, Gradient):
            return key.j + 1, key.j
        a, b = self.routes[key.key]
        return (a, b) if isinstance(key, Skip) else (b, a)

    def encode(self, key: Key) -> Any:
        """A key as it travels: a skip's by the skip's index."""
        if isinstance(key, (Skip, SkipGradient)):
            return (type(key).__name__, key.i, self.index[key.key])
        return key

    def decode(self, wired: Any) -> Key:
        if isinstance(wired, tuple):
            kind, i, k = wired
            return (Skip if kind == 'Skip' else SkipGradient)(i, self.skips[k])
        return cast(Key, wired)

    def name(self, key: Key) -> str:
        """What a message is, in words both its ranks write alike (a trace pairs them so)."""
        a, b = self.ends(key)
        kind = type(key).__name__
        if isinstance(key, (Skip, SkipGradient)):
            kind += f' #{self.index[key.key]}'
        return f'{kind} of micro-batch {key.i}, partition {a} to {b}'

    def put(self, key: Key, message: Any) -> None:
        source, j = self.ends(key)
        rank = self.ranks[j]
        if rank == self.me:
            super().put(key, message)
            return

        def send() -> None:
            with lost(rank, j, 'sending it a message'):
                self.channels.send(rank, 'message', (self.encode(key), message))
        if self.recorder is None:
            send()
        else:
            self.recorder.messaged('send', key.i, source, self.channels.device, self.name(key),
                                   send)

    def take(self, key: Key) -> Any:
        source, j = self.ends(key)
        if self.ranks[source] == self.me:
            return super().take(key)
        if self.recorder is None:
            return self.take_from(source, key)
        return self.recorder.messaged('receive', key.i, j, self.channels.device, self.name(key),
                                      lambda: self.take_from(source, key))

    def take_from(self, source: int, key: Key) -> Any:
        """Waits for the message under ``key`` from partition ``source``, in another rank."""
        if self.has(key):
            return super().take(key)
        while True:
            wired, message = self.receive(source, waiting_for(key))
            received = self.decode(wired)
            if received == key:
                return message
            # Sent before, for an action of this process still to come.
            super().put(received, message)

    def has(self, key: Key) -> bool:
        with self._condition:
            return key in self._messages

    def receive(self, j: int, doing: str, last: bool = False) -> Any:
        """Waits for the next message from the rank of partition ``j``; ``doing``
        says what for, if it never comes. Unless it is the ``last`` that rank
        sends in this step, the receives of the next are posted.

        Raises:
            PeerFailed: that rank failed, or the connection to it broke
            StepTimeout: it sent nothing by the step's deadline
        """
        rank = self.ranks[j]
        with lost(rank, j, doing):
            try:
                kind, message = self.channels.receive(rank, waiting={'waiting': [rank, j]},
                                                      ahead=not last)
            except TimedOut:
                kind, message = 'failure', None
        if kind == 'failure':
            raise self.blame(j, doing, message)
        if self.told:
            # It came after the deadline, once this rank had told the others
            # it waits for it: too late, the step is over.
            raise timed_out([(rank, j)], doing, self.channels.timeout or 0.0)
        return message

    def blame(self, j: int, doing: str, word: Any) -> PeerFailed:
        """What to raise when the rank of partition ``j`` sent word of its
        failure (``word``: see :meth:`tell`), or nothing (``None``) by the step's deadline.

        The rank at fault may be another: every rank's deadline falls at
        about the same moment, so a rank that waits for one waiting in turn
        for a stopped rank times out with it, and hears from neither. So a
        rank that times out, or hears that the rank it waits for did, first
        tells every other rank whom it waits for; then, within a grace of
        one more step timeout, it hears the rank it waited for, and the one
        that rank waited for, and so on, until a rank says it failed (named,
        as it said), or sends nothing, or a message instead (named as the
        one that did not answer). The grace is long enough: ranks start a
        step less than a timeout apart (they wait for each other's first
        word), so their deadlines fall less than a timeout apart::

            rank 0  waits for 1 ── deadline: "0 waits for 1" ── hears "1 waits for 2"
            rank 1  waits for 2 ── deadline: "1 waits for 2" ──┐    hears nothing from 2 │
            rank 2  stopped                                    └─ both name rank 2 ──────┘
        """
        seconds = self.channels.timeout or 0.0
        chain: List[Tuple[int, int]] = [(self.ranks[j], j)]
        if self.channels.closed():
            # Told at the deadline, then given the grace: that rank sent nothing.
            return timed_out(chain, doing, seconds)
        if word is not None:
            word = checked(word, chain[0][0])
        if word is None or 'waiting' in word:
            self.tell({'waiting': list(chain[0])})
        until = time.monotonic() + seconds
        while True:
            rank = chain[-1][0]
            if word is None:
                try:
                    word = self.word(rank, until, stale=len(chain) > 1)
                except Disconnected as exc:
                    return lost_in(chain, doing, exc)
                if word is None:
                    return timed_out(chain, doing, seconds)
            if 'waiting' not in word:
                return failed(chain, doing, word)
            link = (word['waiting'][0], word['waiting'][1])
            if link[0] == self.me or link[0] in (r for r, _ in chain):
                # Waiting for each other: no rank that started it.
                return timed_out(chain, doing, seconds)
            chain.append(link)
            word = None

    def word(self, rank: int, until: float, stale: bool) -> Optional[Dict[str, Any]]:
        """The word ``rank`` sends next, by ``until``; ``None`` if none, or
        if it sends a message first, unless ``stale`` (then skipped: the
        messages it sent this rank before it stopped).
        """
        while True:
            try:
                kind, message = self.channels.receive(rank, until)
            except TimedOut:
                return None
            if kind == 'failure':
                return checked(message, rank)
            if not stale:
                return None

    def finish(self, result: Any, shares: Optional[Dict[int, Any]] = None,
               ) -> Tuple[Any, Dict[int, Any]]:
        """Ends the step on every rank: returns what the last partition's rank
        sends everyone (a training step's loss).

        Each rank tells every other that it is done (the last partition's,
        with ``result``), then waits for the word of every other rank, and
        for its own sends to arrive. The word may carry more:
        ``shares[rank]`` to each rank (the gradients of tied parameters, say).

        Returns:
            the last partition's ``result``, and what each other rank's word carried

        Raises:
            PeerFailed: another rank failed in this step
        """
        shares = shares or {}
        shared = self.channels.shared
        for rank in self.others:
            # The word also says whether this rank read the other's shared memory.
            with lost(rank, self.ranks.index(rank), 'sending it the end of the step'):
                self.channels.send(rank, 'message',
                                   (None, (result, shares.get(rank), rank in shared.seen)))
        received: Dict[int, Any] = {}
        reads: Dict[int, bool] = {}
        for rank in self.others:
            _, (sent, received[rank], read) = self.receive(
                self.ranks.index(rank), 'waiting for the end of the step', last=True)
            reads[rank] = read is True
            if rank == self.ranks[-1]:
                result = owned(sent)
        # Each rank's last message: nothing of this step is posted ahead.
        assert not self.channels.pending
        # Every rank has said it is done: a send failing now failed on the way.
        with lost(None, None, "waiting for this rank's messages to arrive"):
            self.channels.wait_sent()
        self.channels.blocks.trim()
        shared.end_step(reads)
        self.channels.close()
        return result, received

    def agree(self, signature: Dict[str, Any], lacking: Sequence[str] = (),
              problem: Optional[Exception] = None) -> List[int]:
        """Starts a step: every rank tells every other what step it runs (the
        sizes of its micro-batches, the schedule), what it needs but was
        not given, and what it refuses, before any of its messages.

        A rank given no data says ``None`` for its sizes
        (``signature['micro-batches']``), and learns them here from the first
        partition's rank.

        Args:
            signature: the step, as this rank runs it
            lacking: what this rank needs and was not given: ``'input'`` (it
                holds the first partition), ``'target'`` (the last)
            problem: why this rank cannot run the step (what its arguments raised), if it
                cannot

        Returns:
            the sizes of the micro-batches

        Raises:
            Mismatch: the ranks run different steps, or a rank lacks what it
                needs, or cannot run it; every rank raises it, and the pipeline
                stays whole
            PeerFailed, StepTimeout: as :meth:`receive`
        """
        # With the step, the probe of this rank's shared memory, until the
        # ranks know who reads whose (see torchgpipe.distributed.shared).
        shared = self.channels.shared
        probe = shared.probe_word() if self.channels.sharing else None
        error = None if problem is None else f'{type(problem).__name__}: {problem}'
        for rank in self.others:
            with lost(rank, self.ranks.index(rank), 'sending it the start of the step'):
                self.channels.send(rank, 'message',
                                   (None, (signature, list(lacking), error, probe)))
        # Nothing posted ahead: if the ranks disagree, this step ends here,
        # and a receive posted for it would take the next step's message.
        said: Dict[int, Said] = {self.me: (signature, list(lacking), error)}
        for rank in self.others:
            step, needs, refused, theirs = self.receive(self.ranks.index(rank),
                                                        'waiting for the start of the step',
                                                        last=True)[1]
            said[rank] = (step, needs, refused)
            if self.channels.sharing:
                shared.test(rank, theirs)
        mismatch = refusal(said, self.ranks[0])
        if mismatch is not None:
            # Every rank has received this one's word: its buffers may go
            # back to the pool, for the next step's messages.
            with lost(None, None, "waiting for this rank's messages to arrive"):
                self.channels.wait_sent()
            self.channels.close()
            raise mismatch
        return cast(List[int], said[self.ranks[0]][0]['micro-batches'])

    def fail(self, error: BaseException) -> None:
        """Tells every other rank that this one failed, so none waits for it forever.

        The sends and receives in flight are never waited for: the step is
        over, and so is this pipeline (its ranks would not agree on which
        messages are left). The caller keeps ``channels`` alive, so that
        their buffers outlive them.
        """
        rank = error.rank if isinstance(error, PeerFailed) else self.me
        self.tell({'error': f'{type(error).__name__}: {error}', 'rank': rank})
        self.channels.close()

    def tell(self, word: Dict[str, Any]) -> None:
        """Sends every other rank word of this one's failure, once.

        A word is either ``{'error': description, 'rank': the rank at fault}``
        (``None``: unknown), or ``{'waiting': [rank, partition]}``: this
        rank stops, having waited for that rank's partition within the step
        timeout (or for a rank that did so in turn), and its receivers
        follow the waiting on (see :meth:`blame`).
        """
        if self.told:
            return
        self.told = True
        for rank in self.others:
            try:
                self.channels.send(rank, 'failure', word)
            except Disconnected:
                pass  # that rank is gone already


def refusal(said: Dict[int, Said], first: int) -> Optional[Mismatch]:
    """Why the ranks cannot run the step each said (see :meth:`Wire.agree`), if they cannot.

    Args:
        said: each rank's step, what it lacks and its error, by rank
        first: the rank of the first partition, whose sizes a rank given no data takes
    """
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
    steps = {rank: step for rank, (step, _, _) in said.items()}
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
    """``word``, if it is a word of failure as :meth:`Wire.tell` sends them.

    Raises:
        Unreadable: it is not
    """
    if isinstance(word, dict):
        if set(word) == {'error', 'rank'} and isinstance(word['error'], str) and \
                (word['rank'] is None or type(word['rank']) is int):
            return word
        link = word.get('waiting')
        if set(word) == {'waiting'} and type(link) is list and len(link) == 2 and \
                all(type(x) is int for x in link):
            return word
    raise Unreadable(f'a word of failure from rank {rank} is none this library sends: '
                     f'{word!r}'[:300])


def owned(message: Any) -> Any:
    """``message`` with each tensor copied, in tuples and lists too.

    A received tensor is a view of its message's buffer: one that outlives
    the step (a loss kept for logging) must not hold the buffer, which the
    pool gives to later messages.
    """
    if isinstance(message, Tensor):
        return message.clone()
    if type(message) in (tuple, list):
        return type(message)(owned(x) for x in message)
    return message

"""The wire: a step's messages between partitions in different processes.

:class:`Wire` is the :class:`~torchgpipe.engine.mailbox.Mailbox` of this process's
partitions: a message to another rank is its tensors at their exact sizes
(:class:`~torchgpipe.transport.channels.Channels`). A step starts with every rank's word
of what it runs (:meth:`Wire.agree`). The first step of a *signature* (the words of all
ranks) sends a header before each message (its key, its tensors' shapes and types, the rest
as data: :mod:`~torchgpipe.transport.codec`), and both ends keep the sequence. Later
steps send the tensors alone, each rank posting the receive of each other rank's next
message ahead, in the order that rank sends them::

    first step of a signature   rank 0: | header | x | header | x |  ...  (sequence kept)
    later steps                 rank 0: | x | x | ...   rank 1: receives posted as kept

A rank given its data computes at once, and reads the others' words before its first
message to or from another rank (:meth:`Wire.settle`): ranks that disagree send none. A
message that differs from its sequence fails the step on every rank. A step ends with every
rank's word that it is done, carrying the loss (:meth:`Wire.finish`), or that it failed.
"""
import json
import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor

from torchgpipe.engine.mailbox import (Activation, Gradient, Key, Mailbox, Skip, SkipGradient,
                                       SkipKey)
from torchgpipe.foundation.record import Recorder
from torchgpipe.foundation.validation import describe
from torchgpipe.transport.channels import (WORD_LIMIT, Channels, Metas, Received, host_bytes,
                                           metas_of)
from torchgpipe.transport.codec import Unreadable, decode, encode
from torchgpipe.transport.faults import (Disconnected, PeerFailed, Said, TimedOut, checked, failed,
                                         lost_in, read_header, refusal, timed_out, waiting_for)

__all__: List[str] = []

#: The route of a skip, (the partition that stashes it, the one that pops it).
Route = Tuple[int, int]
#: A message as a header describes it: its key, its body (codec.encode), its tensors.
Entry = Tuple[Any, Any, Metas]
#: The largest header, in bytes: a longer one is refused before its buffer is taken.
HEADER_LIMIT = 1 << 20
#: How many signatures each rank keeps the sequences of.
SIGNATURES = 64
#: Seconds a failing rank waits for the others to take its word: a rank in the step has
#: its receive posted already; one elsewhere (or no rank of this library) finds the break.
TOLD_WITHIN = 2.0


class Sequences:
    """A signature's messages in the order each rank sends them: this rank's to each other
    (JSON, to compare), each other's here, and where each key comes."""

    def __init__(self) -> None:
        self.sent: Dict[int, List[str]] = {}
        self.received: Dict[int, List[Entry]] = {}
        self.positions: Dict[int, Dict[Any, int]] = {}


class Wire(Mailbox):
    """The mailbox of this process's partitions (global rank ``me``; partition ``j`` on
    global rank ``ranks[j]``), over ``channels``; ``routes`` gives each skip between
    partitions its ends, ``known`` the sequences of the signatures run before, ``timeout``
    bounds the step, ``recorder`` records each message between ranks (:func:`torchgpipe.trace`)."""

    def __init__(self, channels: Channels, ranks: Sequence[int], me: int,
                 routes: Dict[SkipKey, Route], known: 'OrderedDict[str, Sequences]',
                 timeout: Optional[float], recorder: Optional[Recorder] = None) -> None:
        super().__init__()
        self.channels = channels
        self.recorder = recorder
        self.ranks = ranks
        self.me = me
        self.routes = routes
        self.known = known
        self.timeout = timeout
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.others = [r for r in dict.fromkeys(ranks) if r != me]
        self.partition_of = {r: ranks.index(r) for r in self.others}  # the first there
        # Skips by index, alike on every rank (a skip's namespace differs between processes).
        self.index = {key: k for k, key in enumerate(routes)}
        #: The sequences this step follows (a signature run before), or records.
        self.sequences = Sequences()
        self.recording = True
        self.signature = ''
        self.sent = dict.fromkeys(self.others, 0)
        #: Receives posted ahead, by rank and position, and the next position to post.
        self.posted: Dict[int, Dict[int, Received]] = {rank: {} for rank in self.others}
        self.next_post = dict.fromkeys(self.others, 0)
        #: Messages received before they were wanted (a recording step).
        self.early: Dict[Any, Any] = {}
        #: Each rank's word of its step (see agree), and then of its end.
        self.said: Dict[int, Said] = {}
        self.ends: Dict[int, Any] = {}
        #: Whether the start words were read (settle), and why this rank stops told (tell).
        self.settled = self.told = self.posted_ahead = False

    def ends_of(self, key: Key) -> Route:
        """The partitions a message goes from and to."""
        if isinstance(key, Activation):
            return key.j - 1, key.j
        if isinstance(key, Gradient):
            return key.j + 1, key.j
        a, b = self.routes[key.key]
        return (a, b) if isinstance(key, Skip) else (b, a)

    def key_id(self, key: Key) -> Tuple[str, int, int]:
        """A key alike on every rank: a skip's by the skip's index."""
        last = self.index[key.key] if isinstance(key, (Skip, SkipGradient)) else key.j
        return type(key).__name__, key.i, last

    def name(self, key: Key) -> str:
        """What a message is, in words both its ranks write alike (a trace pairs them so)."""
        (a, b), (kind, i, last) = self.ends_of(key), self.key_id(key)
        skip = f' #{last}' if isinstance(key, (Skip, SkipGradient)) else ''
        return f'{kind}{skip} of micro-batch {i}, partition {a} to {b}'

    def put(self, key: Key, message: Any) -> None:
        source, j = self.ends_of(key)
        rank = self.ranks[j]
        if rank == self.me:
            return super().put(key, message)
        self.settle()
        if self.recorder is None:
            return self.send(rank, j, key, message)
        self.recorder.messaged('send', key.i, source, self.channels.device, self.name(key),
                               lambda: self.send(rank, j, key, message))

    def send(self, rank: int, j: int, key: Key, message: Any) -> None:
        tensors: List[Tensor] = []
        described = json.dumps([self.key_id(key), encode(message, tensors), metas_of(tensors)])
        sent = self.sequences.sent.setdefault(rank, [])
        if self.recording:
            sent.append(described)
            header = torch.frombuffer(bytearray(described.encode()), dtype=torch.uint8)
            tensors[:0] = [torch.tensor([header.numel()]), header]
        else:
            p = self.sent[rank]
            if p >= len(sent) or sent[p] != described:
                expected = 'nothing' if p >= len(sent) else sent[p]
                raise ValueError(describe(
                    f'the {self.name(key)} differs from the same message in the first step '
                    'with these inputs', f'{described[:200]}, then: {expected[:200]}',
                    'DistributedGPipe sends a step\'s tensors at the shapes of the first step '
                    'of the same input shapes and schedule: make the shapes (and values other '
                    'than tensors) a partition sends depend on its input shapes alone (pad '
                    'them)'))
            self.sent[rank] = p + 1
        with self.lost(rank, j, 'sending it a message'):
            self.channels.send(rank, tensors)

    def take(self, key: Key) -> Any:
        source, j = self.ends_of(key)
        if self.ranks[source] == self.me:
            return super().take(key)
        self.settle()
        if self.recorder is None:
            return self.take_from(source, key)
        return self.recorder.messaged('receive', key.i, j, self.channels.device, self.name(key),
                                      lambda: self.take_from(source, key))

    def take_from(self, source: int, key: Key) -> Any:
        """Waits for the message under ``key`` from partition ``source``, in another rank."""
        rank, wanted, doing = self.ranks[source], self.key_id(key), waiting_for(key)
        if not self.recording:
            p = self.sequences.positions[rank][wanted]
            self.post(rank, p + 1)  # and the next one, ahead of the compute
            received = self.posted[rank].pop(p)
            self.wait(received, rank, source, doing)
            return self.decode(self.sequences.received[rank][p][1], received.tensors, rank)
        while wanted not in self.early:
            length = self.receive(rank, source, doing, [([1], 'int64')])[0]
            if not 0 < int(length) <= HEADER_LIMIT:
                raise Unreadable(f'a message from rank {rank} has a header of {int(length)} '
                                 'bytes')
            header = self.receive(rank, source, doing, [([int(length)], 'uint8')])[0]
            entry = read_header(host_bytes(header), rank)
            self.sequences.received.setdefault(rank, []).append(entry)
            tensors = self.receive(rank, source, doing, entry[2])
            self.early[entry[0]] = self.decode(entry[1], tensors, rank)
        return self.early.pop(wanted)

    def decode(self, body: Any, tensors: List[Tensor], rank: int) -> Any:
        """A message from ``rank``, its body (JSON data, or its bytes) with its tensors;
        ``Unreadable`` if it holds what no rank sends."""
        try:
            if isinstance(body, (bytes, str)):
                body = json.loads(body)
            return decode(body, tensors, self.channels.device)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            raise Unreadable(f'a message from rank {rank} holds what no rank sends ({exc})'
                             ) from exc

    def post(self, rank: int, until: int) -> None:
        """Posts the receives from ``rank`` up to position ``until``, in its order."""
        entries = self.sequences.received.get(rank, [])
        while self.next_post[rank] <= min(until, len(entries) - 1):
            p = self.next_post[rank]
            with self.lost(rank, self.partition_of[rank], 'receiving from it'):
                self.posted[rank][p] = self.channels.post(rank, entries[p][2])
            self.next_post[rank] = p + 1

    def receive(self, rank: int, j: int, doing: str, metas: Metas) -> List[Tensor]:
        """Receives tensors of ``metas`` from ``rank``, now."""
        with self.lost(rank, j, doing):
            received = self.channels.post(rank, metas)
        self.wait(received, rank, j, doing)
        return received.tensors

    def wait(self, received: Received, rank: int, j: int, doing: str) -> None:
        """Waits for operations with ``rank`` (partition ``j``) until the step's deadline:
        ``PeerFailed`` if a rank failed or a connection broke, ``StepTimeout`` past it."""
        if not self.posted_ahead:  # the next step's two words, where they cost it nothing
            self.posted_ahead = True
            for other in self.others:
                with self.lost(other, self.partition_of[other], 'receiving from it'):
                    self.channels.post_words(other, 2)
        try:
            self.channels.wait(received, self.deadline)
        except TimedOut:
            raise self.blame(rank, j, doing, None) from None
        except Disconnected as exc:
            raise self.broken(rank, j, doing, exc) from exc

    def event(self, rank: int, j: int, doing: str) -> None:
        """Waits for the next word, while waiting for ``rank``'s partition ``j``: keeps
        a word of the start or the end of a step, raises one of failure, or a lost one."""
        try:
            kind, source, value = self.channels.next_event(self.deadline)
        except TimedOut:
            self.tell({'waiting': [rank, j]})
            raise self.blame(rank, j, doing, None) from None
        if kind == 'lost':
            raise self.broken(source, self.partition_of[source], doing, value)
        word = self.hear(source, value)
        if word is not None and ('error' in word or 'waiting' in word and source == rank):
            raise self.blame(source, self.partition_of[source], doing, word)

    @contextmanager
    def lost(self, rank: int, j: int, doing: str) -> Iterator[None]:
        """Raises a broken connection to ``rank`` (partition ``j``), sending as receiving,
        as :meth:`broken` says: code that restarts a job on it must see a PeerFailed."""
        try:
            yield
        except Disconnected as exc:
            raise self.broken(rank, j, doing, exc) from exc

    def broken(self, rank: int, j: int, doing: str, error: BaseException) -> PeerFailed:
        """What to raise when the connection to ``rank`` broke while this rank was
        ``doing``: the failure ``rank`` told before it ended, if its word came, the ranks
        it waited for if it timed out (its wait's timeout closed the connection), else
        the break; ``rank``'s word is read first (:meth:`end_word`)."""
        word, _ = self.end_word(rank, time.monotonic() + TOLD_WITHIN)  # it precedes the closing
        if word is not None and 'waiting' in word:
            return self.blame(rank, j, doing, word)
        if word is not None and 'error' in word:
            return failed([(rank, j)], doing, word)
        return lost_in([(rank, j)], doing, error)

    def end_word(self, rank: int, until: float) -> Tuple[Optional[Dict[str, Any]],
                                                         Optional[BaseException]]:
        """The word ``rank`` ends its step with, read by ``until`` (``None`` if none came),
        and the error that broke its connection, if one did. A thread reports each word's
        receive, so a word may be reported after the break that followed it: reading stops
        once every receive of ``rank``'s words has ended, not at the first break."""
        error = None
        while self.ends.get(rank) is None and self.channels.expects_word(rank):
            try:
                kind, source, value = self.channels.next_event(until)
            except TimedOut:
                break
            if kind == 'word':
                self.hear(source, value)
            elif source == rank:
                error = value
        return self.ends.get(rank), error

    def hear(self, source: int, value: Any) -> Optional[Dict[str, Any]]:
        """Keeps a word from ``source``: of its step's start, or else of its end (returned)."""
        word = checked(value, source)
        if 'agree' in word:
            self.said[source] = cast(Said, tuple(word['agree']))
            return None
        self.ends[source] = word
        return word

    def agree(self, signature: Dict[str, Any], lacking: Sequence[str] = (),
              problem: Optional[Exception] = None) -> List[int]:
        """Starts a step: tells every other rank the step this one runs (``signature``:
        micro-batch sizes, ``None`` if given no data, schedule, input), what it ``lacks``
        (``'input'``, ``'target'``) and the ``problem`` that makes it refuse the step.
        Returns the sizes of the micro-batches: this rank's, or, given no data, the first
        partition's rank's, once every rank's word is read (:meth:`settle`, which raises
        :class:`Mismatch <torchgpipe.transport.faults.Mismatch>` on every rank if they
        disagree, the pipeline whole)."""
        error = None if problem is None else f'{type(problem).__name__}: {problem}'[:4096]
        self.said[self.me] = (signature, list(lacking), error)
        for rank in self.others:
            with self.lost(rank, self.partition_of[rank], 'sending it the start of the step'):
                self.channels.expect_word(rank)  # its start
                self.channels.expect_word(rank)  # its end, or its failure
                self.channels.send_word(rank, {'agree': list(self.said[self.me])})
        if signature['micro-batches'] is not None and not lacking and error is None:
            return cast(List[int], signature['micro-batches'])  # settled at its first message
        self.settle()
        return cast(List[int], self.said[self.ranks[0]][0]['micro-batches'])

    def settle(self) -> None:
        """Reads every rank's word of its step, once: raises :class:`Mismatch
        <torchgpipe.transport.faults.Mismatch>` if they disagree, else posts the first
        receives of the signature, if run before."""
        if self.settled:
            return
        self.settled = True
        for rank in self.others:
            while rank not in self.said:
                self.event(rank, self.partition_of[rank], 'waiting for the start of the step')
        mismatch = refusal(self.said, self.ranks[0])
        if mismatch is not None:
            self.finish(None)  # a step without messages: the pipeline stays whole
            raise mismatch
        first = self.said[self.ranks[0]][0]
        self.signature = json.dumps([{**self.said[rank][0], 'micro-batches':
                                      first['micro-batches'], 'input': first.get('input')}
                                     for rank in sorted(self.said)], sort_keys=True)
        known = self.known.get(self.signature)
        if known is not None:
            self.known.move_to_end(self.signature)
            self.sequences, self.recording = known, False
            for rank in self.others:
                self.post(rank, 0)

    def finish(self, result: Any, shares: Optional[Dict[int, Any]] = None,
               ) -> Tuple[Any, Dict[int, Any]]:
        """Ends the step: tells every other rank it is done, with its ``result`` and
        ``shares[rank]`` (gradients of tied parameters), waits for theirs (``PeerFailed``
        if one failed) and for its sends. Returns the last partition's ``result`` and what
        each other rank sent here."""
        self.settle()
        ends: Dict[int, List[Tensor]] = {}
        for rank in self.others:
            tensors: List[Tensor] = []
            body = json.dumps(encode((result, (shares or {}).get(rank)), tensors, inline=True))
            inline = len(body) <= WORD_LIMIT // 2  # else sent as the first tensor
            ends[rank] = tensors if inline else [
                torch.frombuffer(bytearray(body.encode()), dtype=torch.uint8), *tensors]
            with self.lost(rank, self.partition_of[rank], 'sending it the end of the step'):
                self.channels.send_word(rank, {'done': [body if inline else None,
                                                        metas_of(ends[rank])]})
        for rank, tensors in ends.items():
            with self.lost(rank, self.partition_of[rank], 'sending it the end of the step'):
                self.channels.send(rank, tensors)
        received: Dict[int, Any] = {}
        doing = 'waiting for the end of the step'
        for rank in self.others:
            j = self.partition_of[rank]
            while self.ends.get(rank) is None:
                self.event(rank, j, doing)
            if 'done' not in self.ends[rank]:
                raise self.blame(rank, j, doing, self.ends[rank])
            told, metas = self.ends[rank]['done']
            theirs = self.receive(rank, j, doing, metas)
            if told is None:
                told, theirs = host_bytes(theirs[0]), theirs[1:]
            sent, received[rank] = self.decode(told, theirs, rank)
            if rank == self.ranks[-1]:
                result = sent
        # A rank's end says it took every message of this rank: those sends have ended, and
        # only the end's own tensors may wait for their receives.
        for rank, sending in self.channels.sent().items():
            self.wait(sending, rank, self.partition_of[rank],
                      'waiting for it to take the messages of this rank')
        if self.recording and self.signature:
            self.sequences.positions = {rank: {key: p for p, (key, _, _) in enumerate(entries)}
                                        for rank, entries in self.sequences.received.items()}
            self.known[self.signature] = self.sequences
            while len(self.known) > SIGNATURES:
                self.known.popitem(last=False)
        return result, received

    def blame(self, rank: int, j: int, doing: str, word: Any) -> PeerFailed:
        """What to raise when ``rank`` (partition ``j``) sent word of its failure
        (``word``: see :meth:`tell`), or nothing (``None``) by the step's deadline.

        The rank at fault may be another: deadlines fall at about the same
        moment, so a rank waiting for one that waits for a stopped rank times
        out with it. So a rank that times out tells every other whom it waits
        for, then, within a grace of one more timeout, follows the words of
        the ranks waited for until one says it failed, or says nothing::

            rank 0  waits for 1 ── deadline: "0 waits for 1" ── hears "1 waits for 2"
            rank 1  waits for 2 ── deadline: "1 waits for 2" ──┐    hears nothing from 2 │
            rank 2  stopped                                    └─ both name rank 2 ──────┘
        """
        seconds = self.timeout or 0.0
        chain: List[Tuple[int, int]] = [(rank, j)]
        if word is None or 'waiting' in word:
            self.tell({'waiting': [rank, j]})
        until = time.monotonic() + seconds
        while True:
            if word is None:
                word, error = self.end_word(chain[-1][0], until)
                if word is None:
                    return timed_out(chain, doing, seconds) if error is None else \
                        lost_in(chain, doing, error)
            if 'done' in word:
                return timed_out(chain, doing, seconds)
            if 'waiting' not in word:
                return failed(chain, doing, word)
            link = (word['waiting'][0], word['waiting'][1])
            if link[0] == self.me or link in chain:
                # Waiting for each other: no rank that started it.
                return timed_out(chain, doing, seconds)
            chain.append(link)
            word = None

    def fail(self, error: BaseException) -> None:
        """Tells every other rank that this one failed, so none waits for it forever.
        The operations in flight are left: the step is over, and so is the pipeline."""
        rank = error.rank if isinstance(error, PeerFailed) else self.me
        words = self.tell({'error': f'{type(error).__name__}: {error}'[:4096], 'rank': rank})
        # The connections close next (Channels.abandon), and a gloo send ends only once
        # its receive is posted: the others take the word first, or learn only the break.
        until = min(time.monotonic() + TOLD_WITHIN, self.deadline or float('inf'))
        for sending in words.values():
            try:
                self.channels.wait(sending, until, words=True)
            except (TimedOut, Disconnected):
                pass

    def tell(self, word: Dict[str, Any]) -> Dict[int, Received]:
        """Sends every other rank, once, the word this one ends its step with:
        ``{'error': description, 'rank': the rank at fault or None}``, or
        ``{'waiting': [rank, partition]}`` (see :meth:`blame`). Returns the sends."""
        sends: Dict[int, Received] = {}
        if self.told:
            return sends
        self.told = True
        for rank in self.others:
            try:
                sends[rank] = self.channels.send_word(rank, word)
            except Disconnected:
                pass  # that rank is gone already
        return sends

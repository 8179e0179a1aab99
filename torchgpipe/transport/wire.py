"""The wire: a step's messages between partitions in different processes.

:class:`Wire` is the :class:`~torchgpipe.engine.mailbox.Mailbox` of this
process's partitions. A message to another rank is its tensors, sent at
their exact sizes (:class:`~torchgpipe.transport.channels.Channels`); a
message between two partitions of this process stays in the mailbox.

A step starts with every rank's word of what it runs (:meth:`Wire.agree`).
The first step of a *signature* (the words of all ranks: micro-batches,
input shapes, schedule) sends a header before each message (its key, the
shapes and types of its tensors, and what else it holds, as data:
:mod:`~torchgpipe.transport.codec`), and both ends keep the sequence of
messages. A later step of the same signature sends the tensors alone, each
rank posting the receives of the next message from each rank ahead, in the
order the sender sends them, which need not be the order it takes them::

    first step of a signature   rank 0: | header | x | header | x |  ...  (sequence kept)
    later steps                 rank 0: | x | x | ...   rank 1: receives posted as kept

A sender checks each message against the sequence: one that differs (a
layer whose output shape depends on the values) fails the step, on every
rank, rather than reaching a buffer of another size. A step ends with every
rank's word that it is done, which carries the loss (:meth:`Wire.finish`),
or of its failure (:meth:`Wire.tell`): no rank waits for one that failed.
"""
import json
import time
from collections import OrderedDict
from contextlib import suppress
from typing import Any, Dict, List, Optional, Sequence, Tuple, cast

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
                                         lost, lost_in, read_header, refusal, timed_out,
                                         waiting_for)

__all__: List[str] = []

#: The route of a skip, (the partition that stashes it, the one that pops it).
Route = Tuple[int, int]
#: A message as a header describes it: its key, its body (codec.encode), its tensors.
Entry = Tuple[Any, Any, Metas]
#: The largest header, in bytes: a longer one is refused before its buffer is taken.
HEADER_LIMIT = 1 << 20
#: How many signatures each rank keeps the sequences of.
SIGNATURES = 64


class Sequences:
    """The messages of a step of one signature, in the order each rank sends them:
    this rank's to each other (as JSON, to compare), and each other's to this one."""

    def __init__(self) -> None:
        self.sent: Dict[int, List[str]] = {}
        self.received: Dict[int, List[Entry]] = {}
        #: Where each key comes in each rank's sequence, by its JSON.
        self.positions: Dict[int, Dict[str, int]] = {}

    def index(self) -> None:
        self.positions = {rank: {json.dumps(key): p for p, (key, _, _) in enumerate(entries)}
                          for rank, entries in self.received.items()}


class Wire(Mailbox):
    """The mailbox of this process's partitions, whose neighbours may be in other processes.

    Args:
        channels: the channels to the other ranks
        ranks: the global rank of each partition
        me: the global rank of this process
        routes: the route of each skip that crosses partitions, by key
        known: the sequences of the signatures run before, kept by the caller
        timeout: the step timeout, in seconds (``None``: none)
        recorder: records each message to or from another rank, inside
            :func:`torchgpipe.trace`
    """

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
        #: When the step times out, by ``time.monotonic()``.
        self.deadline = None if timeout is None else time.monotonic() + timeout
        #: Every other rank of the pipeline, once.
        self.others = [r for r in dict.fromkeys(ranks) if r != me]
        #: The skips by index, which every rank numbers alike (in the order of
        #: the layers), while a skip's namespace differs from process to process.
        self.skips = list(routes)
        self.index = {key: k for k, key in enumerate(self.skips)}
        #: The sequences this step follows (a signature run before), or records.
        self.sequences = Sequences()
        self.recording = True
        self.signature = ''
        self.sent = {rank: 0 for rank in self.others}
        #: Receives posted ahead, by rank and position, and the next position to post.
        self.posted: Dict[int, Dict[int, Received]] = {rank: {} for rank in self.others}
        self.next_post = {rank: 0 for rank in self.others}
        #: Messages received before they were wanted (a recording step).
        self.early: Dict[str, Any] = {}
        #: Each rank's word of what step it runs, and then of its end.
        self.agreed: Dict[int, Any] = {}
        self.ends: Dict[int, Any] = {}
        #: Whether this rank has told the others why it stops (see tell).
        self.told = False

    def ends_of(self, key: Key) -> Route:
        """The partitions a message goes from and to."""
        if isinstance(key, Activation):
            return key.j - 1, key.j
        if isinstance(key, Gradient):
            return key.j + 1, key.j
        a, b = self.routes[key.key]
        return (a, b) if isinstance(key, Skip) else (b, a)

    def key_id(self, key: Key) -> Any:
        """A key as JSON data, alike on every rank: a skip's by the skip's index."""
        if isinstance(key, (Skip, SkipGradient)):
            return [type(key).__name__, key.i, self.index[key.key]]
        return [type(key).__name__, key.i, key.j]

    def name(self, key: Key) -> str:
        """What a message is, in words both its ranks write alike (a trace pairs them so)."""
        a, b = self.ends_of(key)
        kind = type(key).__name__
        if isinstance(key, (Skip, SkipGradient)):
            kind += f' #{self.index[key.key]}'
        return f'{kind} of micro-batch {key.i}, partition {a} to {b}'

    def put(self, key: Key, message: Any) -> None:
        source, j = self.ends_of(key)
        rank = self.ranks[j]
        if rank == self.me:
            super().put(key, message)
            return

        def send() -> None:
            with lost(rank, j, 'sending it a message'):
                self.send(rank, key, message)
        if self.recorder is None:
            send()
        else:
            self.recorder.messaged('send', key.i, source, self.channels.device, self.name(key),
                                   send)

    def send(self, rank: int, key: Key, message: Any) -> None:
        tensors: List[Tensor] = []
        entry = [self.key_id(key), encode(message, tensors), metas_of(tensors)]
        described = json.dumps(entry)
        sent = self.sequences.sent.setdefault(rank, [])
        if self.recording:
            sent.append(described)
            header = torch.frombuffer(bytearray(described.encode()), dtype=torch.uint8)
            self.channels.send(rank, [torch.tensor([header.numel()]), header, *tensors])
            return
        p = self.sent[rank]
        if p >= len(sent) or sent[p] != described:
            expected = 'nothing' if p >= len(sent) else sent[p]
            raise ValueError(describe(
                f'the {self.name(key)} differs from the same message in the first step with '
                'these inputs', f'{described[:200]}, then: {expected[:200]}',
                'DistributedGPipe sends a step\'s tensors at the shapes of the first step of '
                'the same input shapes and schedule: make the shapes (and values other than '
                'tensors) a partition sends depend on its input shapes alone (pad them)'))
        self.sent[rank] = p + 1
        self.channels.send(rank, tensors)

    def take(self, key: Key) -> Any:
        source, j = self.ends_of(key)
        if self.ranks[source] == self.me:
            return super().take(key)
        if self.recorder is None:
            return self.take_from(source, key)
        return self.recorder.messaged('receive', key.i, j, self.channels.device, self.name(key),
                                      lambda: self.take_from(source, key))

    def take_from(self, source: int, key: Key) -> Any:
        """Waits for the message under ``key`` from partition ``source``, in another rank."""
        rank = self.ranks[source]
        wanted = json.dumps(self.key_id(key))
        doing = waiting_for(key)
        if not self.recording:
            p = self.sequences.positions[rank][wanted]
            self.post(rank, p + 1)  # and the next one, ahead of the compute
            received = self.posted[rank].pop(p)
            self.wait(received, rank, source, doing)
            return self.decode(self.sequences.received[rank][p][1], received.tensors, rank)
        while wanted not in self.early:
            entry, tensors = self.receive_described(rank, source, doing)
            self.sequences.received.setdefault(rank, []).append(entry)
            self.early[json.dumps(entry[0])] = self.decode(entry[1], tensors, rank)
        return self.early.pop(wanted)

    def decode(self, body: Any, tensors: List[Tensor], rank: int) -> Any:
        """A message from ``rank``: its body (JSON, or its bytes) with its tensors.

        Raises:
            Unreadable: it holds what no rank sends
        """
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
            with lost(rank, self.partition_of(rank), 'receiving from it'):
                self.posted[rank][p] = self.channels.post(rank, entries[p][2])
            self.next_post[rank] = p + 1

    def partition_of(self, rank: int) -> int:
        return self.ranks.index(rank)

    def receive_described(self, rank: int, j: int, doing: str) -> Tuple[Entry, List[Tensor]]:
        """The next message from ``rank``, its header first: the header read, and its tensors.

        Raises:
            Unreadable: the header is none this library writes
        """
        length = self.receive(rank, j, doing, [([1], 'int64')])[0]
        size = int(length.item())
        if not 0 < size <= HEADER_LIMIT:
            raise Unreadable(f'a message from rank {rank} has a header of {size} bytes')
        key, body, metas = read_header(
            host_bytes(self.receive(rank, j, doing, [([size], 'uint8')])[0]), rank)
        return (key, body, metas), self.receive(rank, j, doing, metas)

    def receive(self, rank: int, j: int, doing: str, metas: Metas) -> List[Tensor]:
        """Receives tensors of ``metas`` from ``rank``, now."""
        with lost(rank, j, doing):
            received = self.channels.post(rank, metas)
        self.wait(received, rank, j, doing)
        return received.tensors

    def wait(self, received: Received, rank: int, j: int, doing: str) -> None:
        """Waits for operations with ``rank`` (partition ``j``), hearing the words that come.

        Raises:
            PeerFailed: that rank (or another) failed, or the connection broke
            StepTimeout: nothing came by the step's deadline
        """
        if received.done:
            return
        self.channels.watch(received, rank)
        while not received.done:
            self.event(rank, j, doing)

    def event(self, rank: int, j: int, doing: str) -> None:
        """Waits for the next operation to end, while waiting for ``rank``'s partition ``j``:
        keeps a word of the start or the end of a step, raises one of failure."""
        try:
            kind, source, value = self.channels.next_event(self.deadline)
        except TimedOut:
            self.tell({'waiting': [rank, j]})
            raise self.blame(rank, j, doing, None) from None
        if kind == 'lost':
            raise lost_in([(source, self.partition_of(source))], doing, value)
        if kind != 'word':
            return
        word = checked(value, source)
        if 'agree' in word:
            self.agreed[source] = word['agree']
            with lost(source, self.partition_of(source), 'receiving from it'):
                self.channels.expect_word(source)  # its end, or its failure
        elif 'error' in word or 'waiting' in word and source == rank:
            raise self.blame(source, self.partition_of(source), doing, word)
        else:  # done, or waiting for another: heard when this rank's own wait ends
            self.ends[source] = word

    def agree(self, signature: Dict[str, Any], lacking: Sequence[str] = (),
              problem: Optional[Exception] = None) -> List[int]:
        """Starts a step: every rank tells every other the step it runs
        (``signature``: micro-batch sizes, ``None`` if given no data, schedule,
        input), what it ``lacks`` (``'input'``, ``'target'``), and the
        ``problem`` that makes it refuse the step, if any. Returns the sizes
        of the micro-batches, the first partition's rank's.

        Raises:
            Mismatch: on every rank, if the ranks run different steps, or one
                lacks what it needs or refuses; the pipeline stays whole
            PeerFailed, StepTimeout: a rank failed, or did not answer
        """
        error = None if problem is None else f'{type(problem).__name__}: {problem}'[:4096]
        for rank in self.others:
            with lost(rank, self.partition_of(rank), 'sending it the start of the step'):
                self.channels.expect_word(rank)
                self.channels.send_word(rank, {'agree': [signature, list(lacking), error]})
        for rank in self.others:
            while rank not in self.agreed:
                self.event(rank, self.partition_of(rank), 'waiting for the start of the step')
        said = {self.me: (signature, list(lacking), error),
                **{rank: cast(Said, tuple(word)) for rank, word in self.agreed.items()}}
        mismatch = refusal(said, self.ranks[0])
        if mismatch is not None:
            self.finish(None)  # a step without messages: the pipeline stays whole
            raise mismatch
        sizes = cast(List[int], said[self.ranks[0]][0]['micro-batches'])
        steps = [{**said[rank][0], 'micro-batches': sizes,
                  'input': said[self.ranks[0]][0].get('input')} for rank in sorted(said)]
        self.signature = json.dumps(steps, sort_keys=True)
        known = self.known.get(self.signature)
        if known is not None:
            self.known.move_to_end(self.signature)
            self.sequences, self.recording = known, False
            for rank in self.others:
                self.post(rank, 0)
        return sizes

    def finish(self, result: Any, shares: Optional[Dict[int, Any]] = None,
               ) -> Tuple[Any, Dict[int, Any]]:
        """Ends the step: every rank tells every other it is done, with its
        ``result`` and ``shares[rank]`` (gradients of tied parameters), and
        waits for theirs, and for its sends to end. Returns the last
        partition's ``result`` and what each other rank sent this one.

        Raises:
            PeerFailed: another rank failed in this step
        """
        shares = shares or {}
        for rank in self.others:
            tensors: List[Tensor] = []
            body: Optional[str] = json.dumps(encode((result, shares.get(rank)), tensors,
                                                    inline=True))
            if len(cast(str, body)) > WORD_LIMIT // 2:  # sent as the first tensor
                data = bytearray(cast(str, body).encode())
                tensors.insert(0, torch.frombuffer(data, dtype=torch.uint8))
                body = None
            with lost(rank, self.partition_of(rank), 'sending it the end of the step'):
                self.channels.send_word(rank, {'done': [body, metas_of(tensors)]})
                self.channels.send(rank, tensors)
        received: Dict[int, Any] = {}
        doing = 'waiting for the end of the step'
        for rank in self.others:
            j = self.partition_of(rank)
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
        # Sends read their tensors until they end: the step returns once they have.
        for rank, sending in self.channels.sent().items():
            self.wait(sending, rank, self.partition_of(rank),
                      'waiting for it to take the messages of this rank')
        if self.recording and self.signature:
            self.sequences.index()
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
                word = self.end_word(chain[-1][0], until)
                if isinstance(word, BaseException):
                    return lost_in(chain, doing, word)
                if word is None or 'done' in word:
                    return timed_out(chain, doing, seconds)
            if 'waiting' not in word:
                return failed(chain, doing, word)
            link = (word['waiting'][0], word['waiting'][1])
            if link[0] == self.me or link in chain:
                # Waiting for each other: no rank that started it.
                return timed_out(chain, doing, seconds)
            chain.append(link)
            word = None

    def end_word(self, rank: int, until: float) -> Any:
        """The word ``rank`` ends its step with, by ``until``: ``None`` if none
        comes, the error if its connection breaks."""
        while self.ends.get(rank) is None:
            try:
                kind, source, value = self.channels.next_event(until)
            except TimedOut:
                return None
            if kind == 'lost' and source == rank:
                return cast(BaseException, value)
            if kind == 'word' and 'agree' in checked(value, source):
                with suppress(Disconnected):  # far behind: its end may come yet
                    self.channels.expect_word(source)
            elif kind == 'word':
                self.ends[source] = value
        return self.ends[rank]

    def fail(self, error: BaseException) -> None:
        """Tells every other rank that this one failed, so none waits for it forever.
        The operations in flight are left: the step is over, and so is the pipeline."""
        rank = error.rank if isinstance(error, PeerFailed) else self.me
        self.tell({'error': f'{type(error).__name__}: {error}'[:4096], 'rank': rank})

    def tell(self, word: Dict[str, Any]) -> None:
        """Sends every other rank, once, the word this one ends its step with:
        ``{'error': description, 'rank': the rank at fault or None}``, or
        ``{'waiting': [rank, partition]}`` (see :meth:`blame`)."""
        if self.told:
            return
        self.told = True
        for rank in self.others:
            try:
                self.channels.send_word(rank, word)
            except Disconnected:
                pass  # that rank is gone already

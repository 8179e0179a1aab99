"""Shared memory: the payloads of messages between ranks of one host, without the sockets.

Over gloo, a message's payload crosses a TCP connection even between two
processes of one machine: the kernel copies it into the socket and out of
it, in the calling threads of both ranks, which costs several times a plain
copy (about 0.7 ms for a MiB against 0.06 ms, measured on the CPU machine
of ``docs/benchmarks.rst``). Between ranks that see the same ``/dev/shm``,
a sender instead copies a payload into an *arena*, a file there that both
map, and sends the header alone, which says where the payload is; the
receiver copies it out into its own buffer::

    rank 0                      /dev/shm/torchgpipe-...   rank 1
    payload --copy--> | message 0 | message 1 | ... |  --copy--> buffer
    header (gloo) ---------------------------------------------> "at 0"

Within a step, the messages to a rank take the arena one after the other;
the next step starts over at its beginning, because by the end of a step
every rank has taken every message sent to it (see
:meth:`~torchgpipe.distributed.wire.Wire.finish`). An arena too small for a
step is replaced by one twice as large, the old kept until the step ends.

Whether a rank reads another's arenas is tested, not assumed (containers of
one host may not share ``/dev/shm``): the start of a step carries a probe,
a small file holding a random token, and the end of the step says whether
the other rank read it. From the next step on, the payloads to each rank
that read it go through shared memory. An arena's file is removed by the
rank it is for, once mapped; the probe by its maker once the first step
ends, or when the process ends. Those of a process killed before are
removed by the first to probe an hour or more later.
"""
import mmap
import os
import re
import secrets
import stat
import time
import weakref
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import Tensor

from torchgpipe.distributed.codec import Unreadable, align

__all__: List[str] = []

#: Where arenas are made; none if it is not a writable folder.
ROOT = '/dev/shm'

#: The largest arena for one rank, in bytes: the payloads beyond it in a
#: step go through the process group, as without shared memory.
LIMIT = 1 << 30

#: The smallest arena.
SMALLEST = 1 << 20

#: How old, in seconds, a file of a process that is gone must be to be
#: removed by another: a process of another PID namespace sharing the folder
#: may only look gone, and it maps an arena within a step.
STALE = 3600

#: The names of arenas (and probes): only such files are ever opened.
NAME = re.compile(r'torchgpipe-[0-9]{1,10}-[0-9a-f]{16}-[0-9]{1,10}\Z')


class Arena:
    """A file of shared memory, mapped."""

    def __init__(self, name: str, memory: Tensor) -> None:
        self.name = name
        self.memory = memory


class Shared:
    """This rank's arenas for the ranks of its host, and theirs it reads.

    Kept by :class:`~torchgpipe.distributed.core.RankCore` from step to
    step, used by :class:`~torchgpipe.distributed.channels.Channels`.
    """

    def __init__(self) -> None:
        self.prefix = f'torchgpipe-{os.getpid()}-{secrets.token_hex(8)}'
        self.count = 0
        #: This process's files made in this step, removed when it ends at the latest
        #: (a step that does not end has no reader left for them).
        self.files: List[str] = []
        weakref.finalize(self, remove, self.files)
        #: Those made in the last step that ended, which their readers may not
        #: have mapped yet: the end of a step may come through one, and a rank
        #: may end its step, and drop its pipeline, before another reads that end.
        #: Their readers remove them; this rank, once the next step ends.
        self.awaited: List[str] = []
        #: The probe's name and token, once made (None where no shared memory is).
        self.probe: Optional[Tuple[str, str]] = None
        #: Whether a step ended since, so that the ranks know who reads whose arenas.
        self.decided = False
        #: The ranks whose probe this rank read, and those that read its own.
        self.seen: Set[int] = set()
        self.readers: Set[int] = set()
        #: The ranks whose payloads come through shared memory, those this
        #: rank told it read their probe, as the last step ended.
        self.sources: Set[int] = set()
        #: The arena for each reader, how much of it this step used, and the
        #: arenas it outgrew in this step.
        self.arenas: Dict[int, Arena] = {}
        self.used: Dict[int, int] = {}
        self.outgrown: List[Arena] = []
        #: The arenas of each source, mapped, by name; how their names begin.
        self.mapped: Dict[int, Dict[str, Tensor]] = {}
        self.prefixes: Dict[int, str] = {}

    def make(self, size: int) -> Optional[Arena]:
        """A new arena of ``size`` bytes, its memory reserved; ``None`` where none can be."""
        name = f'{self.prefix}-{self.count}'
        path = os.path.join(ROOT, name)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError:
            return None
        self.count += 1
        self.files.append(path)
        try:
            # Reserved now: a page of a file beyond the room left in /dev/shm
            # would kill the process (SIGBUS) when first touched.
            os.posix_fallocate(fd, 0, size)
        except OSError:
            self.forget(path)
            return None
        finally:
            os.close(fd)
        memory = opened(path, size)
        if memory is None:
            self.forget(path)
            return None
        return Arena(name, memory)

    def forget(self, path: str) -> None:
        """Removes one of this process's files, unless its reader did."""
        (self.files if path in self.files else self.awaited).remove(path)
        remove([path])

    def probe_word(self) -> Optional[List[str]]:
        """What the start of a step carries for the others to test: the
        probe's name and token, until every step says who read it."""
        if self.decided:
            return None
        if self.probe is None:
            sweep()
            arena = self.make(64)
            if arena is None:
                return None
            token = secrets.token_hex(16)
            arena.memory[:32].copy_(torch.frombuffer(bytearray(token.encode()),
                                                     dtype=torch.uint8))
            self.probe = (arena.name, token)
        return list(self.probe)

    def test(self, rank: int, word: Any) -> None:
        """Reads the probe ``rank`` sent, if any: whether it holds its token."""
        if not (isinstance(word, list) and len(word) == 2 and all(
                isinstance(x, str) for x in word) and NAME.match(word[0])):
            return
        memory = opened(os.path.join(ROOT, word[0]), 64)
        if memory is not None and bytes(memory[:32].tolist()) == word[1].encode():
            self.seen.add(rank)
            # Its arenas are named as its probe, but for their number.
            self.prefixes[rank] = word[0].rsplit('-', 1)[0] + '-'

    def place(self, rank: int, size: int) -> Optional[Tuple[str, int, Tensor]]:
        """Room for a payload of ``size`` bytes to ``rank``: the arena's name,
        the offset, and the room; ``None``: it goes through the process group."""
        if rank not in self.readers:
            return None
        arena, used = self.arenas.get(rank), self.used.get(rank, 0)
        if arena is None or used + size > arena.memory.numel():
            grown = max(SMALLEST, 2 * (used + size))
            if grown > LIMIT or (new := self.make(grown)) is None:
                return None
            if arena is not None:
                self.outgrown.append(arena)
            self.arenas[rank], arena, used = new, new, 0
        self.used[rank] = used + align(size)
        return arena.name, used, arena.memory[used:used + size]

    def read(self, rank: int, name: Any, offset: Any, size: int) -> Tensor:
        """The ``size`` bytes at ``offset`` of ``rank``'s arena ``name``.

        Raises:
            Unreadable: no arena of that rank, or the bytes beyond it
        """
        mapped = self.mapped.setdefault(rank, {})
        memory = mapped.get(name)
        if memory is None:
            if rank not in self.sources or not isinstance(name, str) or not NAME.match(name) \
                    or not name.startswith(self.prefixes[rank]):
                raise Unreadable(f'a payload in {name!r}, which is no arena of rank {rank}'[:200])
            path = os.path.join(ROOT, name)
            memory = opened(path)
            if memory is None:
                raise Unreadable(f'a payload in arena {name} of rank {rank}, which cannot '
                                 'be read')
            # Mapped by its one reader: the file is of no more use, and a
            # process that ends without its finalizers (os._exit) leaves none.
            remove([path])
            mapped[name] = memory
        if not (type(offset) is int and 0 <= offset and offset % 64 == 0
                and offset + size <= memory.numel()):
            raise Unreadable(f'a payload at {offset!r} in arena {name} of rank {rank}, '
                             'beyond it or misaligned'[:200])
        return memory[offset:offset + size]

    def end_step(self, reads: Dict[int, bool]) -> None:
        """Ends a step that every rank ended: ``reads``, whether each other
        rank read this one's probe (as its end of the step said).

        Every payload of the step has been taken, so each arena starts over;
        both ends drop the arenas outgrown in the step.
        """
        self.readers = {rank for rank, read in reads.items() if read}
        self.sources = self.seen & set(reads)
        self.decided = True
        # Every rank has tested the probe, and mapped the arenas made before
        # this step; one made for the end of this step may still wait for
        # its reader, until it starts the next step.
        for path in list(self.awaited):
            self.forget(path)
        if self.probe is not None and os.path.join(ROOT, self.probe[0]) in self.files:
            self.forget(os.path.join(ROOT, self.probe[0]))
        self.awaited[:] = self.files
        self.files.clear()
        self.outgrown.clear()
        self.used.clear()
        for rank, mapped in self.mapped.items():
            for name in sorted(mapped, key=lambda n: int(n.rsplit('-', 1)[1]))[:-1]:
                del mapped[name]


def sweep() -> None:
    """Removes the files that processes killed long ago left: their arenas
    never mapped, their probes (a process removes its own files otherwise)."""
    try:
        names = [name for name in os.listdir(ROOT) if NAME.match(name)]
    except OSError:
        return
    for name in names:
        path = os.path.join(ROOT, name)
        try:
            os.kill(int(name.split('-')[1]), 0)
            continue  # its process lives on
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):
            continue  # another user's, or no process's
        try:
            if time.time() - os.stat(path).st_mtime > STALE:
                os.unlink(path)
        except OSError:
            pass


def opened(path: str, size: Optional[int] = None) -> Optional[Tensor]:
    """The bytes of a file of shared memory, mapped; ``None`` unless it is a
    regular file of this user (no link), of ``size`` bytes if given."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode) or status.st_uid != os.getuid() or \
                status.st_size == 0 or size is not None and status.st_size != size:
            return None
        # Mapped through the descriptor checked, not by the path again.
        return torch.frombuffer(mmap.mmap(fd, status.st_size), dtype=torch.uint8)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)


def remove(files: List[str]) -> None:
    """Removes the files a process made and did not remove yet."""
    for path in files:
        try:
            os.unlink(path)
        except OSError:
            pass

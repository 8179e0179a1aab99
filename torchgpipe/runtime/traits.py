"""What running a partition has shown about it, so later runs can take shortcuts.

A partition that **modifies its input in place** must run its checkpointed
first pass on a copy; one that **draws from the CPU generator** must take
turns (:mod:`torchgpipe.foundation.rng`). Until known, the pipeline assumes
the cautious answer and watches. The facts belong to one GPipe's run
(:class:`RunState`), not to its model.
"""
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypeVar

import torch
from torch import Tensor

from torchgpipe.foundation.record import Recorder
from torchgpipe.foundation.stream import AbstractStream, new_stream

__all__: List[str] = []

T = TypeVar('T')
R = TypeVar('R')


@dataclass
class PartitionTraits:
    """The habits of one partition, as far as runs have shown them."""

    #: Whether a run on copies of its input changed them in place (``None``: unknown).
    modifies_input: Optional[bool] = None

    #: Whether a task drew from the CPU generator, for each setting of the
    #: partition's ``training`` flags (dropout draws only in training).
    draws_random: Dict[Tuple[bool, ...], bool] = field(default_factory=dict)

    def draws(self, flags: Tuple[bool, ...]) -> Optional[bool]:
        """Whether a task draws from the CPU generator with these ``training`` flags, if known."""
        return self.draws_random.get(flags)

    def learn_draws(self, flags: Tuple[bool, ...], drew: bool) -> None:
        """Learns whether a task with these ``training`` flags draws (``drew``, from
        :func:`~torchgpipe.foundation.rng.watch`): the first answer is kept."""
        self.draws_random.setdefault(flags, drew)

    def call(self, function: Callable[[T], R], input: Tuple[Tensor, ...],
             arguments: Callable[[Tuple[Tensor, ...]], T], again: str) -> R:
        """Calls ``function`` on ``arguments(input)``, on copies (showing whether it changes
        them) unless the partition is known to leave its input, which a recomputation needs.

        Raises:
            RuntimeError: a partition known to leave its input alone changed it
                (from now on it runs on copies; call ``again`` again)
        """
        if self.modifies_input is False:
            versions = [x._version for x in input]
            output = function(arguments(input))
            if any(x._version != v for x, v in zip(input, versions)):
                # The input a recomputation needs is lost.
                self.modifies_input = True
                raise RuntimeError(f'a partition modified its input in place, though it had '
                                   f'not before; call {again} again: it copies the input of '
                                   'this partition from now on')
            return output
        output, modified = call_on_copies(function, input, arguments)
        self.modifies_input = bool(self.modifies_input) or modified
        return output


def call_on_copies(function: Callable[[T], R], input: Tuple[Tensor, ...],
                   arguments: Callable[[Tuple[Tensor, ...]], T]) -> Tuple[R, bool]:
    """Calls ``function`` on copies of the input tensors: its output, and whether it changed
    any in place."""
    copies = tuple(x.clone() for x in input)
    output = function(arguments(copies))
    # A fresh copy's version counter is 0; every in-place change bumps it.
    return output, any(x._version for x in copies)


class RunState:
    """The per-run state of a GPipe: copy streams, partition traits, the recorder attached.
    Not a property of the model: a copied or pickled GPipe gets a fresh one."""

    def __init__(self, num_partitions: int) -> None:
        self.num_partitions = num_partitions
        #: For each partition, one copy stream per micro-batch, created on
        #: first use (creating a CUDA stream initializes CUDA).
        self.copy_streams: List[List[AbstractStream]] = []
        self.traits = [PartitionTraits() for _ in range(num_partitions)]
        #: The recorder of the runs (a timeline, inside :func:`torchgpipe.trace`).
        self.recorder: Optional[Recorder] = None

    def ensure_copy_streams(self, devices: Sequence[torch.device],
                            chunks: int) -> List[List[AbstractStream]]:
        """A copy stream per partition (on its device) per micro-batch, created once."""
        if not self.copy_streams:
            self.copy_streams.extend([new_stream(device) for _ in range(chunks)]
                                     for device in devices)
        return self.copy_streams

    def __reduce__(self) -> Tuple[type, Tuple[int]]:
        return RunState, (self.num_partitions,)

"""Replay: a checkpointed micro-batch's first pass, and a recomputation that computes alike.

Both engines checkpoint. The forward path does it with the autograd functions
of :mod:`torchgpipe.checkpoint`, whose recomputation the caller's
``loss.backward()`` triggers; a training step (:mod:`torchgpipe.train.step`)
recomputes in its backward action. Either way, the two passes of a micro-batch
run in the two contexts below, which makes them compute alike::

    first_pass(device)                      recomputation(device, states, ...)
      save generator states + autocast  ──►   the same generator states, put
      no grad                                 back after it; the same autocast
      is_checkpointing() is True              grad enabled
                                              is_recomputing() is True

so dropout draws the same masks (:mod:`torchgpipe.rng`) and mixed precision
computes in the same dtypes (:mod:`torchgpipe.autocast`).
"""
from contextlib import contextmanager
from typing import Generator, List, Tuple

import torch

from torchgpipe.autocast import AutocastStates, restore_autocast_states, save_autocast_states
from torchgpipe.phase import enable_checkpointing, enable_recomputing
from torchgpipe.rng import RNGStates, restore_rng_states, save_rng_states

__all__: List[str] = []

#: What a first pass leaves for its recomputation: the states to replay.
FirstPass = Tuple[RNGStates, AutocastStates]


@contextmanager
def first_pass(device: torch.device) -> Generator[FirstPass, None, None]:
    """Runs a checkpointed micro-batch's first pass; entering gives the states to replay it from.

    Args:
        device: the device the pass runs on (its generator is saved if CUDA)

    Example::

        >>> with first_pass(torch.device('cpu')) as states:
        ...     y = torch.nn.functional.dropout(torch.ones(4))
        >>> with recomputation(torch.device('cpu'), states, exclusive=True):
        ...     z = torch.nn.functional.dropout(torch.ones(4))
        >>> torch.equal(y, z)
        True
    """
    # Saved before anything draws.
    states = (save_rng_states(device), save_autocast_states())
    with torch.no_grad(), enable_checkpointing():
        yield states


@contextmanager
def recomputation(device: torch.device, states: FirstPass, *,
                  exclusive: bool) -> Generator[None, None, None]:
    """Runs a recomputation from what its :func:`first_pass` saved.

    Args:
        device: the device the first pass ran on
        states: what entering the first pass gave
        exclusive: whether the recomputation may draw from the CPU
            generator: then it replays that generator too, holding it
            alone (see :func:`~torchgpipe.rng.restore_rng_states`)
    """
    with restore_rng_states(device, states[0], exclusive=exclusive), \
            restore_autocast_states(states[1]), torch.enable_grad(), enable_recomputing():
        yield

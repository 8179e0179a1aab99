"""Replay: a checkpointed micro-batch's first pass, and a recomputation that computes alike::

    first_pass(device)                      recomputation(device, states, ...)
      save generator states + autocast  ──►   the same generator states, put
      no grad                                 back after it; the same autocast
      is_checkpointing() is True              grad enabled
                                              is_recomputing() is True

so dropout draws the same masks (:mod:`torchgpipe.foundation.rng`) and mixed
precision computes in the same dtypes. Autocast is thread-local: worker threads and the
autograd engine's thread start without the caller's, so its state is captured and entered
where tasks run.
"""
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, ContextManager, Generator, List, Optional, Tuple, cast

import torch
from torch import Tensor

from torchgpipe.foundation.phase import enable_checkpointing, enable_recomputing
from torchgpipe.foundation.rng import (RNGStates, cpu_generator_owned, cpu_rng_state,
                                       restore_rng_states, save_rng_states)

__all__: List[str] = []


#: The dtype of every enabled autocast, per device type, and the weight cast
#: cache flag.
AutocastStates = Tuple[List[Tuple[str, torch.dtype]], bool]

_AUTOCAST_DEVICE_TYPES = ('cpu', 'cuda')

#: torch 2.1 - 2.3 have functions per device type; later ones, one for every type.
_LEGACY_AUTOCAST = {'cpu': ('is_autocast_cpu_enabled', 'get_autocast_cpu_dtype'),
                    'cuda': ('is_autocast_enabled', 'get_autocast_gpu_dtype')}


def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
    """The dtype autocast casts to on the device type, or ``None`` if it is off."""
    if hasattr(torch, 'get_autocast_dtype'):
        on = torch.is_autocast_enabled(device_type)
        return torch.get_autocast_dtype(device_type) if on else None
    is_enabled, get_dtype = _LEGACY_AUTOCAST[device_type]  # pragma: no cover
    return cast(torch.dtype, getattr(torch, get_dtype)()) if getattr(torch, is_enabled)() else None


def save_autocast_states() -> AutocastStates:
    """Captures the dtype of every enabled autocast, per device type, and the cache flag."""
    dtypes = [(device_type, _autocast_dtype(device_type)) for device_type in _AUTOCAST_DEVICE_TYPES]
    return ([(device_type, dtype) for device_type, dtype in dtypes if dtype is not None],
            torch.is_autocast_cache_enabled())


_NOTHING = nullcontext()


def restore_autocast_states(states: AutocastStates) -> ContextManager[Any]:
    """Enters exactly the autocast contexts of ``states`` (and no other)."""
    if not states[0] and not save_autocast_states()[0]:
        # No autocast then or now, the common case: spare the contexts.
        return _NOTHING
    return _restore_autocast_states(states)


@contextmanager
def _restore_autocast_states(states: AutocastStates) -> Generator[None, None, None]:
    enabled, cache_enabled = states
    dtypes = dict(enabled)
    with ExitStack() as stack:
        for device_type in _AUTOCAST_DEVICE_TYPES:
            if device_type in dtypes:
                stack.enter_context(torch.autocast(device_type, dtype=dtypes[device_type],
                                                   cache_enabled=cache_enabled))
            elif _autocast_dtype(device_type) is not None:
                stack.enter_context(torch.autocast(device_type, enabled=False))
        yield


@dataclass(slots=True, eq=False)
class FirstPass:
    """What a first pass leaves for its recomputation: the states to replay, and where the
    CPU generator was as it ended (if the pass held it), so that a recomputation that
    ends elsewhere, having drawn other numbers, raises rather than give wrong gradients."""

    rng: RNGStates
    autocast: AutocastStates
    ended: Optional[Tensor] = None

    def end(self) -> None:
        """Notes where the CPU generator is, where the recomputation must end (again for an
        engine whose recomputation replays more: the last partition's loss)."""
        self.ended = cpu_rng_state() if self.rng[0] is not None and cpu_generator_owned() else None


@contextmanager
def first_pass(device: torch.device,
               exclusive: bool = True) -> Generator[FirstPass, None, None]:
    """Runs a checkpointed micro-batch's first pass on ``device``; entering gives the states
    to replay it from, the CPU generator's only if the recomputation is ``exclusive``.

    Example::

        >>> with first_pass(torch.device('cpu')) as states:
        ...     y = torch.nn.functional.dropout(torch.ones(4))
        >>> with recomputation(torch.device('cpu'), states, exclusive=True):
        ...     z = torch.nn.functional.dropout(torch.ones(4))
        >>> torch.equal(y, z)
        True
    """
    # Saved before anything draws.
    states = FirstPass(save_rng_states(device, exclusive), save_autocast_states())
    # Grad off, unless already (as in an autograd function's forward): a cost per task.
    with torch.no_grad() if torch.is_grad_enabled() else _NOTHING, enable_checkpointing():
        yield states
    states.end()


@contextmanager
def recomputation(device: torch.device, states: FirstPass, *,
                  exclusive: bool) -> Generator[None, None, None]:
    """Runs a recomputation from what its :func:`first_pass` saved (``states``); if
    ``exclusive`` (it may draw from the CPU generator) it replays that generator too.

    Raises:
        RuntimeError: the recomputation ended with the CPU generator elsewhere
            than its first pass: something else drew from it in between
    """
    assert states.rng[0] is not None or not exclusive  # saved by a first pass told so
    with restore_rng_states(device, states.rng, exclusive=exclusive), \
            restore_autocast_states(states.autocast), torch.enable_grad(), enable_recomputing():
        yield
        if exclusive and states.ended is not None and replayed_otherwise(states):
            raise RuntimeError(
                'a recomputation drew other random numbers than its first pass: the CPU '
                'generator was drawn from outside the pipeline during the step (by another '
                'thread, between the first pass of a checkpointed micro-batch and the end of '
                'its recomputation), so its gradients would be wrong; let that thread draw '
                'from a torch.Generator of its own (g = torch.Generator(); '
                'torch.randn(..., generator=g)), and give no layer other draws when '
                'recomputing')


def replayed_otherwise(states: FirstPass) -> bool:
    """Whether a recomputation drew other numbers than its first pass: it moved the
    generator, and ended elsewhere than the first pass did."""
    now, first = cpu_rng_state(), states.rng[0]
    return first is not None and not torch.equal(now, first) and not (
        states.ended is not None and torch.equal(now, states.ended))

"""Autocast state: captured in one thread, entered again in another.

Autocast is thread-local: worker threads and the autograd engine's thread
start without the caller's. So the caller's state is captured and entered
where tasks run, computing in the same dtypes on every thread and pass.
"""
from contextlib import ExitStack, contextmanager, nullcontext
from typing import Any, ContextManager, Generator, List, Optional, Tuple

import torch

__all__: List[str] = []

#: The dtype of every enabled autocast, per device type, and the weight cast
#: cache flag.
AutocastStates = Tuple[List[Tuple[str, torch.dtype]], bool]

_AUTOCAST_DEVICE_TYPES = ('cpu', 'cuda')

if hasattr(torch, 'get_autocast_dtype'):
    def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
        """The dtype autocast casts to on the device type, or ``None`` if it is off."""
        # torch >= 2.4: one API for every device type.
        if not torch.is_autocast_enabled(device_type):
            return None
        return torch.get_autocast_dtype(device_type)
else:  # pragma: no cover (torch 2.1 - 2.3: separate functions per device type)
    _LEGACY_AUTOCAST = {'cpu': ('is_autocast_cpu_enabled', 'get_autocast_cpu_dtype'),
                        'cuda': ('is_autocast_enabled', 'get_autocast_gpu_dtype')}

    def _autocast_dtype(device_type: str) -> Optional[torch.dtype]:
        is_enabled, get_dtype = _LEGACY_AUTOCAST[device_type]
        if not getattr(torch, is_enabled)():
            return None
        dtype: torch.dtype = getattr(torch, get_dtype)()
        return dtype


def save_autocast_states() -> AutocastStates:
    """Captures the dtype of every enabled autocast, per device type, and the cache flag."""
    dtypes = [(device_type, _autocast_dtype(device_type)) for device_type in _AUTOCAST_DEVICE_TYPES]
    return ([(device_type, dtype) for device_type, dtype in dtypes if dtype is not None],
            torch.is_autocast_cache_enabled())


_NO_AUTOCAST = nullcontext()


def restore_autocast_states(states: AutocastStates) -> ContextManager[Any]:
    """Enters exactly the autocast contexts of ``states`` (and no other)."""
    if not states[0] and not save_autocast_states()[0]:
        # No autocast then or now, the common case: spare the contexts.
        return _NO_AUTOCAST
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

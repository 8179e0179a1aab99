"""Which pass of a forward runs: the first pass of a checkpointed micro-batch, or its recomputation.

Layers may ask, to avoid side effects twice (:func:`is_recomputing`); so does
the skip tracker, as a checkpointed stash is popped twice. Per thread:
workers run different micro-batches at once.
"""
import threading
from typing import Any, ContextManager, List, Optional

from torch import Tensor

__all__: List[str] = []


class ThreadLocal(threading.local):
    def __init__(self) -> None:
        self.is_checkpointing = False
        self.is_recomputing = False
        #: Where :func:`add_root` puts its tensors, in a recomputation.
        self.roots: Optional[List[Tensor]] = None


thread_local = ThreadLocal()


class Setting:
    """Sets attribute ``name`` of ``holder`` (a thread-local) within the context (a class:
    cheaper than a generator, entered for every task)."""

    __slots__ = ('holder', 'name', 'value', 'orig')

    def __init__(self, holder: threading.local, name: str, value: Any = True) -> None:
        self.holder = holder
        self.name = name
        self.value = value
        self.orig: Any = None

    def __enter__(self) -> None:
        self.orig = getattr(self.holder, self.name)
        setattr(self.holder, self.name, self.value)

    def __exit__(self, *exc_info: object) -> None:
        setattr(self.holder, self.name, self.orig)


def enable_checkpointing() -> ContextManager[None]:
    """Makes :func:`is_checkpointing` return ``True`` within the context."""
    return Setting(thread_local, 'is_checkpointing')


def enable_recomputing() -> ContextManager[None]:
    """Makes :func:`is_recomputing` return ``True`` within the context."""
    return Setting(thread_local, 'is_recomputing')


def collect_roots(roots: List[Tensor]) -> ContextManager[None]:
    """Makes :func:`add_root` append to ``roots`` within the context."""
    return Setting(thread_local, 'roots', roots)


def add_root(tensor: Tensor) -> None:
    """Makes the backward pass of a recomputed graph start from ``tensor`` too, even if no
    output got a gradient (a skip's portal); nothing outside a recomputation."""
    if thread_local.roots is not None:
        thread_local.roots.append(tensor)


def is_checkpointing() -> bool:
    """Whether the current forward propagation is under checkpointing.

    A checkpointed forward runs twice: first without keeping activations (here
    this returns ``True``), then again before its backward (:func:`is_recomputing`).

    Returns:
        bool: ``True`` if it's under checkpointing

    Example::

        class Probe(nn.Module):
            def forward(self, input):
                if is_checkpointing():
                    print('first pass of a checkpointed micro-batch')
                return input
    """
    return thread_local.is_checkpointing


def is_recomputing() -> bool:
    """Whether the current forward propagation is under checkpoint recomputation.

    Use this to prevent duplicated side effects at forward propagation.

    Returns:
        bool: ``True`` if it's under checkpoint recomputation

    Example::

        class Counter(nn.Module):
            def __init__(self):
                super().__init__()
                self.counter = 0

            def forward(self, input):
                if not is_recomputing():
                    self.counter += 1
                return input
    """
    return thread_local.is_recomputing

"""Namespaces: separate sets of skip names, so one name can serve several pairs of layers."""
import uuid
from functools import total_ordering
from typing import Any

__all__ = ['Namespace']


@total_ordering
class Namespace:
    """A set of skip names of its own, for :meth:`Skippable.isolate()
    <torchgpipe.skip.skippable.Skippable.isolate>`.

    A name isolated in one namespace never meets the same name in another;
    names never isolated share one default namespace. Namespaces compare and
    hash by a random identifier, so they survive copies and pickles.

    Example::

        >>> ns = Namespace()
        >>> ns == ns, ns == Namespace()
        (True, False)
    """

    __slots__ = ('id',)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    # Ordered only so that (namespace, name) keys can be sorted: the skip
    # layout and the error messages then list a model's skips in one order.
    def __lt__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id < other.id
        return NotImplemented

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id == other.id
        return NotImplemented


#: Where every skip name lives until :meth:`isolate()
#: <torchgpipe.skip.skippable.Skippable.isolate>` moves it.
default_namespace = Namespace()

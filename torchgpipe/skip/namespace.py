"""Namespaces: separate sets of skip names, so one name can serve several pairs of layers."""
import uuid
from functools import total_ordering
from typing import Any

__all__ = ['Namespace']


@total_ordering
class Namespace:
    """A set of skip names of its own, for :meth:`Skippable.isolate()
    <torchgpipe.skip.skippable.Skippable.isolate>`.

    Trackers store a skip under its namespace and its name, so a name
    isolated in one namespace never meets the same name in another. Every
    namespace differs from every other; the names a layer never isolates
    share one default namespace. Namespaces compare and hash by a random
    identifier, so they can be copied and pickled with the model.

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

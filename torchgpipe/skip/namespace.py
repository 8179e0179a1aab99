"""Namespaces: isolating skip names so the same skippable class can be used twice."""
import uuid
from functools import total_ordering
from typing import Any

__all__ = ['Namespace']


@total_ordering
class Namespace:
    """Namespace for isolating skip tensors used by :meth:`isolate()
    <torchgpipe.skip.skippable.Skippable.isolate>`.

    Every namespace is distinct from every other one. Names not isolated in
    any namespace live in a shared default namespace.

    Example::

        ns1 = Namespace()
        ns2 = Namespace()
        model = nn.Sequential(Layer1().isolate(ns1), Layer1().isolate(ns2),
                              Layer3().isolate(ns2), Layer3().isolate(ns1))
    """

    __slots__ = ('id',)

    def __init__(self) -> None:
        self.id = uuid.uuid4()

    def __repr__(self) -> str:
        return f"<Namespace '{self.id}'>"

    def __hash__(self) -> int:
        return hash(self.id)

    # Namespaces are ordered only so that (namespace, name) pairs can be
    # sorted into deterministic error messages.
    def __lt__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id < other.id
        return NotImplemented

    def __eq__(self, other: Any) -> bool:
        if isinstance(other, Namespace):
            return self.id == other.id
        return NotImplemented


#: The namespace of every skip name that was not isolated.
default_namespace = Namespace()

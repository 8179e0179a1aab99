"""A capture leaves the module it is given as it was, and names what ``forward`` changed.

Both captures run ``forward`` as Python: what it assigns (``self.count += 1``)
or registers would land in the model as a proxy or fake tensor, and the
graph would never repeat it. :class:`Untouched` restores every module and
names each change, since a silently dropped effect is a wrong result.
"""
from types import TracebackType
from typing import Any, Dict, List, Optional, Tuple, Type

from torch import Tensor, fx, nn

from torchgpipe.foundation.validation import describe

__all__: List[str] = []


class Untouched:
    """Restores every module of ``module`` after a capture (``with Untouched(module):``);
    unless the capture failed, a change is an error.

    Raises:
        RuntimeError: ``forward`` assigned, added or removed an attribute of
            a module, changed its parameters, buffers, submodules or hooks,
            or updated a tensor it holds in place
    """

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        # (module, its qualified name, its attributes, copies of the dicts among them)
        self.saved: List[Tuple[nn.Module, str, Dict[str, Any], Dict[str, Dict[Any, Any]]]] = []
        self.versions: Dict[int, Tuple[str, Tensor, int]] = {}

    def __enter__(self) -> 'Untouched':
        for path, m in self.module.named_modules(remove_duplicate=True):
            attributes = dict(m.__dict__)
            dicts = {k: dict(v) for k, v in attributes.items() if isinstance(v, dict)}
            self.saved.append((m, path, attributes, dicts))
            # Not copied: an update in place shows in the version counter (named, not undone).
            for name, value in _tensors(attributes):
                self.versions.setdefault(id(value), (_join(path, name), value, value._version))
        return self

    def note(self, *hook_arguments: Any) -> None:
        """Notes the attributes changed so far: a forward hook for export, which puts them back
        itself once ``forward`` is done."""
        self.noted = self.changes(attributes_only=True)

    def __exit__(self, kind: Optional[Type[BaseException]], error: Optional[BaseException],
                 traceback: Optional[TracebackType]) -> None:
        changed = list(dict.fromkeys(getattr(self, 'noted', []) + self.changes()))
        self.restore()
        if kind is None and changed:
            raise RuntimeError(describe(
                "to_sequential cannot flatten a forward that changes the module's state: the "
                'captured code would not repeat the change at each call',
                f'changed: {", ".join(changed)}',
                'move that code out of forward, or into a module kept whole (leaf_modules= '
                'with torch.fx; with torch.export, a module whose forward takes one tensor); '
                'the module was left as it was'))

    def changes(self, attributes_only: bool = False) -> List[str]:
        """The qualified names of what changed since the snapshot (``attributes_only``: not the
        dicts of parameters, buffers, submodules and hooks, nor the tensors' versions)."""
        changed: List[str] = []
        for m, path, attributes, dicts in self.saved:
            current = m.__dict__
            for name in sorted(current.keys() | attributes.keys()):
                if name not in attributes or name not in current \
                        or not _same(current[name], attributes[name]):
                    changed.append(_join(path, name))
            if attributes_only:
                continue
            for name, saved in dicts.items():
                inside = attributes[name]
                added_or_removed = inside.keys() ^ saved.keys()
                replaced = [k for k in inside.keys() & saved.keys() if inside[k] is not saved[k]]
                if added_or_removed or replaced:
                    # Hooks are kept by handle numbers: name the dict of them.
                    keys = sorted(k for k in [*added_or_removed, *replaced] if isinstance(k, str))
                    changed.extend(_join(path, k) for k in keys or [name])
        for name, tensor, version in self.versions.values():
            if not attributes_only and tensor._version != version:
                changed.append(f'{name} (updated in place)')
        return changed

    def restore(self) -> None:
        """Puts every module back as it was."""
        for m, _, attributes, dicts in self.saved:
            m.__dict__.clear()
            m.__dict__.update(attributes)
            for name, saved in dicts.items():
                attributes[name].clear()
                attributes[name].update(saved)


def _tensors(attributes: Dict[str, Any]) -> List[Tuple[str, Tensor]]:
    """The tensors among a module's attributes: its parameters, buffers and plain tensors."""
    found = [(k, v) for k, v in attributes.items() if isinstance(v, Tensor)]
    for kind in ('_parameters', '_buffers'):
        found += [(k, v) for k, v in attributes.get(kind, {}).items() if isinstance(v, Tensor)]
    return found


def _same(value: Any, saved: Any) -> bool:
    """Whether an attribute holds what it held: the same object, or for plain values an
    equal one (export puts back copies of containers)."""
    if value is saved:
        return True
    if isinstance(value, (Tensor, fx.Proxy)) or isinstance(saved, Tensor):
        return False
    try:
        return type(value) is type(saved) and bool(value == saved)
    except Exception:
        return False


def _join(path: str, name: str) -> str:
    return f'{path}.{name}' if path else name

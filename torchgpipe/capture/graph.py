"""What both captures share: the form of the graph they give, which the cutting reads, and
:class:`Untouched`, which leaves the module as it was.

Placeholders are the sequential's inputs; ``get_attr`` and ``call_module``
nodes name the user's objects through ``root``; the output node returns a
node or a tuple. Sizes and checks (:func:`is_shape`, :func:`is_check`) are
computed again by each child that reads them.
"""
import inspect
from types import TracebackType
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Type, Union

import torch
from torch import Tensor, fx, nn

from torchgpipe.capture.interface import Interface
from torchgpipe.foundation.validation import describe

__all__: List[str] = []


class Captured(NamedTuple):
    """A graph to cut into children, and what its nodes name."""

    #: placeholders: the sequential's inputs; output: a node or a tuple of nodes
    graph: fx.Graph
    #: what ``get_attr`` and ``call_module`` targets name: a module or a dict
    root: Union[nn.Module, Dict[str, Any]]
    interface: Interface

# The sizes export reads from a tensor.
_SIZES = (torch.ops.aten.sym_size.int, torch.ops.aten.sym_numel.default,
          torch.ops.aten.sym_stride.int, torch.ops.aten.sym_storage_offset.default)

# The checks of a condition, in fx's traces and in export's.
_CHECKS = (torch._assert, torch.ops.aten._assert_scalar.default,
           torch.ops.aten.sym_constrain_range_for_size.default)

def is_shape(node: fx.Node) -> bool:
    """Whether a node computes a shape, a size or a number from shapes only: no tensor, so
    each child using one computes it again."""
    if node.op == 'call_method' and node.target in ('size', 'dim', 'numel'):
        return True
    if node.op != 'call_function':
        return False
    if node.target is getattr:
        return node.args[1] in ('shape', 'ndim', 'dtype', 'device')
    if node.target in _SIZES:
        return True
    # Arithmetic on sizes: Python's operators (fx), torch.sym_max and such (export).
    if getattr(node.target, '__module__', '') in ('_operator', 'operator') \
            or getattr(node.target, '__name__', '').startswith('sym_'):
        return bool(node.all_input_nodes) and all(is_shape(a) for a in node.all_input_nodes)
    return False

def is_check(node: fx.Node) -> bool:
    """Whether ``node`` only checks a condition (``torch._assert``), making no value."""
    return node.op == 'call_function' and node.target in _CHECKS

def named_arguments(module: nn.Module) -> List[str]:
    """The arguments of ``module.forward`` that can be given by name, in order."""
    return [name for name, p in inspect.signature(module.forward).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]

def attr(root: Union[nn.Module, Dict[str, Any]], target: object) -> Any:
    """The attribute of ``root`` at a qualified name such as ``'layers.0.weight'``."""
    if isinstance(root, dict):
        return root[str(target)]
    value: Any = root
    for part in str(target).split('.'):
        value = getattr(value, part)
    return value

def has_hooks(module: nn.Module) -> bool:
    """Whether ``module`` has hooks that run when it is called: it stays whole where it can,
    so they run at each call rather than once while capturing."""
    return bool(module._forward_pre_hooks or module._forward_hooks
                or module._backward_pre_hooks or module._backward_hooks)

def resolve(graph: fx.Graph, module: nn.Module, extra: Dict[str, Any]) -> Dict[str, Any]:
    """What each ``get_attr`` and ``call_module`` node of ``graph`` names, in ``extra`` (the
    capture's constants) or ``module``: nothing is put on the user's module."""
    targets = [str(n.target) for n in graph.nodes if n.op in ('get_attr', 'call_module')]
    return {t: extra[t] if t in extra else attr(module, t) for t in targets}

def output_nodes(leaves: Sequence[Any], shown: object) -> List[fx.Node]:
    """The nodes of a graph's outputs, checked to be values the graph computes.

    Raises:
        TypeError: an output is a constant: the sequential returns tensors only
    """
    if not all(isinstance(leaf, fx.Node) for leaf in leaves):
        raise TypeError(describe('module must return tensors to be flattened',
                                 f'output: {shown!r}', 'return the tensors alone'))
    return list(leaves)


class Untouched:
    """Restores every module of ``module`` after a capture (``with Untouched(module):``);
    unless the capture failed, a change is an error. Both captures run ``forward`` as
    Python: what it assigns (``self.count += 1``) or registers would land in the model as a
    proxy or fake tensor, and the graph would never repeat it; a silently dropped effect is a
    wrong result.

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

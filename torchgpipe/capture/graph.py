"""The form of a captured graph, which both captures give and the cutting reads.

Placeholders are the sequential's inputs; ``get_attr`` and ``call_module``
nodes name the user's objects through ``root``; the output node returns a
node or a tuple. Sizes and checks (:func:`is_shape`, :func:`is_check`) are
computed again by each child that reads them.
"""
import inspect
from typing import Any, Dict, List, NamedTuple, Sequence, Union

import torch
from torch import fx, nn

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

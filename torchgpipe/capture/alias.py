"""Memory shared by values of a captured graph, and the updates in place of it.

Partitions get copies of their inputs and recompute from them, which breaks
eager code's several names for one memory updated in place. So an update
of a value with no other name becomes a new value (:func:`out_of_place`);
an update of a buffer or parameter outside its module is refused; any other
update keeps every reader of that memory in one child (:func:`shared_memory`).
"""
import operator
from typing import Any, Dict, List, NoReturn, Optional, Set, Union

import torch
from torch import fx, nn

from torchgpipe.capture.graph import attr
from torchgpipe.foundation.validation import describe

__all__: List[str] = []

Root = Union[nn.Module, Dict[str, Any]]

# PyTorch's documented views ("Tensor Views"), as fx records them by name.
_VIEWS = {
    'view', 'view_as', 'reshape', 'reshape_as', 'flatten', 'unflatten', 'expand', 'expand_as',
    'narrow', 'select', 'squeeze', 'unsqueeze', 'transpose', 'swapaxes', 'swapdims', 't',
    'permute', 'movedim', 'moveaxis', 'diagonal', 'as_strided', 'unfold', 'split', 'chunk',
    'unbind', 'tensor_split', 'hsplit', 'vsplit', 'dsplit', 'split_with_sizes', 'detach',
    'contiguous', 'real', 'imag', 'view_as_real', 'view_as_complex', 'adjoint', 'T', 'mT', 'H',
    'mH', 'data', '__getitem__',
}
# Python's updates in place, as fx records ``x += y`` (operator.iadd for operator.add, ...)
# and ``x[i] = y``.
_UPDATES: Dict[Any, Any] = {
    getattr(operator, 'i' + name.rstrip('_')): getattr(operator, name)
    for name in ('add', 'sub', 'mul', 'truediv', 'floordiv', 'mod', 'pow', 'matmul', 'and_',
                 'or_', 'xor', 'lshift', 'rshift')}
_UPDATES[operator.setitem] = None
# Updates whose name without ``_`` means something else (bernoulli_(p)).
_NO_TWIN = {'bernoulli_'}
# Methods ending in ``_`` that change no values.
_NOT_UPDATES = {'requires_grad_', 'retain_grad_', 'share_memory_', 'record_stream_'}


def _name(node: fx.Node) -> str:
    """The method's or function's name a node calls ('' for other nodes)."""
    if node.op == 'call_method':
        return str(node.target)
    if node.op == 'call_function':
        if node.target is getattr:
            return str(node.args[1])
        return getattr(node.target, '__name__', '')
    return ''


def _in_place(node: fx.Node, root: Root) -> bool:
    """Whether an fx node (or a module call) updates its first argument in place."""
    if node.op == 'call_module':
        return getattr(attr(root, node.target), 'inplace', False) is True
    if node.op == 'call_function' and node.target in _UPDATES:
        return True
    if getattr(node.target, '__module__', None) in ('operator', '_operator'):
        return False  # operator.and_ is no update
    if node.kwargs.get('inplace') is True:
        return True
    name = _name(node)
    return (node.op in ('call_method', 'call_function') and name.endswith('_')
            and not name.startswith('_') and name not in _NOT_UPDATES)


def returns_alias(node: fx.Node, root: Root) -> bool:
    """Whether a node returns a view of (or, in place, the same memory as) its first argument."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    schema = getattr(node.target, '_schema', None)
    if schema is not None:  # an ATen operation, in export's graphs
        return bool(schema.returns) and schema.returns[0].alias_info is not None
    if node.op == 'call_function' and node.target is operator.getitem:
        return True  # a view, or an item of a tuple, which is that tensor itself
    if _in_place(node, root):
        return node.target is not operator.setitem
    return node.op in ('call_method', 'call_function') and _name(node) in _VIEWS


def base(node: fx.Node, root: Root) -> fx.Node:
    """The value whose memory ``node`` is a view of (itself if it is no view)."""
    while returns_alias(node, root):
        node = node.args[0]  # type: ignore[assignment]
    return node


def written(node: fx.Node, root: Root) -> List[fx.Node]:
    """The values ``node`` updates in place."""
    schema = getattr(node.target, '_schema', None)
    if schema is not None:
        return [value for argument, value in zip(schema.arguments, node.args)
                if argument.alias_info is not None and argument.alias_info.is_write
                and isinstance(value, fx.Node)]
    if isinstance(node.target, torch._ops.HigherOrderOperator):
        # torch.no_grad()'s or torch.autocast's body: a graph called on the operands after it.
        for k, value in enumerate(node.args):
            body = attr(root, value.target) if isinstance(value, fx.Node) \
                and value.op == 'get_attr' else None
            if isinstance(body, fx.GraphModule):
                operands = node.args[k + 1:]
                inputs = [n for n in body.graph.nodes if n.op == 'placeholder']
                updated = {base(w, body) for n in body.graph.nodes for w in written(n, body)}
                return [v for p, v in zip(inputs, operands)
                        if p in updated and isinstance(v, fx.Node)]
        return []
    if _in_place(node, root) and isinstance(node.args[0], fx.Node):
        return [node.args[0]]
    return []


def refuse_update(buffer: str) -> NoReturn:
    """Raises the error for a buffer updated by code outside the module holding it."""
    raise RuntimeError(describe(
        'to_sequential cannot flatten code that updates a buffer outside the module holding it',
        f'updated: {buffer}', 'update it in a module of its own, kept whole (leaf_modules= '
        'with torch.fx; with torch.export, a module whose forward takes one tensor), or '
        'outside forward'))


def _twin(graph: fx.Graph, node: fx.Node, root: Root) -> Optional[fx.Node]:
    """Inserts before ``node`` the operation returning what the update writes (``add`` for
    ``add_``, ``x + y`` for ``x += y``); ``None`` if there is none (``x[i] = y``)."""
    target: Any = None
    kind = node.op
    if isinstance(node.target, torch._ops.OpOverload):
        name = node.target._schema.name.split('::')[-1]
        packet = getattr(torch.ops.aten, name[:-1], None) if name.endswith('_') else None
        target = getattr(packet, node.target._overloadname, None) if packet else None
    elif kind == 'call_function' and node.target in _UPDATES:
        target = _UPDATES[node.target]
    elif kind == 'call_method' and node.target not in _NO_TWIN \
            and hasattr(torch.Tensor, str(node.target)[:-1]):
        target = str(node.target)[:-1]
    elif kind == 'call_function' and node.kwargs.get('inplace') is True:
        target = node.target
    elif kind == 'call_function' and getattr(node.target, '__module__', None) == 'torch':
        target = getattr(torch, _name(node)[:-1], None)  # torch.relu for torch.relu_
    if target is None:
        return None
    kwargs = dict(node.kwargs)
    if 'inplace' in kwargs:
        kwargs['inplace'] = False
    with graph.inserting_before(node):
        return graph.create_node(kind, target, node.args, kwargs)


def out_of_place(graph: fx.Graph, root: Root) -> None:
    """Turns each update in place of a value with no other name into a new value: ``x.add_(y)``
    becomes ``x2 = x + y``, read by what read ``x`` after it. Updates of views or of
    values with views are left as they are.

    Raises:
        RuntimeError: the code updates a buffer or a parameter (or a view of one)
    """
    for node in list(graph.nodes):
        targets = written(node, root)
        for value in targets:
            if base(value, root).op == 'get_attr':
                refuse_update(str(base(value, root).target))
        if not node.args or targets != [node.args[0]]:
            continue
        target = node.args[0]
        assert isinstance(target, fx.Node)
        position = {n: i for i, n in enumerate(graph.nodes)}
        # Other names: its views, and the updates before this one that stayed.
        aliased = any(returns_alias(u, root) and u.args[0] is target
                      and (not written(u, root) or position[u] < position[node])
                      for u in target.users if u is not node)
        if returns_alias(target, root) or aliased:
            continue
        twin = _twin(graph, node, root)
        if twin is None:
            continue
        twin.meta = dict(node.meta)
        for user in list(target.users):
            if user not in (node, twin) and position[user] > position[node]:
                user.replace_input_with(target, twin)
        node.replace_all_uses_with(twin)
        graph.erase_node(node)


def shared_memory(nodes: List[fx.Node], root: Root) -> List[Set[fx.Node]]:
    """The sets of nodes that must be in one child for the updates in place left: the update,
    every name of its memory and their readers (none where only the update's own result is
    read later, as ``bn -> relu(inplace=True) -> conv``)."""
    position = {n: i for i, n in enumerate(nodes)}
    together = []
    for update in nodes:
        for value in written(update, root):
            names = _names_of(base(value, root), root)
            after = _names_of(update, root) if update in names else {update}
            # The output node reads last, what the child holding the update passes on.
            readers = {u for n in names for u in n.users
                       if u in position and u not in names and u is not update}
            early = [r for r in readers if position[r] < position[update]]
            late = [r for r in readers if r not in early
                    and any(a in names and a not in after for a in r.all_input_nodes)]
            if early or late:
                together.append({n for n in names | readers if n in position})
    return together


def _names_of(value: fx.Node, root: Root) -> Set[fx.Node]:
    """``value`` and every node that returns its memory, by views of views."""
    names = {value}
    pending = [value]
    while pending:
        for user in pending.pop().users:
            if user not in names and returns_alias(user, root) and user.args[0] in names:
                names.add(user)
                pending.append(user)
    return names

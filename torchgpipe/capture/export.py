"""Capturing a graph with :func:`torch.export.export`, for :func:`~torchgpipe.to_sequential`.

Unlike :mod:`torch.fx`, export runs ``forward`` on fake tensors of symbolic
sizes, so it follows branches on values and ``(*args, **kwargs)`` forwards
(transformers models). :func:`capture` gives its graph the form of an fx
trace: each tensor read is a ``get_attr`` of the user's tensor, and each
call of a one-input module fx would keep whole folds back into a
``call_module``; the rest are ATen operations of the module's mode.
"""
import inspect
import itertools
import operator
import warnings
from typing import Any, Dict, List, Set, Tuple

import torch
from torch import Tensor, fx, nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from torchgpipe.capture import alias
from torchgpipe.capture.graph import (Captured, Untouched, has_hooks, is_shape, named_arguments,
                                      output_nodes)
from torchgpipe.capture.interface import Interface
from torchgpipe.foundation.validation import brief, describe

__all__: List[str] = []


# Export's checks of a ``.to()``'s dtype: each operation checks its operands anyway.
_DROPPED = (torch.ops.aten._assert_tensor_metadata.default,)


def capture(module: nn.Module, example: Any) -> Captured:
    """Captures ``module`` called on ``example`` (a tensor, a tuple of positional arguments,
    or a dict of keyword arguments, every size dynamic) with :func:`torch.export.export`.

    Raises:
        TypeError: ``example`` does not fit ``module.forward``
        RuntimeError: export cannot capture ``module``
    """
    kwargs = _bind(module, example)
    exported = _export(module, kwargs)
    signature = exported.graph_signature
    source = exported.graph
    graph = fx.Graph()
    env: Dict[fx.Node, fx.Node] = {}
    root: Dict[str, Any] = {}
    names: List[str] = []
    inputs = iter(signature.input_specs)
    # _bind gave arguments that are not nested: one placeholder each.
    user = iter(kwargs.items())
    for node in source.nodes:
        if node.op == 'placeholder':
            spec = next(inputs)
            if spec.kind == InputKind.USER_INPUT:
                name, value = next(user)
                if not isinstance(value, Tensor):
                    continue  # a constant: export used its value
                env[node] = graph.placeholder(node.name)
                env[node].meta = dict(node.meta)
                names.append(name)
                continue
            target = str(spec.target)
            if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
                root[target] = module.get_parameter(target) \
                    if spec.kind == InputKind.PARAMETER else module.get_buffer(target)
            else:
                root[target] = exported.constants[target]
            env[node] = graph.get_attr(target)
            env[node].meta = dict(node.meta)
        elif node.op == 'output':
            for spec in signature.output_specs:
                if spec.kind != OutputKind.USER_OUTPUT:
                    alias.refuse_update(str(spec.target))
            outputs = [env[value] for value in output_nodes(node.args[0], node.args[0])]
            graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        elif node.target not in _DROPPED:
            if node.op == 'get_attr':
                # A graph of a higher-order operation, such as the code
                # under torch.autocast(enabled=False).
                root[str(node.target)] = getattr(exported.graph_module, str(node.target))
            env[node] = graph.node_copy(node, env.__getitem__)

    _fold(graph, module, root)
    alias.out_of_place(graph, root)
    # Parameters that forward never reads, or read only in folded calls.
    for node in list(graph.nodes):
        if node.op == 'get_attr' and not node.users:
            graph.erase_node(node)
    # What the sequential does not take: the constants given, and the
    # defaults of forward's arguments left out.
    defaults = {name: p.default for name, p in inspect.signature(module.forward).parameters.items()
                if p.default is not p.empty}
    fixed = {name: value for name, value in {**defaults, **kwargs}.items() if name not in names}
    return Captured(graph, root, Interface(names, fixed, exported.call_spec.out_spec,
                                           module.training))


def _export(module: nn.Module, kwargs: Dict[str, Any]) -> Any:
    """``torch.export.export`` of ``module`` on ``kwargs``, every size dynamic, the module
    left as it was; :class:`RuntimeError` if export cannot capture it."""
    shapes = {name: pytree.tree_map(_any_size, value) for name, value in kwargs.items()}
    # Positional as far as they go: a forward pre-hook reads its inputs from args.
    positional = [name for name, p in inspect.signature(module.forward).parameters.items()
                  if p.kind == p.POSITIONAL_OR_KEYWORD]
    leading = list(itertools.takewhile(kwargs.__contains__, positional))
    args = tuple(kwargs[name] for name in leading)
    rest = {name: value for name, value in kwargs.items() if name not in leading}
    untouched = Untouched(module)
    # export puts back what forward assigns: the hook sees it before.
    noting = module.register_forward_hook(untouched.note, always_call=True)
    # The handle removes the hook on leaving, after Untouched has put all back.
    with noting, untouched, warnings.catch_warnings():
        # export warns of a tensor assigned to the module; Untouched says more.
        warnings.filterwarnings('ignore', message='The tensor attribute')
        try:
            return torch.export.export(module, args, rest, dynamic_shapes=shapes, strict=False)
        except Exception as exc:
            raise RuntimeError(describe(
                f'torch.export cannot capture the module ({type(module).__name__})',
                f'{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ""}',
                'capture a submodule that holds the layers to pipeline, or change the code '
                'torch.export names (see its message, chained above)')) from exc


def _bind(module: nn.Module, example: Any) -> Dict[str, Any]:
    """The example as keyword arguments of ``module.forward`` in signature order, the order
    a positional call gives the sequential's inputs."""
    named = named_arguments(module)
    if isinstance(example, dict):
        unknown = [key for key in example if key not in named]
        if unknown:
            raise TypeError(describe('example_inputs must name arguments of module.forward',
                                     f'example_inputs: {", ".join(map(repr, unknown))} unknown',
                                     f'use the names of forward: {", ".join(named)}'))
        given = dict(example)
    else:
        args = example if isinstance(example, tuple) else (example,)
        if len(args) > len(named):
            raise TypeError(describe(f'example_inputs holds {len(args)} arguments but '
                                     f'module.forward names {len(named)}',
                                     f'module.forward: {inspect.signature(module.forward)}',
                                     'give them by name, in a dict'))
        given = dict(zip(named, args))
    for name, value in given.items():
        if type(value).__module__ == 'numpy':
            raise TypeError(describe(f'example_inputs[{name!r}] must be a tensor, not a '
                                     'numpy array', f'{name}: {type(value).__name__}',
                                     f'give torch.from_numpy({name}) instead'))
        if isinstance(value, (tuple, list, dict)) and pytree.tree_leaves(value) and any(
                isinstance(leaf, Tensor) for leaf in pytree.tree_leaves(value)):
            raise TypeError(describe(f'example_inputs[{name!r}] must be a tensor or a constant',
                                     f'{name}: a {type(value).__name__} of tensors',
                                     'give each tensor as an argument of its own'))
        if isinstance(value, Tensor) and value.dim() and value.size(0) < 2:
            # export takes a size of 0 or 1 for a constant.
            raise ValueError(describe(f'example_inputs[{name!r}] must hold at least 2 samples',
                                      f'{name}: shape {tuple(value.shape)}',
                                      'give an example batch of 2 or more'))
    if not any(isinstance(value, Tensor) for value in given.values()):
        raise TypeError(describe('example_inputs must hold a tensor: the sequential takes '
                                 'the tensors of the example', 'example_inputs: '
                                 f'{brief(example)}', 'give an example batch of the inputs '
                                 f'of forward, such as {{{named[0]!r}: x}}' if named else
                                 'give an example batch of the inputs of forward'))
    # One tensor given for two arguments would be one input: each gets its own memory.
    storages: Set[int] = set()
    for name, value in given.items():
        if isinstance(value, Tensor):
            if value.untyped_storage().data_ptr() in storages:
                given[name] = value.detach().clone().requires_grad_(value.requires_grad)
            storages.add(value.untyped_storage().data_ptr())
    # A key-value cache serves generation, not training: transformers makes none if asked.
    if 'use_cache' in named and 'use_cache' not in given:
        given['use_cache'] = False
    return {name: given[name] for name in named if name in given}


def _any_size(value: Any) -> Any:
    """Every dimension of a tensor may take any size; other values are fixed."""
    if isinstance(value, Tensor):
        return {d: Dim.AUTO for d in range(value.dim())}
    return None


def _foldable(module: nn.Module) -> bool:
    """Whether calls of ``module`` become calls again: a leaf, or a module with hooks, whose
    forward takes one value."""
    if not has_hooks(module):
        if isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)):
            return False
        leaf = (type(module).__module__.startswith('torch.nn')
                or next(module.children(), None) is None)
        if not leaf:
            return False
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _fold(graph: fx.Graph, module: nn.Module, root: Dict[str, Any]) -> None:
    """Folds each call of a foldable module into a ``call_module`` node, where its operations
    read one value from outside and the module's own tensors, and give one value out."""
    modules = dict(module.named_modules())
    calls: Dict[str, Tuple[str, List[fx.Node]]] = {}
    for node in graph.nodes:
        if node.op != 'call_function':
            continue
        for key, (path, _) in node.meta.get('nn_module_stack', {}).items():
            held = modules.get(path)
            if path and held is not None and _foldable(held):
                calls.setdefault(key, (path, []))[1].append(node)
                break

    for path, run in calls.values():
        held = modules[path]
        own = {id(t) for t in held.parameters()} | {id(t) for t in held.buffers()}
        inside = set(run)
        # Sizes of values from outside stay outside.
        for node in run:
            if is_shape(node) and not (set(node.all_input_nodes) & inside):
                inside.discard(node)
        body = [n for n in run if n in inside]
        reads = {a for n in body for a in n.all_input_nodes if a not in inside}
        attrs = {a for a in reads if a.op == 'get_attr'}
        # The module reads the sizes it needs from its input itself.
        values = {a for a in reads - attrs if not is_shape(a)}
        escaping = [n for n in body if any(u not in inside for u in n.users)]
        if (len(values) != 1 or len(escaping) != 1
                or not all(id(root[str(a.target)]) in own for a in attrs)
                or not all(_plain(n, inside) for n in body)
                or not isinstance(next(iter(values)).meta.get('val'), Tensor)
                or not isinstance(escaping[0].meta.get('val'), Tensor)):
            continue
        (value,) = values
        (result,) = escaping
        with graph.inserting_before(result):
            call = graph.call_module(path, (value,))
        call.meta = dict(result.meta)
        root[path] = held
        result.replace_all_uses_with(call)
        for node in reversed(body):
            graph.erase_node(node)


def _plain(node: fx.Node, inside: Set[fx.Node]) -> bool:
    """Whether a node of a module's call is one a call of the module would run: not a
    higher-order operation (``torch.no_grad()``'s body), whose context a call would lose."""
    if isinstance(node.target, torch._ops.OpOverload) or is_shape(node):
        return True
    return node.target is operator.getitem and node.args[0] in inside

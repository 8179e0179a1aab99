"""Capturing a graph with torch.export for :func:`~torchgpipe.to_sequential`.

:mod:`torch.fx` traces ``forward`` with symbolic values and no example: it
keeps every shape symbolic and needs no input, but it fails on code that
decides anything from a traced value (``if batch_size != ids.shape[0]``)
and on forwards that take ``(*args, **kwargs)``, which is how the models of
Hugging Face transformers are written. :func:`torch.export.export` runs
``forward`` on an example instead, with fake tensors whose sizes are
symbols: it follows every branch the example takes, and records a check
where a branch depends on a size. :func:`capture` gives
:func:`~torchgpipe.to_sequential` such a graph, in the form a
:mod:`torch.fx` trace has:

* each parameter, buffer or constant tensor ``forward`` reads is a
  ``get_attr`` node naming the user's tensor itself (the same object: an
  optimizer built on the model trains the sequential too);
* each call of a module that fx would keep whole (one of ``torch.nn``, or
  a module without submodules) whose ``forward`` takes one tensor is a
  ``call_module`` node again, folded back from the operations export
  recorded for it: the child is the user's module, which follows
  ``train()`` and ``eval()`` and reads its own state;
* what is left between those calls runs as recorded: ATen operations.

Those operations were recorded in the mode the module was in (the
``training`` flag decides dropout and such); :class:`Interface` keeps that
mode, and the generated children refuse to run in the other one.
"""
import inspect
import operator
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor, fx, nn
from torch.export import Dim
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from torchgpipe._validation import describe
from torchgpipe.microbatch import TensorOrTensors

__all__: List[str] = []


class Interface:
    """How to call a flattened sequential as the original module was called.

    :func:`~torchgpipe.to_sequential` puts one on the sequential it returns,
    as ``seq.interface``. The sequential (and GPipe around it) takes one
    tensor, or a tuple of tensors in the order of ``names``, and returns
    a tensor or a tuple of tensors; :meth:`inputs` and :meth:`outputs`
    translate from and to the original's way.

    Args:
        names (tuple of strs): the original's arguments the sequential
            takes, in order
        fixed (dict): the arguments fixed while capturing, with their value
        structure: how the original arranges the tensors it returns, or
            ``None`` for a tensor or a tuple of tensors as the sequential
        training (bool, optional): the mode the graph was captured in, when
            the generated children depend on it

    Example::

        >>> from torchgpipe import to_sequential
        >>> class Scale(nn.Module):
        ...     def forward(self, x, scale, inverse=False):
        ...         return {'y': x / scale if inverse else x * scale}
        >>> seq = to_sequential(Scale(), example_inputs={'x': torch.ones(2, 3),
        ...                                              'scale': torch.ones(2, 1)})
        >>> seq.interface.names
        ('x', 'scale')
        >>> output = seq(seq.interface.inputs(torch.ones(4, 3), scale=torch.full((4, 1), 2.)))
        >>> seq.interface.outputs(output)
        {'y': tensor([[2., 2., 2.],
                [2., 2., 2.],
                [2., 2., 2.],
                [2., 2., 2.]])}
    """

    def __init__(self, names: Sequence[str], fixed: Dict[str, Any],
                 structure: Optional[pytree.TreeSpec] = None,
                 training: Optional[bool] = None) -> None:
        self.names = tuple(names)
        self.fixed = dict(fixed)
        self.structure = structure
        self.training = training

    def __repr__(self) -> str:
        return f'Interface(names={self.names})'

    # pickle and copy.deepcopy: a TreeSpec's leaves do not copy quietly
    # (torch warns about the class they are made again with), so the
    # structure travels as nested tuples and is built again.
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state['structure'] = _encode(self.structure)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.structure = None if state['structure'] is None else _decode(state['structure'])

    def inputs(self, *args: Any, **kwargs: Any) -> TensorOrTensors:
        """Arranges arguments given as to the original module into the sequential's input.

        Returns:
            torch.Tensor or tuple: the one input tensor, or the tuple of them
            in the order of ``names``

        Raises:
            TypeError: an input is missing, unknown or given twice, or an
                argument fixed while capturing is given another value
        """
        if len(args) > len(self.names):
            raise TypeError(describe(f'inputs takes at most {len(self.names)} positional '
                                     'arguments', f'{len(args)} given',
                                     f'give them by name: {", ".join(self.names)}'))
        given = dict(zip(self.names, args))
        for name, value in kwargs.items():
            if name in given:
                raise TypeError(describe(f'inputs got {name!r} twice', f'{name}: given twice',
                                         'give it once, by position or by name'))
            if name in self.fixed and name not in self.names:
                if value is not self.fixed[name] and value != self.fixed[name]:
                    raise TypeError(describe(
                        f'{name} was fixed to {self.fixed[name]!r} when the model was captured',
                        f'{name}: {value!r}', f'capture the model with {name} in '
                        f'to_sequential(module, example_inputs=...) to make it an input'))
                continue
            if name not in self.names:
                raise TypeError(describe(f'the sequential takes no input {name!r}',
                                         f'{name}: given', 'give only '
                                         f'{", ".join(self.names)}, or capture the model with '
                                         f'{name} in to_sequential(module, example_inputs=...)'))
            given[name] = value
        missing = [name for name in self.names if name not in given]
        if missing:
            raise TypeError(describe(f'the sequential needs {", ".join(missing)}',
                                     f'given: {", ".join(given) or "nothing"}',
                                     f'give every one of {", ".join(self.names)}'))
        values = tuple(given[name] for name in self.names)
        return values[0] if len(values) == 1 else values

    def outputs(self, output: TensorOrTensors) -> Any:
        """Arranges the sequential's output as the original module returns it.

        Args:
            output (torch.Tensor or tuple): what the sequential (or GPipe
                around it) returned

        Returns:
            the original's output: a ``ModelOutput`` of transformers, a
            dict, a dataclass... holding those tensors
        """
        if self.structure is None:
            return output
        leaves = list(output) if isinstance(output, tuple) else [output]
        return pytree.tree_unflatten(leaves, self.structure)


def _encode(spec: Optional[pytree.TreeSpec]) -> Any:
    """A tree structure as nested tuples: ``None`` for a leaf, else (type, context, children)."""
    if spec is None or spec.is_leaf():
        return None
    # children() in recent releases of torch, the field children_specs before.
    children = spec.children() if callable(getattr(spec, 'children', None)) \
        else spec.children_specs
    return (spec.type, spec.context, [_encode(child) for child in children])


def _decode(encoded: Any) -> pytree.TreeSpec:
    """The tree structure :func:`_encode` encoded."""
    if encoded is None:
        return pytree.tree_structure(0)
    kind, context, children = encoded
    return pytree.TreeSpec(kind, context, [_decode(child) for child in children])


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
# Checks export adds for its own guarantees: that a ``.to()`` got the dtype
# it was traced with. Each operation checks its operands anyway.
_DROPPED = (torch.ops.aten._assert_tensor_metadata.default,)


def is_shape(node: fx.Node) -> bool:
    """Whether a node computes a shape, a size or a number from shapes only.

    Such values are no tensors, so they cannot go from child to child in
    GPipe; each child that uses one computes it again from its tensor.
    """
    if node.op == 'call_method' and node.target in ('size', 'dim', 'numel'):
        return True
    if node.op != 'call_function':
        return False
    if node.target is getattr:
        return node.args[1] in ('shape', 'ndim', 'dtype', 'device')
    if node.target in _SIZES:
        return True
    # Arithmetic on sizes: Python's operators (fx), and torch.sym_max and
    # such (export).
    if getattr(node.target, '__module__', '') in ('_operator', 'operator') \
            or getattr(node.target, '__name__', '').startswith('sym_'):
        return bool(node.all_input_nodes) and all(is_shape(a) for a in node.all_input_nodes)
    return False


def is_check(node: fx.Node) -> bool:
    """Whether ``node`` only checks a condition (``torch._assert``), making no value."""
    return node.op == 'call_function' and node.target in _CHECKS


def capture(module: nn.Module, example: Any) -> Captured:
    """Captures ``module`` called on ``example`` with :func:`torch.export.export`.

    Args:
        module (torch.nn.Module): the module
        example: a tensor, a tuple of positional arguments, or a dict of
            keyword arguments of ``module.forward``; every size of every
            tensor may differ when the sequential is called

    Returns:
        Captured: the graph, its attributes and the sequential's interface

    Raises:
        TypeError: ``example`` does not fit ``module.forward``
        RuntimeError: export cannot capture ``module``
    """
    kwargs = _bind(module, example)
    shapes = {name: pytree.tree_map(_any_size, value) for name, value in kwargs.items()}
    try:
        exported = torch.export.export(module, (), kwargs, dynamic_shapes=shapes, strict=False)
    except Exception as exc:
        raise RuntimeError(describe(
            f'torch.export cannot capture the module ({type(module).__name__})',
            f'{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ""}',
            'capture a submodule that holds the layers to pipeline, or change the code '
            'torch.export names (see its message, chained above)')) from exc

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
                    _refuse_update(str(spec.target))
            outputs = [env[value] for value in output_nodes(node.args[0], node.args[0])]
            graph.output(outputs[0] if len(outputs) == 1 else tuple(outputs))
        elif node.target not in _DROPPED:
            if node.op == 'get_attr':
                # A graph of a higher-order operation, such as the code
                # under torch.autocast(enabled=False).
                root[str(node.target)] = getattr(exported.graph_module, str(node.target))
            env[node] = graph.node_copy(node, env.__getitem__)

    _fold(graph, module, root)
    _out_of_place(graph)
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


def _refuse_update(buffer: str) -> None:
    """Raises the error for a buffer updated by code outside the module holding it."""
    raise RuntimeError(describe(
        'to_sequential cannot flatten code that updates a buffer outside the module holding it',
        f'updated: {buffer}', 'update it in a module of its own whose forward takes one tensor '
        '(its calls stay whole), or flatten with torch.fx, without example_inputs, keeping the '
        'module that updates it whole with leaf_modules'))


def named_arguments(module: nn.Module) -> List[str]:
    """The arguments of ``module.forward`` that can be given by name, in order."""
    return [name for name, p in inspect.signature(module.forward).parameters.items()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def output_nodes(leaves: Sequence[Any], shown: object) -> List[fx.Node]:
    """The nodes of a graph's outputs, checked to be values the graph computes.

    Raises:
        TypeError: an output is a constant (a number, ``None``): the
            sequential returns tensors only
    """
    if not all(isinstance(leaf, fx.Node) for leaf in leaves):
        raise TypeError(describe('module must return tensors to be flattened',
                                 f'output: {shown!r}', 'return the tensors alone'))
    return list(leaves)


def _bind(module: nn.Module, example: Any) -> Dict[str, Any]:
    """The example as keyword arguments of ``module.forward``, in the order of its signature.

    In that order, so that the sequential takes its inputs in the order a
    positional call gives them.
    """
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
        if isinstance(value, (tuple, list, dict)) and pytree.tree_leaves(value) and any(
                isinstance(leaf, Tensor) for leaf in pytree.tree_leaves(value)):
            raise TypeError(describe(f'example_inputs[{name!r}] must be a tensor or a constant',
                                     f'{name}: a {type(value).__name__} of tensors',
                                     'give each tensor as an argument of its own'))
        if isinstance(value, Tensor) and value.dim() and value.size(0) < 2:
            # export takes a size of 0 or 1 for a constant: a micro-batch of
            # another size would run code made for that one.
            raise ValueError(describe(f'example_inputs[{name!r}] must hold at least 2 samples',
                                      f'{name}: shape {tuple(value.shape)}',
                                      'give an example batch of 2 or more'))
    # A cache of keys and values serves generation, not training, and is
    # no tensor: transformers models make none when asked.
    if 'use_cache' in named and 'use_cache' not in given:
        given['use_cache'] = False
    return {name: given[name] for name in named if name in given}


def _any_size(value: Any) -> Any:
    """Every dimension of a tensor may take any size; other values are fixed."""
    if isinstance(value, Tensor):
        return {d: Dim.AUTO for d in range(value.dim())}
    return None


def _foldable(module: nn.Module) -> bool:
    """Whether calls of ``module`` become calls again: a leaf whose forward takes one value."""
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
    """Folds the operations of each call of a foldable module into a ``call_module`` node.

    A call folds when its operations read one value from outside (the
    input), only the module's own tensors besides, and give one value to
    the rest of the graph (the output). Sizes read from the input and used
    outside stay in the graph, before the call.
    """
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
    """Whether a node of a module's call is an operation a call of the module would run.

    Not a higher-order operation (the body of ``torch.no_grad()`` or
    ``torch.autocast``, whose items carry the stack of the modules called
    within): folded into a call, the module would run outside that context.
    """
    if isinstance(node.target, torch._ops.OpOverload) or is_shape(node):
        return True
    return node.target is operator.getitem and node.args[0] in inside


def _returns_alias(node: fx.Node) -> bool:
    """Whether a node returns a view of (or, in place, the same tensor as) its first argument."""
    schema = getattr(node.target, '_schema', None)
    return (node.op == 'call_function' and schema is not None and bool(schema.returns)
            and schema.returns[0].alias_info is not None and bool(node.args)
            and isinstance(node.args[0], fx.Node))


def _base(node: fx.Node) -> fx.Node:
    """The tensor whose memory ``node`` is a view of (itself if it is no view)."""
    while _returns_alias(node):
        node = node.args[0]  # type: ignore[assignment]
    return node


def _functional(op: Any) -> Optional[Any]:
    """The operation that returns what the in-place ``op`` writes (``add`` for ``add_``)."""
    name = op._schema.name.split('::')[-1]
    if not name.endswith('_'):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, op._overloadname, None) if packet is not None else None


def _out_of_place(graph: fx.Graph) -> None:
    """Turns the updates in place export recorded (``out += identity``) into new values.

    Generated code runs once per micro-batch, and again when a checkpointed
    micro-batch is recomputed: an update of a tensor another child made (a
    skip it popped, its input) would be seen by that recomputation, or be
    made twice. ``x.add_(y)`` becomes ``x2 = x + y``, and what read ``x``
    after the update reads ``x2``. An update of a view, or of a tensor that
    has views, is left as it is (the update shows through every alias);
    an update of a buffer is refused.

    Raises:
        RuntimeError: the code updates a buffer (or a view of one)
    """
    for node in list(graph.nodes):
        schema = getattr(node.target, '_schema', None)
        if node.op != 'call_function' or schema is None or not schema.is_mutable:
            continue
        written = [value for argument, value in zip(schema.arguments, node.args)
                   if argument.alias_info is not None and argument.alias_info.is_write
                   and isinstance(value, fx.Node)]
        for value in written:
            if _base(value).op == 'get_attr':
                _refuse_update(str(_base(value).target))
        functional = _functional(node.target)
        if functional is None or written != [node.args[0]]:
            continue
        target: fx.Node = node.args[0]
        position = {n: i for i, n in enumerate(graph.nodes)}
        # Aliases of the target: its views, and the updates in place before
        # this one that stayed (those after it are turned in their turn).
        aliased = any(_returns_alias(u) and (not u.target._schema.is_mutable  # type: ignore
                                             or position[u] < position[node])
                      for u in target.users if u is not node)
        if _returns_alias(target) or aliased:
            continue
        with graph.inserting_before(node):
            value = graph.call_function(functional, node.args, node.kwargs)
        value.meta = dict(node.meta)
        for user in list(target.users):
            if user not in (node, value) and position[user] > position[node]:
                user.replace_input_with(target, value)
        node.replace_all_uses_with(value)
        graph.erase_node(node)

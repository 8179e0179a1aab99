"""Capturing a graph with :mod:`torch.fx`, for :func:`~torchgpipe.to_sequential`.

``forward`` runs on symbolic values: no example is needed and every size
stays symbolic. Modules of ``torch.nn``, skippable layers, modules with
hooks and the ``leaf_modules`` a user names are kept whole, as
``call_module`` nodes. When fx fails, the error names the module and the
line, and a change that works.
"""
import inspect
import linecache
import os
import traceback
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import fx, nn
from torch.fx.immutable_collections import immutable_dict, immutable_list
from torch.utils import _pytree as pytree

from torchgpipe.capture import alias
from torchgpipe.capture.graph import Captured, has_hooks, named_arguments, output_nodes, resolve
from torchgpipe.capture.interface import Interface
from torchgpipe.capture.untouched import Untouched
from torchgpipe.foundation.validation import describe
from torchgpipe.skip.skippable import Skippable

__all__: List[str] = []


LeafSpec = Union[Type[nn.Module], nn.Module]

class Tracer(fx.Tracer):
    """fx's tracer, which also keeps the given classes and instances whole.

    fx also makes one with no argument, to trace a generated child's code
    again when it loads a pickled child (see :class:`~torchgpipe.capture.cut.GeneratedChild`).
    """

    def __init__(self, leaf_modules: Sequence[LeafSpec] = (),
                 constants: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        # Buffers read in forward become nodes, not constants: a causal mask
        # sliced by a traced length (mask[:T, :T]) then traces.
        self.proxy_buffer_attributes = True
        self.leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self.leaf_ids = {id(m) for m in leaf_modules if isinstance(m, nn.Module)}

        #: the constant tensors forward makes, by the name get_attr nodes read
        #: them by; None: on the module traced, as fx keeps them (fx's tracer
        #: of a loaded child, whose module is fx's, not the user's)
        self.constants = constants

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # A skippable layer's forward is a generator that talks to the skip
        # tracker: it must stay a child, called by the sequential. A module
        # with hooks stays whole so that they run at each call, as the user
        # wrote them: traced through, their Python would run once, here.
        return (isinstance(m, self.leaf_types + (Skippable,)) or id(m) in self.leaf_ids
                or has_hooks(m) or super().is_leaf_module(m, module_qualified_name))

    def create_arg(self, a: Any) -> Any:
        # fx keeps a constant tensor as an attribute of the module it traces,
        # which is the user's: kept here instead.
        if self.constants is not None and isinstance(a, torch.Tensor) and \
                a not in self.tensor_attrs:
            name = f'_tensor_constant{len(self.constants)}'
            self.constants[name] = a
            self.tensor_attrs[a] = name
        return super().create_arg(a)

    def create_args_for_root(self, root_fn: Any, is_module: bool,
                             concrete_args: Any = None) -> Tuple[Any, List[Any]]:
        fn, args = super().create_args_for_root(root_fn, is_module, concrete_args)
        if not (is_module and has_hooks(self.root)):
            return fn, args
        # fx calls the root's forward, not the root: its own hooks would be
        # left out. Called through nn.Module's call, they are traced too.
        # check_root_hooks refused what fx would have wrapped (*args, **kwargs).
        assert fn is root_fn, 'a root with hooks whose forward fx wraps'
        call: Callable[..., Any] = nn.Module._call_impl
        return (lambda module, *inputs: call(module, *inputs)), args


def check_root_hooks(module: nn.Module) -> None:
    """Refuses hooks of the module itself that its trace cannot run, before tracing.

    Raises:
        RuntimeError: the module has backward hooks, or hooks and a
            ``forward`` that takes ``*args``, ``**kwargs`` or keyword-only
            arguments (which fx calls through a wrapper of its own)
    """
    if module._backward_pre_hooks or module._backward_hooks:
        raise RuntimeError(describe(
            'to_sequential cannot capture backward hooks of the module itself',
            f'module: {type(module).__name__} with backward hooks',
            'register them on a submodule, which then stays whole, or on the tensors'))
    kinds = {p.kind for p in inspect.signature(module.forward).parameters.values()}
    if has_hooks(module) and kinds & {inspect.Parameter.VAR_POSITIONAL,
                                      inspect.Parameter.VAR_KEYWORD,
                                      inspect.Parameter.KEYWORD_ONLY}:
        raise RuntimeError(describe(
            'torch.fx cannot trace the hooks of a module whose forward takes *args, '
            '**kwargs or keyword-only arguments', f'module: {type(module).__name__} with hooks',
            'give an example input to capture it with torch.export, which runs them'))


def capture(module: nn.Module, leaves: List[LeafSpec],
                concrete_args: Optional[Dict[str, Any]]) -> Captured:
    """Traces ``module`` with :mod:`torch.fx`, with symbolic values: no example needed."""
    check_root_hooks(module)
    constants: Dict[str, Any] = {}
    tracer = Tracer(leaves, constants)
    # Called as the module is usually called: an argument with a default
    # (mask=None, is_causal=False) takes it, unless concrete_args says else.
    # Traced as an input instead, a None default would be taken for a tensor.
    # torch.fx.PH (fx's placeholder) keeps such an argument an input.
    concrete_args = {name: value
                     for name, value in {**_defaults(module), **(concrete_args or {})}.items()
                     if value is not fx.PH}  # type: ignore[attr-defined]
    with Untouched(module):
        graph = _trace(module, tracer, concrete_args)
    _drop_concrete_args(graph, module, concrete_args)
    # By the argument's name: fx renames a node that would shadow a builtin.
    names = [str(n.target) for n in graph.nodes if n.op == 'placeholder']
    # A dict, a dataclass... of tensors is returned as the tuple of them,
    # which the interface arranges back.
    output = next(n for n in graph.nodes if n.op == 'output')
    flat, structure = pytree.tree_flatten(_mutable(output.args[0]))
    results = output_nodes(flat, output.args[0])
    plain = isinstance(output.args[0], fx.Node) or (
        type(output.args[0]) is tuple and all(isinstance(r, fx.Node) for r in output.args[0]))
    output.args = (results[0] if len(results) == 1 else tuple(results),)
    root = resolve(graph, module, constants)
    alias.out_of_place(graph, root)
    return Captured(graph, root, Interface(names, concrete_args, None if plain else structure))

def _mutable(value: Any) -> Any:
    """``value`` with fx's immutable dicts and lists as plain ones, as forward returned them."""
    if isinstance(value, immutable_dict):
        return {key: _mutable(item) for key, item in value.items()}
    if isinstance(value, immutable_list):
        return [_mutable(item) for item in value]
    if type(value) is tuple:
        return tuple(_mutable(item) for item in value)
    return value

def _trace(module: nn.Module, tracer: Tracer,
           concrete_args: Optional[Dict[str, Any]]) -> fx.Graph:
    """Traces ``module``, explaining a failure by the module and line that caused it."""
    try:
        return tracer.trace(module, concrete_args)
    except Exception as exc:
        # The innermost frame outside torch is the user's line that failed;
        # its ``self`` is the module being traced there.
        torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
        user = [(frame, lineno) for frame, lineno in traceback.walk_tb(exc.__traceback__)
                if not os.path.abspath(frame.f_code.co_filename).startswith(torch_dir)
                and frame.f_code.co_filename != __file__]
        # Any trace fx fails, export may capture: it runs forward on an
        # example, so it follows branches on sizes and any signature.
        export = ('give an example input to capture it with torch.export instead: '
                  f'to_sequential(module, example_inputs={_example_of(module)})')
        if not user:
            # fx failed on its own, before any line of forward ran: a
            # signature it cannot read, such as a decorator's (*args, **kwargs).
            raise RuntimeError(f'torch.fx cannot trace the module ({type(module).__name__}) '
                               f'({type(exc).__name__}: {exc}); {export}') from exc
        frame, lineno = user[-1]
        code = frame.f_code
        failing = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
        if not isinstance(failing, nn.Module):
            failing = module
        names = {id(m): name for name, m in module.named_modules()}
        where = names.get(id(failing)) or 'the module itself'
        cls = type(failing).__name__
        line = linecache.getline(frame.f_code.co_filename, lineno).strip()
        if failing is module:
            # The module itself cannot be a leaf of its own flattening.
            fix = ('move that code into a submodule and keep the submodule whole with '
                   'leaf_modules=[<its class>], make it static: fix the argument that '
                   f'decides the control flow with concrete_args, or {export}')
        else:
            fix = (f'keep the module whole as one layer with to_sequential(module, '
                   f'leaf_modules=[{cls}]), fix the argument that decides the control '
                   f'flow with concrete_args, or {export}')
        raise RuntimeError(
            f'torch.fx cannot trace {where} ({cls}) at {frame.f_code.co_filename}:{lineno}: '
            f'{line!r} ({type(exc).__name__}: {exc}); {fix}') from exc

def _example_of(module: nn.Module) -> str:
    """How to give an example for ``module``: its main input by name, if it has a name."""
    names = named_arguments(module)
    # transformers models name their main input (pixel_values, input_ids).
    main = getattr(module, 'main_input_name', None)
    name = main if isinstance(main, str) and main in names else names[0] if names else None
    return 'x' if name is None or name in ('x', 'input') else f"{{'{name}': x}}"

def _defaults(module: nn.Module) -> Dict[str, Any]:
    """The arguments of ``module.forward`` that have a default value, with it."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name: p.default for name, p in inspect.signature(module.forward).parameters.items()
            if p.kind in kinds and p.default is not inspect.Parameter.empty}

def _drop_concrete_args(graph: fx.Graph, module: nn.Module,
                        concrete_args: Dict[str, Any]) -> None:
    """Removes the inputs fixed by ``concrete_args``, and fx's checks of their values.

    fx keeps a placeholder for each, read only by an assertion that the
    value given is the one traced with: the sequential takes the other
    inputs alone, as GPipe passes tensors only.
    """
    names = list(inspect.signature(module.forward).parameters)
    placeholders = [n for n in graph.nodes if n.op == 'placeholder']
    for name, placeholder in zip(names, placeholders):
        if name not in concrete_args:
            continue
        doomed: Dict[fx.Node, None] = {}
        pending = [placeholder]
        while pending:
            node = pending.pop()
            if node not in doomed:
                doomed[node] = None
                pending.extend(node.users)
        # Users first: fx erases a node only once nothing reads it.
        for node in reversed(list(graph.nodes)):
            if node in doomed:
                graph.erase_node(node)

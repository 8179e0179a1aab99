"""Capturing a graph with :mod:`torch.fx`, for :func:`~torchgpipe.to_sequential`.

``forward`` runs on symbolic values: no example, every size symbolic.
Modules of ``torch.nn``, skippable layers, modules with hooks and the
``leaf_modules`` given stay whole. A failure names the module, the line,
and a change that works.
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
from torchgpipe.capture.graph import (Captured, Untouched, has_hooks, named_arguments,
                                      output_nodes, resolve)
from torchgpipe.capture.interface import Interface
from torchgpipe.foundation.validation import describe
from torchgpipe.skip.skippable import Skippable

__all__: List[str] = []


LeafSpec = Union[Type[nn.Module], nn.Module]

class Tracer(fx.Tracer):
    """fx's tracer, which also keeps the given classes and instances whole (fx makes one
    with no argument to trace a generated child again as it unpickles it)."""

    def __init__(self, leaf_modules: Sequence[LeafSpec] = (),
                 constants: Optional[Dict[str, Any]] = None) -> None:
        super().__init__()
        # Buffers read in forward become nodes, not constants: a causal mask
        # sliced by a traced length (mask[:T, :T]) then traces.
        self.proxy_buffer_attributes = True
        self.leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self.leaf_ids = {id(m) for m in leaf_modules if isinstance(m, nn.Module)}

        #: the constant tensors forward makes, by name; None: on the module traced
        #: (a loaded child's, whose module is fx's)
        self.constants = constants

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # A skippable layer's generator talks to the skip tracker; hooks run at each call.
        return (isinstance(m, self.leaf_types + (Skippable,)) or id(m) in self.leaf_ids
                or has_hooks(m) or super().is_leaf_module(m, module_qualified_name))

    def create_arg(self, a: Any) -> Any:
        # Not on the user's module, where fx would keep a constant tensor.
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
        # fx calls the root's forward: through nn.Module's call its hooks trace too.
        assert fn is root_fn, 'a root with hooks whose forward fx wraps'
        call: Callable[..., Any] = nn.Module._call_impl
        return (lambda module, *inputs: call(module, *inputs)), args


def check_root_hooks(module: nn.Module) -> None:
    """Refuses hooks of the module itself that its trace cannot run, before tracing.

    Raises:
        RuntimeError: the module has backward hooks, or hooks and a ``forward``
            taking ``*args``, ``**kwargs`` or keyword-only arguments
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
    # Arguments with defaults take them (a None would be traced as a tensor), unless
    # concrete_args says else; torch.fx.PH keeps one an input.
    concrete_args = {name: value
                     for name, value in {**_defaults(module), **(concrete_args or {})}.items()
                     if value is not fx.PH}  # type: ignore[attr-defined]
    with Untouched(module):
        graph = _trace(module, tracer, concrete_args)
    _drop_concrete_args(graph, module, concrete_args)
    # By the argument's name: fx renames a node that would shadow a builtin.
    names = [str(n.target) for n in graph.nodes if n.op == 'placeholder']
    # A dict or dataclass of tensors returns as their tuple; the interface arranges it back.
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
        # Export, on an example, follows branches on sizes and any signature.
        export = ('give an example input to capture it with torch.export instead: '
                  f'to_sequential(module, example_inputs={_example_of(module)})')
        if not user:
            # fx failed before forward ran: a signature it cannot read.
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
    """Removes the inputs fixed by ``concrete_args`` and fx's checks of their values: the
    sequential takes the tensor inputs alone."""
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

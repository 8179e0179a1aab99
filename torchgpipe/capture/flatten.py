"""Flattening a module into an ``nn.Sequential`` that GPipe can cut anywhere.

:func:`to_sequential` captures ``forward`` (:mod:`torchgpipe.capture`) and cuts
the graph into children (:mod:`torchgpipe.capture.cut`): each leaf module
called once is a child, the code between leaf calls a generated
:class:`torch.fx.GraphModule`; a value used further down travels as a skip
connection (:mod:`torchgpipe.skip`), straight to the partition that uses it.
"""
from collections import OrderedDict
from functools import partial
from typing import Any, Dict, Iterable, List, Optional, Tuple, cast

import torch
from torch import fx, nn

from torchgpipe.capture import export, fx as fx_capture, pieces
from torchgpipe.capture.cut import GeneratedChild, child_name, transient
from torchgpipe.capture.fx import LeafSpec
from torchgpipe.capture.graph import attr, named_arguments
from torchgpipe.foundation.validation import brief, describe
from torchgpipe.modules.gpipe import GPipe
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.skippable import skippable_class

__all__ = ['to_sequential']

def to_sequential(module: nn.Module, *,
                  example_inputs: Any = None,
                  leaf_modules: Iterable[LeafSpec] = (),
                  concrete_args: Optional[Dict[str, Any]] = None) -> nn.Sequential:
    """Flattens a module into an ``nn.Sequential`` that GPipe can partition anywhere.

    Without an example, ``forward`` is traced with :mod:`torch.fx` (sizes
    symbolic); with ``example_inputs`` (or a model's ``dummy_inputs``, as in
    transformers) it is captured by :func:`torch.export.export`, which follows
    branches on sizes and reads any signature.

    The result holds the leaf modules themselves (an optimizer built on
    ``module.parameters()`` trains it too), named by qualified name
    (``layers_0_attn``), and generated children for the code between them,
    named by their first operation (``add_3``); a module with state called at
    several places becomes one child with everything between its uses. Its
    ``interface`` (:class:`~torchgpipe.capture.Interface`) maps a call of the
    original to its input and the outputs back; its ``state_dict_map`` maps each
    key of ``module.state_dict()`` to its own::

        seq = to_sequential(model)
        seq.load_state_dict({seq.state_dict_map[k]: v for k, v in checkpoint.items()})

    Side effects of ``forward`` are repeated at each call or refused, never
    dropped (:ref:`any-model-effects`); ``module`` is left as it was. Both modes
    (``training``) are captured, each generated child running the current
    mode's code; a mode that cuts differently is refused (:doc:`/troubleshooting`).

    .. note::

        Values between children must be tensors (sizes are computed again by
        each child); any other value belongs inside one leaf module.

    Args:
        module (torch.nn.Module): the module to flatten

    Keyword Args:
        example_inputs (optional): an example input for :func:`torch.export.export`:
            a tensor, a tuple of positional arguments, or a dict of keyword
            arguments; give at least 2 of each size (default: the module's
            ``dummy_inputs`` if any, else trace with torch.fx)
        leaf_modules (iterable): module classes, or modules, kept whole as one
            child each besides those of ``torch.nn`` and skippable layers (default: none)
        concrete_args (dict, optional): arguments of ``forward`` fixed while
            tracing, as for :meth:`torch.fx.Tracer.trace`; ``torch.fx.PH`` makes
            an argument with a default an input (default: none)

    Returns:
        torch.nn.Sequential: the flattened module

    Raises:
        RuntimeError: fx cannot trace ``module`` (the message names the line),
            torch.export cannot capture it, or the captured code updates a buffer
            outside its module or assigns an attribute; ``module`` is left as it was
        TypeError: ``module`` is not an ``nn.Module`` or is a TorchScript module;
            ``leaf_modules`` is not an iterable of module classes and modules;
            ``example_inputs`` does not fit ``forward``, or comes with
            ``leaf_modules`` or ``concrete_args``; or ``module`` returns other
            values than tensors

    Example::

        >>> class Residual(nn.Module):
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 4)
        ...     def forward(self, x):
        ...         return x + self.fc2(F.relu(self.fc1(x)))
        >>> seq = to_sequential(Residual())
        >>> [name for name, _ in seq.named_children()]
        ['fc1', 'relu', 'fc2', 'add']
    """
    leaves = _check_arguments(module, leaf_modules)
    example = example_inputs if example_inputs is not None else _dummy_inputs(module)
    if example is not None:
        if leaves or concrete_args is not None:
            raise TypeError(describe(
                'leaf_modules and concrete_args apply to the torch.fx capture, not to '
                'torch.export', 'example_inputs: given' if example_inputs is not None else
                f'module: {type(module).__name__}, which gives dummy_inputs',
                'leave them out: calls of modules whose forward takes one tensor stay whole'))
        capture = partial(export.capture, module, example)
    else:
        capture = partial(fx_capture.capture, module, leaves, concrete_args)
    captured = capture()
    other, refusal = pieces.capture_other_mode(module, capture)
    if example is None:
        # fx bakes the mode into its trace silently: a trace alike in both modes runs in
        # both, else each mode runs its own, as export's.
        if other is not None and pieces.same(captured, other):
            other = None
        else:
            captured.interface.training = module.training
    graph, root, interface = captured
    parts = pieces.cut_parts(graph, root)
    orders: Optional[List[List[fx.Node]]] = None
    if other is not None:
        other_root = other.root
        other_parts = pieces.cut_parts(other.graph, other_root)
        orders, refusal = pieces.match(parts, other_parts, captured, other)

    ns = Namespace()
    users = {id(m) for m in module.modules()}
    state = {id(t): key for key, t in module.state_dict(keep_vars=True).items()}
    children: Dict[str, nn.Module] = {}
    for k, segment in enumerate(parts.segments):
        name = child_name(segment)
        held = pieces.lone_call(parts, k, root, interface)
        if orders is not None and \
                held is not pieces.lone_call(other_parts, k, other_root, interface):
            held = None  # a call in one mode only: generated in both
        if held is not None and all(child is not held for child in children.values()):
            children[name] = held
            continue

        graph_module = fx.GraphModule(root, pieces.piece(parts, k, parts.pops[k]), class_name=name)
        transients = [str(n.target) for n in segment
                      if n.op == 'get_attr' and transient(attr(root, n.target), state)]
        other_mode = None
        if orders is not None:
            piece = pieces.piece(other_parts, k, orders[k])
            transients += pieces.hold(graph_module, piece, other_root, state)
            other_mode = fx.GraphModule(graph_module, piece, class_name=name)
        pop_names = [f'{a.name}:{k}' for a in parts.pops[k]]
        stash_names = [f'{a.name}:{j}' for a, j in parts.stashes[k]]
        step_cls = skippable_class(GeneratedChild, tuple(sorted(stash_names)),
                                   tuple(sorted(pop_names)))
        step = step_cls(graph_module, len(parts.inputs[k]) != 1, pop_names, stash_names,
                        list(dict.fromkeys(transients)), interface.training, other_mode,
                        refusal, module)
        # The child's own modules in the module's mode (it may hold the user's).
        for part in step.modules():
            if id(part) not in users:
                part.training = module.training
        children[name] = step.isolate(ns)

    seq = nn.Sequential(OrderedDict(children))
    setattr(seq, 'state_dict_map', _state_dict_map(module, seq))
    setattr(seq, 'interface', interface)
    return seq


def _dummy_inputs(module: nn.Module) -> Optional[Dict[str, Any]]:
    """The example a model gives of its inputs (transformers' ``dummy_inputs``), if any, of
    the arguments ``forward`` names."""
    dummy = getattr(module, 'dummy_inputs', None)
    if not isinstance(dummy, dict):
        return None
    named = named_arguments(module)
    return {key: value for key, value in dummy.items() if key in named} or None


def _check_arguments(module: object, leaf_modules: object) -> List[LeafSpec]:
    """Checks the arguments of :func:`to_sequential` before it traces anything (fx would
    fail deep inside on TorchScript, and ignore a string of leaf modules); returns the
    leaf modules as a list."""
    if isinstance(module, torch.jit.ScriptModule):
        raise TypeError(describe('module must be a Python nn.Module to be flattened, '
                                 'not a TorchScript module',
                                 f'module: {type(module).__name__} of {module.original_name}',
                                 'pass the module you gave torch.jit.script or torch.jit.trace'))
    if not isinstance(module, nn.Module):
        raise TypeError(describe('module must be an nn.Module to be flattened',
                                 f'module: {brief(module)}',
                                 'wrap it in an nn.Module whose forward calls it'))
    if isinstance(module, GPipe):
        raise TypeError(describe('module must not be a GPipe to be flattened: it is '
                                 'a pipeline already', f'module: GPipe of {len(module)} layers',
                                 'flatten the model it wraps, to_sequential(gpipe.unwrap())'))

    fix = 'give a list of module classes or modules, such as leaf_modules=[nn.LSTM, model.head]'
    if isinstance(leaf_modules, str):
        raise TypeError(describe('leaf_modules must be an iterable of module classes or modules, '
                                 'not a name', f'leaf_modules: {leaf_modules!r}',
                                 f'give the class itself, in a list: '
                                 f'leaf_modules=[{leaf_modules}]'))
    try:
        given = list(leaf_modules)  # type: ignore[call-overload]
    except TypeError:
        raise TypeError(describe('leaf_modules must be an iterable of module classes or modules',
                                 f'leaf_modules: {brief(leaf_modules)}', fix)) from None
    for i, leaf in enumerate(given):
        if not (isinstance(leaf, nn.Module)
                or (isinstance(leaf, type) and issubclass(leaf, nn.Module))):
            raise TypeError(describe(f'leaf_modules[{i}] must be a module class or a module',
                                     f'leaf_modules[{i}]: {brief(leaf)}', fix))
    return cast(List[LeafSpec], given)


def _state_dict_map(module: nn.Module, seq: nn.Sequential) -> Dict[str, str]:
    """Maps each key of ``module.state_dict()`` to the sequential's key of its tensor: the
    same slot (module and attribute) first, so a tied ``head.weight`` stays ``head.weight``;
    else the same tensor (one glue code reads)."""
    def slots(m: nn.Module) -> Dict[str, Tuple[Tuple[int, str], int]]:
        found = {}
        for key, tensor in m.state_dict(keep_vars=True).items():
            owner, _, name = key.rpartition('.')
            found[key] = (id(m.get_submodule(owner)), name), id(tensor)
        return found

    new = slots(seq)
    by_slot = {slot: key for key, (slot, _) in new.items()}
    by_tensor: Dict[int, str] = {}
    for key, (_, tensor) in new.items():
        by_tensor.setdefault(tensor, key)
    mapping = {}
    for key, (slot, tensor) in slots(module).items():
        if slot in by_slot:
            mapping[key] = by_slot[slot]
        elif tensor in by_tensor:
            mapping[key] = by_tensor[tensor]
    return mapping



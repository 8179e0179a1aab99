"""Flattening a module into an ``nn.Sequential`` that GPipe can cut anywhere.

:func:`to_sequential` traces a module's ``forward`` with :mod:`torch.fx`
(or, given an example, has :mod:`torchgpipe.capture` capture it with
:func:`torch.export.export`, into a graph of the same form) and cuts the
graph into a row of children:

* every *leaf* module called once (``nn.Linear``, ``nn.LayerNorm``, a module
  named in ``leaf_modules``...) becomes a child of its own; containers
  (``nn.Sequential``, ``nn.ModuleList`` loops, nested blocks) are traced
  through, so they dissolve into their leaves;
* the code between two leaf calls (``F.*`` calls, tensor methods, ``+``,
  ``torch.cat``, indexing, parameters and buffers read in ``forward``)
  becomes a small generated child, an :class:`torch.fx.GraphModule` that
  holds the very parameters and buffers it reads;
* a module with parameters or buffers called at several places, or a
  parameter read by glue code at several places, cannot be two children
  (GPipe refuses a layer in two partitions), so the first use, the last one
  and everything between become one generated child. A module without
  either (a dropout, an activation) joins nothing: each call is a child. A
  parameter tied between two different modules (an embedding and an output
  projection) joins nothing either: GPipe shares it across partitions.

Each child passes the next one exactly the values it needs (a tensor, or a
tuple of tensors). A value used further down travels as a skip connection:
the child holding it stashes it and the child using it pops it
(:mod:`torchgpipe.skip`), so that inside GPipe it goes straight from the
partition that makes it to the partition that uses it.
"""
import inspect
import linecache
import operator
import os
import traceback
from collections import OrderedDict
from typing import (Any, Dict, Generator, Iterable, List, Optional, Sequence, Tuple, Type,
                    Union)

import torch
from torch import Tensor, fx, nn
from torch.utils import _pytree as pytree

from torchgpipe._validation import brief, describe
from torchgpipe.capture import (Captured, Interface, capture, is_check, is_shape, named_arguments,
                                output_nodes)
from torchgpipe.gpipe import GPipe
from torchgpipe.microbatch import TensorOrTensors
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.skippable import Skippable, pop, skippable_class, stash

__all__ = ['to_sequential']

LeafSpec = Union[Type[nn.Module], nn.Module]


class _Tracer(fx.Tracer):
    """fx's tracer, which also keeps the given classes and instances whole.

    fx also makes one with no argument, to trace a generated child's code
    again when it loads a pickled child (see :class:`_Step`).
    """

    def __init__(self, leaf_modules: Sequence[LeafSpec] = ()) -> None:
        super().__init__()
        # Buffers read in forward become nodes, not constants: a causal mask
        # sliced by a traced length (mask[:T, :T]) then traces.
        self.proxy_buffer_attributes = True
        self.leaf_types = tuple(m for m in leaf_modules if isinstance(m, type))
        self.leaf_ids = {id(m) for m in leaf_modules if isinstance(m, nn.Module)}

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        # A skippable layer's forward is a generator that talks to the skip
        # tracker: it must stay a child, called by the sequential.
        return (isinstance(m, self.leaf_types + (Skippable,)) or id(m) in self.leaf_ids
                or super().is_leaf_module(m, module_qualified_name))


class _Step(nn.Module):
    """One generated child: runs its piece of the traced graph between pops and stashes.

    Args:
        graph_module (torch.fx.GraphModule): takes the values received from
            the previous child, then the popped ones; returns the output for
            the next child and the tuple of values to stash
        tuple_input (bool): whether the previous child passes a tuple
        pops (list of strs): the skip names to pop, in argument order
        stashes (list of strs): the skip names to stash, in result order
        transient (list of strs): the qualified names, in ``graph_module``,
            of the tensors to leave out of the state dict
        captured_training (bool, optional): the mode torch.export recorded
            the graph in (its operations may depend on it: dropout recorded
            on or off), in which alone the step runs; ``None`` for a graph
            traced by torch.fx
    """

    def __init__(self, graph_module: fx.GraphModule, tuple_input: bool,
                 pops: List[str], stashes: List[str], transient: List[str],
                 captured_training: Optional[bool] = None) -> None:
        super().__init__()
        self.graph = graph_module
        self.tuple_input = tuple_input
        self.pops = pops
        self.stashes = stashes
        self.transient = transient
        self.captured_training = captured_training
        self._leave_out_transient()

    # How a step is copied (pickle, torch.save, copy.deepcopy):
    #
    # * this class is found by its name, and the skippable class generated
    #   around it is made again from it and the skip names (see Skippable);
    # * the graph module copies itself, as fx does: deepcopy builds it again
    #   from a copy of its graph; pickle saves the source fx generated from
    #   the graph (fx's choice: its Graph format may change between
    #   versions) and, on load, runs it and traces it again into a graph,
    #   with the tracer class the graph names (fx.Graph(tracer_cls=...)):
    #   ours, which keeps buffers as nodes as when the model was traced;
    # * both ways fx registers every tensor the code reads as a persistent
    #   buffer again, so the step marks its transient tensors once more.
    #
    # The step asks nothing else of the graph module: another way to
    # capture the graph only needs a module that copies itself.
    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self._leave_out_transient()

    def _leave_out_transient(self) -> None:
        for name in self.transient:
            owner, _, field = name.rpartition('.')
            self.graph.get_submodule(owner)._non_persistent_buffers_set.add(field)

    def forward(self, input: TensorOrTensors) -> Generator[Any, Any, TensorOrTensors]:
        if self.captured_training is not None and self.training != self.captured_training:
            # Running the operations recorded in the other mode would be
            # silently wrong: dropout on in evaluation, or off in training.
            mode, other = ('training', 'evaluation') if self.captured_training \
                else ('evaluation', 'training')
            raise RuntimeError(describe(
                f'this part of the sequential was captured in {mode} mode by torch.export '
                f'and cannot run in {other} mode', f'{type(self).__name__}: '
                f'training={self.training}', f'capture the model in {other} mode too: '
                f'to_sequential(model.{"train" if other == "training" else "eval"}()), '
                'and use each sequential in its mode (they share the parameters)'))
        inputs = input if self.tuple_input else (input,)
        popped = []
        for name in self.pops:
            popped.append((yield pop(name)))
        output, stashed = self.graph(*inputs, *popped)
        for name, value in zip(self.stashes, stashed):
            yield stash(name, value)
        return output  # type: ignore[no-any-return]


def _trace(module: nn.Module, tracer: _Tracer,
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


def _attr(root: Union[nn.Module, Dict[str, Any]], target: object) -> Any:
    """The attribute of ``root`` at a qualified name such as ``'layers.0.weight'``."""
    if isinstance(root, dict):
        return root[str(target)]
    value: Any = root
    for part in str(target).split('.'):
        value = getattr(value, part)
    return value


def _segments(graph: fx.Graph, root: Union[nn.Module, Dict[str, Any]]) -> List[List[fx.Node]]:
    """Cuts the graph's computing nodes into the runs of the children, in order."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    # Each get_attr node moves right before its first user, so that the
    # tensor it reads goes to the child that uses it first.
    nodes: List[fx.Node] = []
    for n in graph.nodes:
        if n.op in ('placeholder', 'output') or (n.op == 'get_attr' and n.users):
            continue
        if n.op == 'call_function' and n.target is operator.getitem \
                and n.args[0].op == 'call_module':
            continue
        for a in n.all_input_nodes:
            if a.op == 'get_attr' and min(a.users, key=order.__getitem__) is n:
                nodes.append(a)
        nodes.append(n)
        # A leaf module returning a tuple keeps the indexing of its output,
        # so that only the items used later leave its child: a tuple may
        # hold more than tensors (nn.MultiheadAttention's weights are None
        # when not needed).
        if n.op == 'call_module':
            nodes.extend(u for u in n.users if u.op == 'call_function'
                         and u.target is operator.getitem)
    index = {n: i for i, n in enumerate(nodes)}

    # A module called at several places, or a parameter read by glue code at
    # several places, must stay in one child (GPipe refuses a layer in two
    # partitions, and a read parameter would travel between children as a
    # value): the span from its first use to its last one is never cut. So
    # must a buffer shared by two modules, as GPipe cannot share a buffer
    # between partitions. A parameter shared by two different leaf modules,
    # or by a module and glue code (tied weights: an embedding and an output
    # projection), does not join them: each stays a child of its own, and
    # GPipe keeps the parameter once across partitions. A module with neither
    # parameters nor buffers (a dropout, an activation) holds nothing a
    # partition must own: each of its calls may be a child of its own, so
    # that a dropout used after the embeddings and after the last layer
    # does not make one child of the whole model.
    uses: Dict[object, List[int]] = {}
    for n in nodes:
        if n.op == 'call_module':
            module = _attr(root, n.target)
            if _stateless(module):
                continue
            for key in [id(module)] + [id(b) for b in module.buffers()]:
                uses.setdefault(key, []).append(index[n])
        elif n.op == 'get_attr' and isinstance(_attr(root, n.target), nn.Parameter):
            uses.setdefault(id(_attr(root, n.target)), []).extend(index[u] for u in n.users)
    span = list(range(len(nodes)))  # span[i]: the last node in the child of node i
    for positions in uses.values():
        for i in range(min(positions), max(positions) + 1):
            span[i] = max(span[i], max(positions))

    segments: List[List[fx.Node]] = []
    current: List[fx.Node] = []
    reach = -1
    for i, n in enumerate(nodes):
        if n.op == 'call_module' and reach < i and span[i] == i:
            # A leaf module used at this place only is a child of its own,
            # with the tensors read for it.
            attrs = [a for a in current if a.op == 'get_attr' and n in a.users]
            rest = [a for a in current if a not in attrs]
            if rest:
                segments.append(rest)
            segments.append(attrs + [n])
            current = []
        elif n.op == 'call_function' and n.target is operator.getitem and not current \
                and segments and n.args[0] in segments[-1]:
            segments[-1].append(n)
        else:
            current.append(n)
        reach = max(reach, span[i])
    if current:
        segments.append(current)
    return segments


def to_sequential(module: nn.Module, *,
                  example_inputs: Any = None,
                  leaf_modules: Iterable[LeafSpec] = (),
                  concrete_args: Optional[Dict[str, Any]] = None) -> nn.Sequential:
    """Flattens a module into an ``nn.Sequential`` that GPipe can partition anywhere.

    The graph of ``module.forward`` is captured in one of two ways. Without
    an example, it is traced symbolically with :mod:`torch.fx`: no input
    needed, every size symbolic. With ``example_inputs``, or the
    ``dummy_inputs`` a model gives (the models of Hugging Face
    transformers), :func:`torch.export.export` runs it on fake tensors of
    the example's shapes: it follows branches on sizes and reads any
    signature (``(self, *args, **kwargs)``), and calls of modules whose
    ``forward`` takes one tensor are folded back into calls of the modules.

    The result holds, in order, the leaf modules of ``module`` themselves
    (the same objects, so an optimizer built on ``module.parameters()``
    trains the sequential too) and small generated children for the code
    between them. A value used later than by the next child travels as a
    skip connection (:mod:`torchgpipe.skip`), in a namespace of its own.

    Children are named after the traced nodes: a leaf module by its
    qualified name with ``_`` for ``.`` (``layers_0_attn``), generated code
    by its first operation (``add_3``, ``cat``). A module with parameters
    or buffers called at several places, or a parameter read by glue code
    at several places, cannot be two children: its first use, its last one
    and everything between become one generated child (a module with
    neither, such as a dropout, is a child at each call). Parameters tied
    between different modules (an embedding and the output projection) do
    not join them: each module stays a child, and GPipe shares the
    parameter across partitions.

    The sequential takes a tensor, or a tuple of tensors: with torch.fx,
    the arguments of ``module.forward`` that have no default value; with
    torch.export, the tensors of the example. Its attribute ``interface``
    (:class:`~torchgpipe.capture.Interface`) arranges a call of the
    original (``input_ids=ids, attention_mask=mask``) into that input, and
    the tensors the sequential returns into what the original returns (a
    dict, a ``ModelOutput``...). With torch.fx, arguments
    with a default (``mask=None``, ``is_causal=False``) take it, as in a
    call ``module(x)``, unless ``concrete_args`` fixes another
    (``concrete_args={'mask': torch.fx.PH}`` makes ``mask`` an input too).
    Its attribute ``state_dict_map`` maps each key of ``module.state_dict()``
    to the sequential's key of the same tensor, to move checkpoints across::

        seq = to_sequential(model)
        seq.load_state_dict({seq.state_dict_map[k]: v for k, v in checkpoint.items()})

    The sequential copies like any module (:func:`copy.deepcopy`, ``pickle``,
    :func:`torch.save`), ``state_dict_map`` included, and a copy trains like
    the original.

    .. note::

        Values between children must be what GPipe carries: tensors. Shapes
        and sizes (``x.size()``, ``x.shape``) are computed again by each
        child that reads them; any other number, list or ``None`` passed
        from one part of ``forward`` to a later one fails in GPipe, and so
        would be kept inside one leaf module (``leaf_modules``). Parameters
        and buffers that ``forward`` never reads are not in the sequential,
        nor in ``state_dict_map``. Code captured by torch.export runs the
        operations of the mode (``training``) the module was in: it refuses
        to run in the other one (capture the module in each mode).

    Args:
        module (torch.nn.Module): the module to flatten

    Keyword Args:
        example_inputs (optional): an example of the input, to capture with
            :func:`torch.export.export`: a tensor, a tuple of positional
            arguments, or a dict of keyword arguments of ``forward``; give
            at least 2 of each size, which may then be anything (default:
            the module's ``dummy_inputs`` if it has them, else none: trace
            with torch.fx)
        leaf_modules (iterable): module classes, or modules, kept whole as
            one child each besides those of ``torch.nn`` and skippable
            layers: a module whose ``forward`` fx cannot trace (default:
            none)
        concrete_args (dict, optional): arguments of ``forward`` fixed to a
            value while tracing, given to :meth:`torch.fx.Tracer.trace`;
            the sequential does not take them (default: none; arguments
            with a default value are fixed to it, unless given
            ``torch.fx.PH``: then the sequential takes them as inputs)

    Returns:
        torch.nn.Sequential: the flattened module

    Raises:
        RuntimeError: fx cannot trace ``module``, for example because of
            control flow that depends on a tensor (the message names the
            module and the line); torch.export cannot capture it; or the
            captured code updates a buffer outside the module holding it
        TypeError: ``module`` is not an ``nn.Module`` (a function) or is a
            TorchScript module; ``leaf_modules`` is not an iterable (a
            single class, a string) or holds something other than module
            classes and modules; ``example_inputs`` does not fit
            ``forward``, or comes with ``leaf_modules`` or
            ``concrete_args``; or ``module`` returns other values than
            tensors

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
        graph, root, interface = capture(module, example)
    else:
        graph, root, interface = _capture_fx(module, leaves, concrete_args)

    placeholders = [n for n in graph.nodes if n.op == 'placeholder']
    output_node = next(n for n in graph.nodes if n.op == 'output')
    result = output_node.args[0]
    # A run of shape computations alone would pass no tensor on: it is left
    # out, as every child computes the shapes it reads itself.
    segments = _merge_checks([s for s in _segments(graph, root) if not all(map(is_shape, s))])
    last = len(segments) - 1

    # Where each value is held: the child that computes it; the inputs are
    # held by the first child, which receives them.
    holder: Dict[fx.Node, int] = {p: 0 for p in placeholders}
    for k, segment in enumerate(segments):
        holder.update((n, k) for n in segment)
    segments = [_with_shapes(segment) for segment in segments]
    # needs[k]: the values child k reads from other children, in graph order.
    needs: List[List[fx.Node]] = []
    for k, segment in enumerate(segments):
        inside = set(segment)
        wanted: Dict[fx.Node, None] = {}
        for n in segment + ([output_node] if k == last else []):
            wanted.update((a, None) for a in n.all_input_nodes if a not in inside)
        needs.append(list(wanted))
    # passed[k]: what child k gives child k + 1.
    passed: List[List[fx.Node]] = []
    for k in range(last):
        passed.append([a for a in needs[k + 1] if holder[a] == k])
        later = [a for j in range(k + 2, last + 1) for a in needs[j] if holder[a] == k]
        if passed[k] and all(_floating(a) is False for a in passed[k]):
            # The gradient of a stash (or of anything upstream) leaves a
            # partition through a floating point tensor of its output: when
            # child k would pass integers alone (token ids) and stash a
            # float (a mask), child k + 1 takes over that float.
            carrier = next((a for a in later if _floating(a)), None)
            if carrier is not None:
                holder[carrier] = k + 1
                passed[k].append(carrier)
        if passed[k]:
            continue
        # Child k + 1 needs nothing of child k, but GPipe needs a tensor at
        # every boundary, and the backward pass of a partition reaches the
        # stashes of its children only through the outputs of the next
        # ones: so child k + 1 takes over a value child k would stash, and
        # stashes or passes it on itself.
        if later:
            holder[later[0]] = k + 1
            passed[k].append(later[0])
        else:
            # Nothing of child k is used later: what it passes is ignored.
            passed[k].append([n for n in segments[k] if not is_shape(n)][-1])

    ns = Namespace()
    users = {id(m) for m in module.modules()}
    state = {id(t): key for key, t in module.state_dict(keep_vars=True).items()}
    children: Dict[str, nn.Module] = {}
    for k, segment in enumerate(segments):
        inputs = placeholders if k == 0 else passed[k - 1]
        pops = [a for a in needs[k] if holder[a] < k - 1]
        # A value goes to every later child but the next one as a skip of
        # its own: each skip name is popped once.
        stashes = [(a, j) for j in range(k + 2, last + 1) for a in needs[j] if holder[a] == k]

        name = _child_name(segment)
        if k == last:
            result_nodes = list(result) if isinstance(result, tuple) else [result]
        else:
            result_nodes = passed[k]
        # A stateless module called at several places is a child itself at
        # its first call only: GPipe refuses the same child twice, so its
        # other calls are generated children that call it. With torch.export,
        # the first child is always generated: the check of the mode the
        # graph was recorded in then runs on every call, even when the code
        # that depends on the mode recorded nothing.
        if (len(segment) == 1 and segment[0].op == 'call_module' and not pops
                and not (k == 0 and interface.training is not None)
                and not stashes and not segment[0].kwargs
                and list(segment[0].args) == inputs and result_nodes == segment
                and all(child is not _attr(root, segment[0].target)
                        for child in children.values())):
            children[name] = _attr(root, segment[0].target)
            continue

        # Named for fx's pickling, which traces the child's code again.
        sub = fx.Graph(tracer_cls=_Tracer)
        env: Dict[fx.Node, fx.Node] = {}
        for a in inputs + pops:
            env[a] = sub.placeholder(a.name)
        for n in segment:
            env[n] = sub.node_copy(n, env.__getitem__)
        if k == last:
            output: Any = fx.node.map_arg(result, env.__getitem__)
        elif len(passed[k]) == 1:
            output = env[passed[k][0]]
        else:
            output = tuple(env[a] for a in passed[k])
        sub.output((output, tuple(env[a] for a, _ in stashes)))
        graph_module = fx.GraphModule(root, sub, class_name=name)

        pop_names = [f'{a.name}:{k}' for a in pops]
        stash_names = [f'{a.name}:{j}' for a, j in stashes]
        step_cls = skippable_class(_Step, tuple(sorted(stash_names)), tuple(sorted(pop_names)))
        step = step_cls(graph_module, len(inputs) != 1, pop_names, stash_names,
                        _transient(root, segment, state), interface.training)
        # In the module's mode, as the user's modules are; the step's own
        # modules alone: its graph module may hold the user's modules, each
        # in its own mode.
        for part in step.modules():
            if id(part) not in users:
                part.training = module.training
        children[name] = step.isolate(ns)

    seq = nn.Sequential(OrderedDict(children))
    setattr(seq, 'state_dict_map', _state_dict_map(module, seq))
    setattr(seq, 'interface', interface)
    return seq


def _capture_fx(module: nn.Module, leaves: List[LeafSpec],
                concrete_args: Optional[Dict[str, Any]]) -> Captured:
    """Traces ``module`` with :mod:`torch.fx`, with symbolic values: no example needed."""
    tracer = _Tracer(leaves)
    # Called as the module is usually called: an argument with a default
    # (mask=None, is_causal=False) takes it, unless concrete_args says else.
    # Traced as an input instead, a None default would be taken for a tensor.
    # torch.fx.PH (fx's placeholder) keeps such an argument an input.
    concrete_args = {name: value
                     for name, value in {**_defaults(module), **(concrete_args or {})}.items()
                     if value is not fx.PH}  # type: ignore[attr-defined]
    graph = _trace(module, tracer, concrete_args)
    _drop_concrete_args(graph, module, concrete_args)
    # By the argument's name: fx renames a node that would shadow a builtin.
    names = [str(n.target) for n in graph.nodes if n.op == 'placeholder']
    # A dict, a dataclass... of tensors is returned as the tuple of them,
    # which the interface arranges back.
    output = next(n for n in graph.nodes if n.op == 'output')
    flat, structure = pytree.tree_flatten(output.args[0])
    results = output_nodes(flat, output.args[0])
    plain = isinstance(output.args[0], fx.Node) or (
        type(output.args[0]) is tuple and all(isinstance(r, fx.Node) for r in output.args[0]))
    output.args = (results[0] if len(results) == 1 else tuple(results),)
    # The tracer may have put constant tensors on the root: read it from there.
    return Captured(graph, tracer.root,
                    Interface(names, concrete_args, None if plain else structure))


def _dummy_inputs(module: nn.Module) -> Optional[Dict[str, Any]]:
    """The example a model gives of its inputs, as transformers models do, if any.

    Only the arguments ``forward`` names are kept: transformers gives an
    encoder alone the inputs of its decoder too.
    """
    dummy = getattr(module, 'dummy_inputs', None)
    if not isinstance(dummy, dict):
        return None
    named = named_arguments(module)
    return {key: value for key, value in dummy.items() if key in named} or None


def _check_arguments(module: object, leaf_modules: object) -> List[LeafSpec]:
    """Checks the arguments of :func:`to_sequential` before it traces anything.

    fx would otherwise fail deep inside on a TorchScript module or a
    function, and silently ignore a string of leaf modules.

    Returns:
        list: the classes and modules of ``leaf_modules``

    Raises:
        TypeError: as :func:`to_sequential` says
    """
    # TorchScript modules are nn.Modules too, but compiled: no Python
    # forward is left to trace.
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
    # A string is an iterable too, of one-letter strings.
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
    leaves: List[LeafSpec] = []
    for i, leaf in enumerate(given):
        if not (isinstance(leaf, nn.Module)
                or (isinstance(leaf, type) and issubclass(leaf, nn.Module))):
            raise TypeError(describe(f'leaf_modules[{i}] must be a module class or a module',
                                     f'leaf_modules[{i}]: {brief(leaf)}', fix))
        leaves.append(leaf)
    return leaves


def _defaults(module: nn.Module) -> Dict[str, Any]:
    """The arguments of ``module.forward`` that have a default value, with it."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return {name: p.default for name, p in inspect.signature(module.forward).parameters.items()
            if p.kind in kinds and p.default is not inspect.Parameter.empty}


def _merge_checks(segments: List[List[fx.Node]]) -> List[List[fx.Node]]:
    """Joins each run of checks alone to the child after it (or, at the end, before it).

    A child must pass a value on, and ``torch._assert`` (with the shapes it
    reads) makes none: as a child of its own it would hand ``None`` to the
    next one.
    """
    merged: List[List[fx.Node]] = []
    pending: List[fx.Node] = []
    for segment in segments:
        if all(is_shape(n) or is_check(n) for n in segment):
            pending += segment
            continue
        merged.append(pending + segment)
        pending = []
    if pending:
        if merged:
            merged[-1] += pending
        else:
            merged.append(pending)
    return merged


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


def _state_dict_map(module: nn.Module, seq: nn.Sequential) -> Dict[str, str]:
    """Maps each key of ``module.state_dict()`` to the sequential's key of its tensor.

    A tensor tied between modules has a key per module in both, so a key
    goes to the key of the same slot (the same module, the same attribute)
    first: ``head.weight`` to ``head.weight``, not to ``embedding.weight``.
    A tensor that glue code reads moved into a generated child: its key
    goes to the key of the same tensor.
    """
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


def _with_shapes(segment: List[fx.Node]) -> List[fx.Node]:
    """A child's nodes, preceded by the shape nodes of other children it reads."""
    inside = set(segment)
    copied: Dict[fx.Node, None] = {}

    def collect(node: fx.Node) -> None:
        for a in node.all_input_nodes:
            if a not in inside and a not in copied and is_shape(a):
                collect(a)
                copied[a] = None

    for n in segment:
        collect(n)
    return list(copied) + segment


def _transient(root: Union[nn.Module, Dict[str, Any]], segment: List[fx.Node],
               state: Dict[int, str]) -> List[str]:
    """The tensors a generated child reads that the original leaves out of its state dict.

    fx registers every tensor a generated child reads as a buffer, which
    would add keys the original's checkpoints lack: a non-persistent buffer
    such as a causal mask, or a constant tensor.

    Returns:
        list of strs: their qualified names, as the child's graph module has them
    """
    names = []
    for n in segment:
        if n.op != 'get_attr':
            continue
        value = _attr(root, n.target)
        if isinstance(value, Tensor) and not isinstance(value, nn.Parameter) \
                and id(value) not in state:
            names.append(str(n.target))
    return names


def _floating(node: fx.Node) -> Optional[bool]:
    """Whether a node makes a floating point tensor, if the graph says (export's does)."""
    value = node.meta.get('val')
    return value.is_floating_point() if isinstance(value, Tensor) else None


def _stateless(module: nn.Module) -> bool:
    """Whether ``module`` has no parameter and no buffer, itself or in its submodules."""
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None


def _child_name(segment: List[fx.Node]) -> str:
    """A child's name: its leaf module's, or its first operation's."""
    # Not named after the tensors it reads, the shapes it computes again, nor
    # the checks it runs first.
    computing = [n for n in segment
                 if n.op != 'get_attr' and not is_shape(n) and not is_check(n)] or segment
    name = computing[0].name
    # nn.Sequential refuses a child named like one of its attributes.
    while hasattr(nn.Sequential, name):
        name += '_'
    return name


"""Where to_sequential cuts a captured graph into children, in one mode and in the other.

:func:`cut_parts` cuts a graph into children and says what passes between
them; :func:`piece` makes one generated child's graph. A graph records one
mode: :func:`capture_other_mode` captures the other, and :func:`match`
checks it cuts alike, so each generated child runs the piece of its mode.
"""
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple, Union, cast

import torch
from torch import fx, nn

from torchgpipe.capture import cut, fx as fx_capture
from torchgpipe.capture.cut import child_name, floating, with_shapes
from torchgpipe.capture.graph import Captured, attr, is_shape
from torchgpipe.capture.interface import Interface

__all__: List[str] = []

Root = Union[nn.Module, Dict[str, Any]]


class Parts(NamedTuple):
    """The parts a captured graph is cut into, one per child, and what goes between them."""

    #: each child's nodes, with the shapes it computes again
    segments: List[List[fx.Node]]
    #: what the graph returns: a node or a tuple of nodes
    result: Any
    #: the child that holds each value (the inputs: the first)
    holder: Dict[fx.Node, int]
    #: inputs[k]: what child k receives, the previous child's output
    inputs: List[List[fx.Node]]
    #: outputs[k]: what child k returns (the last: the graph's result)
    outputs: List[List[fx.Node]]
    #: pops[k]: what child k pops, in graph order
    pops: List[List[fx.Node]]
    #: stashes[k]: what child k stashes, with the child that pops it
    stashes: List[List[Tuple[fx.Node, int]]]


def cut_parts(graph: fx.Graph, root: Root) -> Parts:
    """Cuts a captured graph into the children of the sequential."""
    placeholders = [n for n in graph.nodes if n.op == 'placeholder']
    output_node = next(n for n in graph.nodes if n.op == 'output')
    result = output_node.args[0]
    # Shape computations alone pass no tensor: each child computes its own.
    segments = cut.merge_checks([s for s in cut.segments(graph, root)
                                 if not all(map(is_shape, s))])
    last = len(segments) - 1

    # The child that computes each value (the inputs: the first).
    holder: Dict[fx.Node, int] = {p: 0 for p in placeholders}
    for k, segment in enumerate(segments):
        holder.update((n, k) for n in segment)
    segments = [with_shapes(segment) for segment in segments]
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
        if passed[k] and all(floating(a) is False for a in passed[k]):
            # Gradients leave a partition through a floating point output: child
            # k + 1 takes over a float child k would stash (a mask beside token ids).
            carrier = next((a for a in later if floating(a)), None)
            if carrier is not None:
                holder[carrier] = k + 1
                passed[k].append(carrier)
        if passed[k]:
            continue
        # GPipe needs a tensor at every boundary (and gradients reach stashes only
        # through outputs): child k + 1 takes over a value child k would stash.
        if later:
            holder[later[0]] = k + 1
            passed[k].append(later[0])
        else:
            # Nothing of child k is used later: what it passes is ignored.
            passed[k].append([n for n in segments[k] if not is_shape(n)][-1])

    results = list(result) if isinstance(result, tuple) else [result]
    return Parts(
        segments, result, holder,
        inputs=[placeholders] + passed,
        outputs=passed + [results],
        # A value goes to every later child but the next one as a skip of
        # its own: each skip name is popped once.
        pops=[[a for a in needs[k] if holder[a] < k - 1] for k in range(last + 1)],
        stashes=[[(a, j) for j in range(k + 2, last + 1) for a in needs[j] if holder[a] == k]
                 for k in range(last + 1)])


def lone_call(parts: Parts, k: int, root: Root,
               interface: Interface) -> Optional[nn.Module]:
    """The module child ``k`` calls if that call is all it does: then the child is the module
    (never the first with export, whose mode check must run)."""
    segment = parts.segments[k]
    if (len(segment) == 1 and segment[0].op == 'call_module' and not parts.pops[k]
            and not (k == 0 and interface.training is not None)
            and not parts.stashes[k] and not segment[0].kwargs
            and list(segment[0].args) == parts.inputs[k] and parts.outputs[k] == segment):
        return attr(root, segment[0].target)  # type: ignore[no-any-return]
    return None


def piece(parts: Parts, k: int, pops: List[fx.Node]) -> fx.Graph:
    """The graph of generated child ``k``: its inputs and ``pops`` in, its output and
    stashes out."""
    # Named for fx's pickling, which traces the child's code again.
    sub = fx.Graph(tracer_cls=fx_capture.Tracer)
    env: Dict[fx.Node, fx.Node] = {}
    for a in parts.inputs[k] + pops:
        env[a] = sub.placeholder(a.name)
    for n in parts.segments[k]:
        env[n] = sub.node_copy(n, env.__getitem__)
    if k == len(parts.segments) - 1:
        output: Any = fx.node.map_arg(parts.result, env.__getitem__)
    elif len(parts.outputs[k]) == 1:
        output = env[parts.outputs[k][0]]
    else:
        output = tuple(env[a] for a in parts.outputs[k])
    sub.output((output, tuple(env[a] for a, _ in parts.stashes[k])))
    return sub


def hold(holder: fx.GraphModule, piece: fx.Graph, root: Root,
          state: Dict[int, str]) -> List[str]:
    """Puts in ``holder`` what ``piece``, of the other mode's graph, reads and it lacks
    (renamed where ``holder`` has another object under the name); returns the names to
    leave out of the state dict."""
    names = []
    for node in piece.nodes:
        if node.op not in ('get_attr', 'call_module'):
            continue
        value = attr(root, node.target)
        target = str(node.target)
        try:
            held = attr(holder, target)
        except AttributeError:
            held = None
        if held is not value:
            if held is not None:
                base = target.replace('.', '_') + '_other_mode'
                target, k = base, 0
                while hasattr(holder, target):
                    k += 1
                    target = f'{base}{k}'
                node.target = target
            cut.assign(holder, target, value)
        if cut.transient(value, state):
            names.append(target)
    return names


def match(parts: Parts, other: Parts, captured: Captured,
           other_captured: Captured) -> Tuple[Optional[List[List[fx.Node]]], str]:
    """Whether the other mode's graph cuts into the same children, passing the same values:
    ``(pops, '')``, each child's pops of the other graph in the order of ``parts``', or
    ``(None, why not)``."""
    mode = 'evaluation' if captured.interface.training else 'training'
    differs = f'its forward runs other code in {mode} mode, which '
    if (captured.interface.names != other_captured.interface.names
            or captured.interface.structure != other_captured.interface.structure):
        return None, differs + 'takes or returns other values'
    if len(parts.segments) != len(other.segments):
        return None, differs + (f'cuts into {len(other.segments)} parts, not '
                                f'{len(parts.segments)}')
    for k in range(len(parts.segments)):
        if not (alike(parts.outputs[k], other.outputs[k])
                and alike([a for a, _ in parts.stashes[k]], [b for b, _ in other.stashes[k]])
                and [j for _, j in parts.stashes[k]] == [j for _, j in other.stashes[k]]):
            return None, differs + (f'passes other values from part {k} '
                                    f'({child_name(parts.segments[k])})')

    def slot(p: Parts, k: int, value: fx.Node) -> Tuple[int, int]:
        """Where the skip ``value`` popped by child ``k`` is stashed: (child, position)."""
        h = p.holder[value]
        return h, p.stashes[h].index((value, k))

    orders = []
    for k in range(len(parts.segments)):
        theirs = {slot(other, k, b): b for b in other.pops[k]}
        ours = [slot(parts, k, a) for a in parts.pops[k]]
        if sorted(ours) != sorted(theirs):
            return None, differs + (f'pops other values in part {k} '
                                    f'({child_name(parts.segments[k])})')
        orders.append([theirs[s] for s in ours])
    return orders, ''


def alike(values: List[fx.Node], others: List[fx.Node]) -> bool:
    """Whether two lists of values are alike as far as the graphs say: tensors of one dtype
    and number of dimensions, one by one."""
    def form(node: fx.Node) -> Any:
        value = node.meta.get('val')
        return (value.dtype, value.dim()) if isinstance(value, torch.Tensor) else None

    return [form(a) for a in values] == [form(b) for b in others]


def capture_other_mode(module: nn.Module, capture: Callable[[], Captured]
                       ) -> Tuple[Optional[Captured], str]:
    """``module`` captured by ``capture`` in the mode it is not in, its modes put back after:
    ``(captured, '')``, or ``(None, why not)``."""
    mode = 'evaluation' if module.training else 'training'
    modes = [(m, m.training) for m in module.modules()]
    module.train(not module.training)
    try:
        return capture(), ''
    except (RuntimeError, TypeError, ValueError) as exc:
        return None, f'it cannot be captured in {mode} mode ({str(exc).splitlines()[0]})'
    finally:
        for m, training in modes:
            m.training = training


def same(captured: Captured, other: Captured) -> bool:
    """Whether two captures are one: the same code, returning the same structure, reading
    the same tensors (or equal constants)."""
    if captured.graph.python_code('self').src != other.graph.python_code('self').src \
            or captured.interface.structure != other.interface.structure:
        return False
    ours, theirs = cast(Dict[str, Any], captured.root), cast(Dict[str, Any], other.root)
    return all(value is theirs[name] or (
        isinstance(value, torch.Tensor) and value.dtype == theirs[name].dtype
        and torch.equal(value, theirs[name])) for name, value in ours.items())

"""Cutting a captured graph into the children of a sequential.

A module kept whole and called once is a child of its own; the code
between such calls becomes a :class:`GeneratedChild`, which pops the values
it needs from earlier children and stashes those later ones need. What
cannot be in two partitions (a stateful module called twice, a parameter
read at two places) is never cut.
"""
import operator
import weakref
from typing import Any, Dict, Generator, List, Optional, Union, cast

from torch import Tensor, fx, nn

from torchgpipe.capture import alias
from torchgpipe.capture.graph import attr, is_check, is_shape
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.validation import describe
from torchgpipe.skip.skippable import pop, stash

__all__: List[str] = []


class GeneratedChild(nn.Module):
    """One generated child: runs its piece of the traced graph, ``graph_module``, on the
    values received (a tuple if ``tuple_input``) and the ``pops``, giving the output and the
    ``stashes``. ``transient``: the tensors left out of the state dict; ``captured_training``:
    the mode ``graph_module`` was captured in (``None``: both); ``other_mode``: the piece of
    the other mode (if ``None``, the child refuses it, saying ``refusal``);
    ``captured_from``: the module whose mode is this child's."""

    other_mode: Optional[fx.GraphModule]

    def __init__(self, graph_module: fx.GraphModule, tuple_input: bool,
                 pops: List[str], stashes: List[str], transient: List[str],
                 captured_training: Optional[bool] = None,
                 other_mode: Optional[fx.GraphModule] = None, refusal: str = '',
                 captured_from: Optional[nn.Module] = None) -> None:
        super().__init__()
        # Weakly held, not a submodule: a rank frees the others' layers with the model.
        self.__dict__['captured_from'] = None if captured_from is None else \
            weakref.ref(captured_from)
        self.graph = graph_module
        self.tuple_input = tuple_input
        self.pops = pops
        self.stashes = stashes
        self.transient = transient
        self.captured_training = captured_training
        self.refusal = refusal
        # Not a submodule: it reads self.graph's tensors and modules.
        self.__dict__['other_mode'] = other_mode
        self._link()

    # The captured module's mode, both ways; a copy keeps a mode of its own.
    @property
    def training(self) -> bool:
        """The mode of the module captured (this child's own mode in a copy)."""
        source = self._captured_from()
        if source is not None:
            self.__dict__['own_training'] = source.training
        return bool(self.__dict__['own_training'])

    @training.setter
    def training(self, mode: bool) -> None:
        self.__dict__['own_training'] = mode
        source = self._captured_from()
        if source is not None:
            source.training = mode

    def _captured_from(self) -> Optional[nn.Module]:
        ref = self.__dict__.get('captured_from')
        return None if ref is None else cast(Optional[nn.Module], ref())

    @property
    def only_mode(self) -> Optional[bool]:
        """The one mode this child runs in, or ``None`` when it runs in both."""
        return self.captured_training if self.other_mode is None else None

    # Copies: fx re-registers every tensor as a persistent buffer, and the other
    # mode's graph must read self.graph's again.
    def __getstate__(self) -> Dict[str, Any]:
        state: Dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call]
        return {**state, 'captured_from': None, 'own_training': self.training}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        self.__dict__.setdefault('other_mode', None)
        # Pickled before the mode followed the captured module: a flag of its own.
        self.__dict__.setdefault('captured_from', None)
        self.__dict__.setdefault('own_training', self.__dict__.pop('training', True))
        self._link()

    def _link(self) -> None:
        # The other mode's code reads every tensor and module it names from self.graph
        # (taking what self.graph lacks first), sharing its dicts so that .to() moves both;
        # transient tensors stay out of the state dict.
        code = self.other_mode
        if code is not None:
            for node in code.graph.nodes:
                if node.op in ('get_attr', 'call_module'):
                    try:
                        attr(self.graph, node.target)
                    except AttributeError:
                        assign(self.graph, str(node.target), attr(code, node.target))
            for name in ('_modules', '_parameters', '_buffers', '_non_persistent_buffers_set'):
                code.__dict__[name] = self.graph.__dict__[name]
        for name in self.transient:
            owner, _, field = name.rpartition('.')
            self.graph.get_submodule(owner)._non_persistent_buffers_set.add(field)

    def check_mode(self) -> None:
        """Refuses a call in a mode this child has no code for (the other mode's operations
        would be silently wrong: dropout on in evaluation).

        Raises:
            RuntimeError: the child runs in one mode only, and is in the other
        """
        if self.only_mode is None or self.training == self.only_mode:
            return
        mode, other = ('training', 'evaluation') if self.only_mode \
            else ('evaluation', 'training')
        raise RuntimeError(describe(
            f'this part of the sequential was captured in {mode} mode and cannot run in '
            f'{other} mode: {self.refusal}',
            f'child {type(self.graph).__name__!r} of the sequential: training={self.training}',
            'write what depends on the mode so that both modes record it, as '
            'F.dropout(x, p, self.training) does, rather than in a branch on '
            'self.training, or keep that code in a module whose forward takes '
            'one tensor (its calls follow the mode)'))

    def forward(self, input: TensorOrTensors) -> Generator[Any, Any, TensorOrTensors]:
        self.check_mode()
        graph = self.graph
        if self.other_mode is not None and self.training != self.captured_training:
            graph = self.other_mode
        inputs = input if self.tuple_input else (input,)
        popped = []
        for name in self.pops:
            popped.append((yield pop(name)))
        output, stashed = graph(*inputs, *popped)
        for name, value in zip(self.stashes, stashed):
            yield stash(name, value)
        return output  # type: ignore[no-any-return]


def assign(module: nn.Module, target: str, value: Any) -> None:
    """Puts ``value`` at the qualified name ``target`` of ``module`` as fx would: empty
    modules on the way, a tensor that is no parameter as a buffer."""
    *path, field = target.split('.')
    owner = module
    for part in path:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    if isinstance(value, Tensor) and not isinstance(value, nn.Parameter):
        owner.register_buffer(field, value)
    else:
        setattr(owner, field, value)

def segments(graph: fx.Graph, root: Union[nn.Module, Dict[str, Any]]) -> List[List[fx.Node]]:
    """Cuts the graph's computing nodes into the runs of the children, in order."""
    order = {n: i for i, n in enumerate(graph.nodes)}
    # Each get_attr node moves right before its first user, into that child.
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
        # Indexing a leaf module's tuple stays with it: only the items used leave
        # (nn.MultiheadAttention's weights may be None).
        if n.op == 'call_module':
            nodes.extend(u for u in n.users if u.op == 'call_function'
                         and u.target is operator.getitem)
    index = {n: i for i, n in enumerate(nodes)}

    # GPipe refuses a layer or buffer in two partitions: the span between the uses
    # of a stateful module, a glue parameter or a shared buffer is never cut.
    # (Tied parameters GPipe shares; a stateless dropout may be anywhere.)
    uses: Dict[object, List[int]] = {}
    for n in nodes:
        if n.op == 'call_module':
            module = attr(root, n.target)
            if stateless(module):
                continue
            for key in [id(module)] + [id(b) for b in module.buffers()]:
                uses.setdefault(key, []).append(index[n])
        elif n.op == 'get_attr' and isinstance(attr(root, n.target), nn.Parameter):
            uses.setdefault(id(attr(root, n.target)), []).extend(index[u] for u in n.users)
    # Memory updated in place stays with its readers (torchgpipe.capture.alias).
    for k, group in enumerate(alias.shared_memory(nodes, root)):
        uses[('memory', k)] = [index[n] for n in group]
    span = list(range(len(nodes)))  # span[i]: the last node in the child of node i
    for positions in uses.values():
        for i in range(min(positions), max(positions) + 1):
            span[i] = max(span[i], max(positions))

    segments: List[List[fx.Node]] = []
    current: List[fx.Node] = []
    reach = -1
    for i, n in enumerate(nodes):
        if n.op == 'call_module' and reach < i and span[i] == i:
            # A leaf module used here only: a child of its own, with its tensors.
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

def merge_checks(segments: List[List[fx.Node]]) -> List[List[fx.Node]]:
    """Joins each run of checks alone to the child after it (or, at the end, before it): a
    child of checks would pass no value on."""
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

def with_shapes(segment: List[fx.Node]) -> List[fx.Node]:
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

def transient(value: object, state: Dict[int, str]) -> bool:
    """Whether ``value``, read by a generated child, is a tensor the original leaves out of
    its state dict (a non-persistent mask, a constant), which fx registers as a buffer."""
    return isinstance(value, Tensor) and not isinstance(value, nn.Parameter) \
        and id(value) not in state

def floating(node: fx.Node) -> Optional[bool]:
    """Whether a node makes a floating point tensor, if the graph says (export's does)."""
    value = node.meta.get('val')
    return value.is_floating_point() if isinstance(value, Tensor) else None

def stateless(module: nn.Module) -> bool:
    """Whether ``module`` has no parameter and no buffer, itself or in its submodules."""
    return next(module.parameters(), None) is None and next(module.buffers(), None) is None

def child_name(segment: List[fx.Node]) -> str:
    """A child's name: its leaf module's, or its first operation's."""
    computing = [n for n in segment
                 if n.op != 'get_attr' and not is_shape(n) and not is_check(n)] or segment
    name = computing[0].name
    # nn.Sequential refuses a child named like one of its attributes.
    while hasattr(nn.Sequential, name):
        name += '_'
    return name

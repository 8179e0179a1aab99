"""The backward pass in two: the gradients of a partition's inputs (I), then of its parameters (W).

The partition before waits only for ``I``; zero-bubble schedules put ``W``
where a worker would otherwise wait. Take a partition ``y = W2 relu(W1 x)``::

    y ─► Mm2 ──► Relu ─► Mm1 ─► x          C: the nodes that lead to the input x
          │               │                R: nodes of C with an edge out of C
          ▼               ▼                   towards a parameter (Mm1, Mm2)
          W2              W1

``I`` runs the engine from the outputs to ``x`` only, a hook keeping what each node of
``R`` received; ``W`` runs it from there to the parameters only, so nothing runs twice.
Nodes that must run once (a custom Function, a retained gradient), and parameters whose
nodes of ``R`` lead to one another through ``C``, get their gradients in ``I``.
"""
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch import Tensor
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge
from torch.utils.checkpoint import CheckpointFunction

__all__: List[str] = []


#: One engine call of W: the edges it starts from, their gradients, the parameters.
Call = Tuple[List[GradientEdge], List[Tensor], List[Tensor]]


@dataclass(eq=False)
class WeightPass:
    """What ``I`` left for ``W``: for each group of parameters, where to start, with what."""

    groups: List[Call]
    kept: Dict[Node, Tuple[Optional[Tensor], ...]]

    def run(self) -> None:
        """Accumulates the gradients of the parameters, once; frees what ``I`` kept."""
        groups, self.groups = self.groups, []
        # A root's tensor hooks run again when the engine starts from it: the node must
        # compute from what it received in I.
        handles = [node.register_prehook(lambda _, kept=kept: kept)
                   for node, kept in self.kept.items()]
        try:
            for edges, grads, params in groups:
                torch.autograd.backward(edges, grads, inputs=params)
        finally:
            for handle in handles:
                handle.remove()
            self.kept = {}


def children(node: Node) -> List[Node]:
    return [child for child, _ in node.next_functions if child is not None]


def node_of(tensor: Tensor) -> Node:
    """The node a gradient of ``tensor`` enters: its ``grad_fn``, or a leaf's accumulator."""
    return get_gradient_edge(tensor).node


#: The children of each node of a graph (its next functions, without the empty ones).
Kids = Dict[Node, List[Node]]


def explore(roots: List[Node], inputs: Set[Node], kids: Kids
            ) -> Tuple[Set[Node], Dict[Node, bool]]:
    """``C`` (the nodes under ``roots`` that lead to ``inputs``), and whether each node
    leads to a parameter; fills ``kids``."""
    to_input: Dict[Node, bool] = {}
    to_param: Dict[Node, bool] = {}
    # Depth first, children first, without recursion (graphs are as deep as the partition).
    stack: List[Tuple[Node, bool]] = [(root, False) for root in roots]
    while stack:
        node, expanded = stack.pop()
        if node in to_input:
            continue
        below = kids.get(node)
        if below is None:
            below = kids[node] = children(node)
        if not expanded:
            stack.append((node, True))
            stack.extend((child, False) for child in below if child not in to_input)
            continue
        leaf = not below and hasattr(node, 'variable')
        to_input[node] = node in inputs or any(to_input[c] for c in below)
        to_param[node] = (leaf and node not in inputs) or any(to_param[c] for c in below)
    return {node for node, yes in to_input.items() if yes}, to_param


def reach(starts: List[Node], allowed: Set[Node], kids: Kids) -> Set[Node]:
    """The nodes reachable from ``starts`` through nodes of ``allowed`` (``starts`` included)."""
    seen = set(starts)
    stack = list(starts)
    while stack:
        for child in kids[stack.pop()]:
            if child in allowed and child not in seen:
                seen.add(child)
                stack.append(child)
    return seen


def input_pass(tensors: List[Tensor], grads: List[Optional[Tensor]], inputs: List[Tensor],
               outputs: Sequence[Any] = ()) -> WeightPass:
    """Runs ``I`` from ``tensors`` (outputs, sent skips or loss): accumulates the gradients
    of the leaves ``inputs``; returns what ``W`` runs. ``outputs``: those not in ``tensors``."""
    roots = [node_of(t) for t in tensors]
    # The nodes whose runs do more than compute: W must not run them again.
    kept_alive = {node_of(t) for t in [*tensors, *outputs]
                  if isinstance(t, Tensor) and t.requires_grad and t.retains_grad}
    early: Set[Node] = set()
    kids: Kids = {}
    while True:
        stops = {node_of(x) for x in inputs} | early
        closure, to_param = explore(roots, stops, kids)
        if any(getattr(n, '_forward_cls', None) is CheckpointFunction for n in kids):
            # A reentrant checkpoint's backward cannot stop at the inputs: all of it in I.
            torch.autograd.backward(tensors, grads)
            return WeightPass([], {})
        # Where W starts: nodes of C with an edge out of C towards a parameter, and outputs
        # whose node is outside C but leads to one.
        starts = [n for n in to_param if n in closure
                  and any(c not in closure and to_param[c] for c in kids[n])]
        free = [k for k, node in enumerate(roots) if node not in closure and to_param[node]]
        groups = group(starts + free, roots, closure, to_param, kids)
        bad = [params for members, params in groups
               if any(once(m, kept_alive) for m in members)
               or len(members) > 1 and crosses(members, closure, kids)]
        if not bad:
            break
        early.update(p for params in bad for p in params)
    kept: Dict[Node, Tuple[Optional[Tensor], ...]] = {}
    handles = [n.register_prehook(lambda g, n=n: kept.__setitem__(n, g)) for n in starts]
    try:
        targets = inputs + [n.variable for n in early]  # type: ignore[attr-defined]
        if targets:
            torch.autograd.backward(tensors, grads, retain_graph=bool(starts or free),
                                    inputs=targets)
    finally:
        for handle in handles:
            handle.remove()
    return WeightPass(plan(groups, kept, tensors, grads), kept)


#: Where W starts: a node of ``R``, or the index of an output whose node is outside ``C``.
Start = Union[Node, int]


def group(starts: List[Start], roots: List[Node], closure: Set[Node],
          to_param: Dict[Node, bool], kids: Kids) -> List[Tuple[List[Start], Set[Node]]]:
    """Where W starts, in groups that share no parameter, with their parameters' accumulators."""
    below_closure = {n for n, yes in to_param.items() if yes and n not in closure}
    groups: List[Tuple[List[Start], Set[Node]]] = []
    for start in starts:
        if isinstance(start, int):
            out = [roots[start]]
        else:
            out = [c for c in kids[start] if c in below_closure]
        params = {n for n in reach(out, below_closure, kids)
                  if not kids[n] and hasattr(n, 'variable')}
        members = [start]
        for other in [g for g in groups if g[1] & params]:
            groups.remove(other)
            members += other[0]
            params |= other[1]
        groups.append((members, params))
    return groups


def once(start: Start, kept_alive: Set[Node]) -> bool:
    """Whether a node W would start from must run once only: a custom Function's (it may
    keep state), or one whose tensor retains its gradient (it would add it twice)."""
    return not isinstance(start, int) and (hasattr(start, '_forward_cls')
                                           or start in kept_alive)


def crosses(members: List[Start], closure: Set[Node], kids: Kids) -> bool:
    """Whether a node of the group leads to another through ``C``."""
    nodes = [m for m in members if not isinstance(m, int)]
    inside = set(nodes)
    for node in nodes:
        below = reach([c for c in kids[node] if c in closure], closure, kids)
        if below & (inside - {node}):
            return True
    return False


def plan(groups: List[Tuple[List[Start], Set[Node]]],
         kept: Dict[Node, Tuple[Optional[Tensor], ...]], tensors: List[Tensor],
         grads: List[Optional[Tensor]]) -> List[Call]:
    """The engine calls of ``W``."""
    calls: List[Call] = []
    for members, params in groups:
        edges: List[GradientEdge] = []
        values: List[Tensor] = []
        for start in members:
            if isinstance(start, int):
                edges.append(get_gradient_edge(tensors[start]))
                grad = grads[start]
                values.append(torch.ones_like(tensors[start]) if grad is None else grad)
                continue
            for slot, grad in enumerate(kept.get(start, ())):
                if grad is not None:
                    edges.append(GradientEdge(start, slot))
                    values.append(grad)
        if edges:
            calls.append((edges, values, [n.variable for n in params]))  # type: ignore[attr-defined]
    return calls

"""Parameters tied across ranks: a copy on each rank that uses one, its gradient summed.

At each step's end the holding ranks exchange their gradients
(:meth:`Wire.finish <torchgpipe.transport.wire.Wire.finish>`) and each adds them in
the order of the partitions using it, as one process does, so every copy gets the
same sum bit for bit. A rank's later partitions using it add their own share::

    rank 0  (partitions 0, 3)  g0 = .grad, g3 = share ─┐
                                                       ├─► g0 + g1 + g3, on both ranks
    rank 1  (partition 1)      g1 ─────────────────────┘

Gradients of earlier steps are set aside meanwhile. The first step, and the first after
a load, also compare the copies: a rank that built the module apart (a forgotten seed) raises.
A sharded copy (a DTensor, of FSDP2 or tensor parallel) goes whole, gathered over its mesh,
and takes its part of the sum: so the two ends may be sharded differently.

The norm of a pipeline's gradients over its ranks is bit for bit torch's on the unwrapped
module: one all-reduce fills a slot per parameter, written by the one rank counting it
(zeros elsewhere, so the sum is exact); every rank takes the norm of the same vector.
A sharded gradient (a DTensor, under FSDP2 or tensor parallel) gives a partial norm, made
whole over its mesh first, those sharded alike together (an all-reduce per mesh dimension).
"""
import sys
from typing import Any, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple, cast

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils._foreach_utils import (_device_has_foreach_support,
                                        _group_tensors_by_device_and_dtype,
                                        _has_foreach_support)

from torchgpipe.foundation.tied import add_in_order, tied_uses
from torchgpipe.foundation.validation import describe

__all__: List[str] = []

#: What a rank sends another: its gradients of the ties they share, and the copies or ``None``.
Share = Tuple[List[Optional[Tensor]], Optional[List[Optional[Tensor]]]]


class Tie(NamedTuple):
    """A parameter of layers on several ranks, as this rank holds it."""

    #: Its name in the unwrapped module (where it is first found).
    key: str
    #: The global rank of each partition using it, in order, which its gradients are added in.
    ranks: Tuple[int, ...]
    #: A layer of this rank that uses it, and the name it has there.
    layer: nn.Module
    name: str
    #: Its name on this rank.
    local: str

    def parameter(self) -> Optional[nn.Parameter]:
        # Looked up each step, as load_state_dict(assign=True) replaces it.
        return self.layer._parameters[self.name]


def ties_across_ranks(partitions: Sequence[nn.Module], ranks: Sequence[int],
                      me: int) -> List[Tie]:
    """The ties of global rank ``me`` given every partition's global rank, sorted by name
    so every rank sees them alike."""
    # By tensor: the first name, the rank of each partition using it, and a use here.
    found: Dict[int, Tuple[str, Dict[int, int], List[Tuple[nn.Module, str, str]]]] = {}
    for j, (partition, rank) in enumerate(zip(partitions, ranks)):
        for path, layer in partition.named_modules(remove_duplicate=False):
            for name, parameter in layer._parameters.items():
                if parameter is None:
                    continue
                key = f'{path}.{name}' if path else name
                _, holders, here = found.setdefault(id(parameter), (key, {}, []))
                holders[j] = rank
                if rank == me:
                    here.append((layer, name, key))
    return sorted((Tie(key, tuple(holders.values()), *here[0])
                   for key, holders, here in found.values() if len(holders) > 1 and here),
                  key=lambda tie: tie.key)


class TiedGradients:
    """Sums the gradients of this rank's ``ties`` over their partitions, once per step
    (``partitions``: this rank's, hooked by ``torchgpipe.foundation.tied.tie_partitions``)."""

    def __init__(self, ties: Sequence[Tie], me: int,
                 partitions: Sequence[nn.Module] = ()) -> None:
        self.ties = list(ties)
        self.me = me
        self.hooks = tied_uses(partitions)
        #: The gradients of earlier steps, set aside during a step.
        self.kept: List[Optional[Tensor]] = []
        #: Whether the next step sends the copies too, to compare them.
        self.check = True
        #: This step's gradients of each tie (see own) and its copies, whole, once gathered.
        self.gathered_grads: Optional[List[List[Optional[Tensor]]]] = None
        self.gathered_copies: Optional[List[Optional[Tensor]]] = None

    def parameters(self) -> List[nn.Parameter]:
        """The tied parameters of this rank."""
        return [p for p in (tie.parameter() for tie in self.ties) if p is not None]

    def checking(self) -> bool:
        """Whether the next step sends copies of tied parameters, to compare them."""
        return self.check and bool(self.ties)

    def start(self) -> None:
        """Sets the gradients of earlier steps aside, before a step."""
        self.kept = []
        for tie in self.ties:
            p = tie.parameter()
            self.kept.append(None if p is None else p.grad)
            if p is not None:
                p.grad = None
        for hook in self.hooks:
            hook.shares = {}
        self.gathered_grads = self.gathered_copies = None

    def own(self, tie: Tie) -> List[Optional[Tensor]]:
        """This rank's step gradients of ``tie``, one per partition using it: the first's
        ``.grad``, the later ones' shares."""
        p = tie.parameter()
        if p is None:
            return [None] * tie.ranks.count(self.me)
        return [p.grad, *(cast(Dict[int, Tensor], hook.shares).get(id(p)) for hook in self.hooks
                          if any(m is p for m in hook.masters()))]

    def whole_grads(self) -> List[List[Optional[Tensor]]]:
        """:meth:`own` of each tie, sharded gradients gathered (once a step)."""
        if self.gathered_grads is None:
            self.gathered_grads = [[unsharded(g) for g in self.own(tie)] for tie in self.ties]
        return self.gathered_grads

    def whole_copies(self) -> List[Optional[Tensor]]:
        """This rank's copy of each tie, a sharded one gathered (once a step)."""
        if self.gathered_copies is None:
            self.gathered_copies = [None if p is None else unsharded(p.detach())
                                    for p in (tie.parameter() for tie in self.ties)]
        return self.gathered_copies

    def shares(self, others: Iterable[int]) -> Dict[int, Share]:
        """What this rank sends each of ``others`` (see ``Share``)."""
        grads = self.whole_grads()
        copies = self.whole_copies() if self.checking() else None
        return {rank: ([g for tie, own in zip(self.ties, grads) if rank in tie.ranks
                        for g in own],
                       None if copies is None else
                       [v for tie, v in zip(self.ties, copies) if rank in tie.ranks])
                for rank in others}

    def sum(self, received: Dict[int, Share]) -> None:
        """Gives each tie the sum of the gradients ``received`` and its own, in partition
        order; ``ValueError`` if a copy received differs from this rank's."""
        try:
            for rank, (_, values) in received.items():
                if values is not None:
                    self.compare(rank, values)
        except ValueError:
            self.abandon()
            raise
        self.check = False
        cursors = {rank: iter(grads) for rank, (grads, _) in received.items()}
        cursors[self.me] = iter([g for own in self.whole_grads() for g in own])
        for tie, kept in zip(self.ties, self.kept):
            p = tie.parameter()
            total = add_in_order(None, None, [next(cursors[rank]) for rank in tie.ranks])
            if p is not None:
                p.grad = add_in_order(kept, None if total is None else laid_out_as(total, p),
                                      ())
        self.end()

    def compare(self, rank: int, values: List[Optional[Tensor]]) -> None:
        """Refuses ``rank``'s copies of the ties it shares unequal to this rank's."""
        # Gathered here if this rank did not send its own (it was not checking).
        mine = {id(tie): v for tie, v in zip(self.ties, self.whole_copies())}
        shared = [tie for tie in self.ties if rank in tie.ranks]
        for tie, value in zip(shared, values):
            p = mine.get(id(tie))
            if p is not None and value is not None and not torch.equal(p, value):
                raise ValueError(describe(
                    'the copies of a parameter tied across ranks must be equal',
                    f"'{tie.local}' of rank {self.me} differs from its copy on rank {rank}",
                    'build the module alike on every rank (seed torch.manual_seed alike '
                    'before building it) and load the same state dict on every rank'))

    def abandon(self) -> None:
        """After a failed step: puts the gradients set aside back, with this rank's own."""
        for tie, kept in zip(self.ties, self.kept):
            p = tie.parameter()
            if p is not None:
                p.grad = add_in_order(kept, p.grad, self.own(tie)[1:])
        self.end()

    def end(self) -> None:
        """After a step: nothing set aside, and no shares."""
        self.kept = []
        for hook in self.hooks:
            hook.shares = None
        self.gathered_grads = self.gathered_copies = None


def unsharded(tensor: Optional[Tensor]) -> Optional[Tensor]:
    """``tensor``, or the whole of a sharded one (a DTensor), gathered over its mesh."""
    gather = getattr(tensor, 'full_tensor', None)
    return tensor if gather is None else cast(Tensor, gather())


def laid_out_as(total: Tensor, parameter: Tensor) -> Tensor:
    """``total`` (whole) as ``parameter`` is laid out: this rank's part, if it is sharded."""
    mesh = getattr(parameter, 'device_mesh', None)
    if mesh is None:
        return total
    from torch.distributed.tensor import DTensor, Replicate
    replicated = DTensor.from_local(total, mesh, [Replicate()] * mesh.ndim, run_check=False)
    # From a replicated tensor to any placement: each rank takes its part, no message.
    return replicated.redistribute(mesh, parameter.placements)  # type: ignore[attr-defined]


#: The dtypes a gradient's norm may have, by the code its slot carries (0: no gradient).
DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16)


def slots(module: nn.Module) -> Dict[str, int]:
    """The slot of every parameter name of ``module``: its place in ``module.parameters()``."""
    places: Dict[int, int] = {}
    for p in module.parameters():
        places.setdefault(id(p), len(places))
    return {name: places[id(p)] for name, p in module.named_parameters(remove_duplicate=False)}


def norms_of(grads: Sequence[Tensor], norm_type: float, foreach: Optional[bool]) -> List[Tensor]:
    """The norm of each of ``grads``, computed as :func:`torch.nn.utils.clip_grad_norm_` does."""
    norms: List[Optional[Tensor]] = [None] * len(grads)
    # Plain and sharded gradients apart, and these by mesh: a foreach kernel takes one kind.
    kinds: Dict[Tuple[Any, ...], List[int]] = {}
    for k, g in enumerate(grads):
        key = (type(g), getattr(g, 'device_mesh', None), tuple(getattr(g, 'placements', ())))
        kinds.setdefault(key, []).append(k)
    for places in kinds.values():
        grouped = _group_tensors_by_device_and_dtype([[grads[k] for k in places]],
                                                     with_indices=True)
        for (device, _), ([maybe], indices) in grouped.items():
            tensors = cast(List[Tensor], maybe)
            if (foreach is None and _has_foreach_support(tensors, device)) or \
                    (foreach and _device_has_foreach_support(device)):
                found = list(torch._foreach_norm(tensors, norm_type))
            elif foreach:
                raise RuntimeError(f"foreach=True was given, but torch has no foreach kernels "
                                   f"for {device.type} tensors: give foreach=None or False")
            else:
                found = [torch.linalg.vector_norm(g, norm_type) for g in tensors]
            for index, norm in zip(indices, found):
                norms[places[index]] = norm
    return [n for n in norms if n is not None]


def whole_norms(norms: List[Tensor]) -> List[Tensor]:
    """``norms`` with those of sharded gradients (DTensors holding this rank's part of a
    norm) reduced over their meshes, together for each mesh and placement."""
    DTensor = getattr(sys.modules.get('torch.distributed.tensor'), 'DTensor', None)
    if DTensor is None:  # nothing sharded without it imported
        return norms
    alike: Dict[Tuple[Any, ...], List[int]] = {}
    for i, n in enumerate(norms):
        if isinstance(n, DTensor):
            alike.setdefault((n.device_mesh, tuple(n.placements), n.dtype), []).append(i)
    made = list(norms)
    for indices in alike.values():
        stacked: Any = torch.stack([norms[i] for i in indices])  # a DTensor
        for i, n in zip(indices, stacked.full_tensor()):
            made[i] = n
    return made


def in_torch_order(norms: List[Tensor]) -> List[Tensor]:
    """``norms`` grouped by dtype, as :func:`torch.nn.utils.clip_grad_norm_` stacks them."""
    grouped = _group_tensors_by_device_and_dtype(
        [[torch.empty(0, dtype=n.dtype) for n in norms]], with_indices=True)
    return [norms[i] for _, (_, indices) in grouped.items() for i in indices]


@torch.no_grad()
def total_norm(counted: Sequence[Tuple[int, Tensor]], size: int, norm_type: float,
               device: torch.device, group: Optional[dist.ProcessGroup],
               foreach: Optional[bool] = None) -> Tensor:
    """The norm (zero-dimensional, on ``device``) of every rank's gradients, each of
    ``counted`` with its slot out of ``size``, the same on every rank."""
    vector = torch.zeros(2, size, dtype=torch.float64, device=device)
    if counted:
        places, grads = zip(*counted)
        norms = whole_norms(norms_of(grads, norm_type, foreach))
        where = torch.tensor(places, device=device)
        vector[0, where] = torch.stack([n.to(device, torch.float64) for n in norms])
        vector[1, where] = torch.tensor([DTYPES.index(n.dtype) + 1.0 for n in norms],
                                        dtype=torch.float64, device=device)
    dist.all_reduce(vector, group=group)
    present = vector[1] > 0
    values, codes = vector[0, present], (vector[1, present] - 1).long().tolist()
    if not codes:
        return torch.tensor(0.0, device=device)
    if len(set(codes)) == 1:  # the usual case: the stack of the norms, as they were
        stacked = values.to(DTYPES[codes[0]])
    else:
        stacked = torch.stack(in_torch_order([v.to(DTYPES[c]) for v, c in zip(values, codes)]))
    total: Tensor = torch.linalg.vector_norm(stacked, norm_type)
    return total


@torch.no_grad()
def clip_grads(grads: Iterable[Tensor], max_norm: float, total: Tensor) -> None:
    """Scales ``grads`` in place as :func:`torch.nn.utils.clip_grad_norm_` does given ``total``."""
    coefficient = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coefficient.to(g.device))


def check_finite(total: Tensor, norm_type: float) -> None:
    """Raises as :func:`torch.nn.utils.clip_grad_norm_` does with ``error_if_nonfinite=True``."""
    if not bool(torch.isfinite(total)):
        raise RuntimeError(f'the total norm of order {norm_type} of the gradients is '
                           f'{float(total)}, which cannot be clipped; give '
                           'error_if_nonfinite=False to scale the gradients by it anyway')

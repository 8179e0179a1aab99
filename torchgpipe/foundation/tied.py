"""Tied parameters: one parameter used by layers in several partitions.

A parameter shared across partitions (``head.weight = embedding.weight``)
has one master, on its first partition's device, registered in every layer.
During a call a later partition's layer uses the master, or a
differentiable copy on its device, so every gradient flows into the master
as in the unwrapped model. Buffers cannot be shared: a copy would not carry
in-place changes back. In a training step the master's gradient adds up in
one order whichever way the step runs (:func:`shares_apart`), so every way
gives the same bits::

    partition 0 (owner)  g00 + g01 + ... ───► master.grad ─┐
    partition 3 (uses)   g30 + g31 + ... ───► share 3 ─────┴─► master.grad + share 3
"""
from contextlib import contextmanager
from typing import Any, Dict, Iterable, Iterator, List, NamedTuple, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor, nn

from torchgpipe.foundation.placement import place, same_memory
from torchgpipe.foundation.validation import describe

__all__: List[str] = []


class Use(NamedTuple):
    """A layer of a later partition using the parameter of an earlier one."""

    #: The layer that owns the master, and the master's name there.
    owner: nn.Module
    owner_name: str
    #: The layer of the later partition, and the name it uses the parameter by.
    user: nn.Module
    user_name: str

    def master(self) -> nn.Parameter:
        # Looked up each time: load_state_dict(assign=True) replaces the master.
        return cast(nn.Parameter, self.owner._parameters[self.owner_name])


class TiedUses:
    """The ``uses`` of earlier partitions' parameters in one partition on ``device``; called,
    the partition's forward pre-hook that lends the masters to them."""

    def __init__(self, uses: List[Use], device: torch.device) -> None:
        self.uses = uses
        self.device = device
        #: In a training step, this partition's share of each master's
        #: gradient, by the master's id (see :func:`shares_apart`).
        self.shares: Optional[Dict[int, Tensor]] = None

    def masters(self) -> Tuple[nn.Parameter, ...]:
        """The distinct masters this partition uses."""
        return tuple({id(p): p for p in (use.master() for use in self.uses)}.values())

    def __call__(self, partition: nn.Module, input: Any) -> None:
        """Forward pre-hook: gives each use its master, or a copy of it on this device."""
        # A copy per call (micro-batch and pass) follows the pass's grad mode and
        # belongs to its graph alone, a recomputation's too. In the master's own
        # memory the "copy" is the master itself.
        copies: Dict[int, Tensor] = {}
        shares = self.shares if torch.is_grad_enabled() else None
        for use in self.uses:
            master = use.master()
            if id(master) not in copies:
                used = master if shares is None else cast(
                    Tensor, Share.apply(master, shares))  # type: ignore[no-untyped-call]
                copies[id(master)] = (used if same_memory(master.device, self.device)
                                      else used.to(self.device))
            # Past nn.Module.__setattr__: hides the registered master for the call.
            object.__setattr__(use.user, use.user_name, copies[id(master)])

    def give_back(self, partition: nn.Module, input: Any, output: Any) -> None:
        """Forward hook, also after an exception: the uses read their registered masters."""
        for use in self.uses:
            use.user.__dict__.pop(use.user_name, None)


def shared_error(name: str, j: int, later_name: str, k: int) -> ValueError:
    """The error of a buffer, or a layer holding tensors, in two partitions."""
    return ValueError(describe(
        'a buffer, or a layer with parameters or buffers, cannot be in two partitions',
        f"'{name}' of partition {j} is '{later_name}' of partition {k}",
        'change the balance to put the layers sharing it in one partition; '
        'across partitions, layers can share parameters only'))


def find_ties(partitions: Sequence[nn.Module]) -> List[List[Use]]:
    """For each partition, the uses of an earlier partition's parameters (a layer's once).

    Raises:
        ValueError: a buffer, or a layer with parameters or buffers, is in
            two partitions
    """
    # Where each tensor, or layer with tensors, is first found: partition and name.
    first: Dict[int, Tuple[int, str]] = {}
    owners: Dict[int, Tuple[nn.Module, str]] = {}
    found: List[List[Use]] = []
    for k, partition in enumerate(partitions):
        uses: List[Use] = []
        for path, module in partition.named_modules():
            prefix = path + '.' if path else ''
            parameters = [(n, p) for n, p in module._parameters.items() if p is not None]
            buffers = [(n, b) for n, b in module._buffers.items() if b is not None]
            if parameters or buffers:
                j, name = first.setdefault(id(module), (k, path))
                if j != k:
                    raise shared_error(name, j, path, k)
            for is_parameter, tensors in ((True, parameters), (False, buffers)):
                for tensor_name, tensor in tensors:
                    j, name = first.setdefault(id(tensor), (k, prefix + tensor_name))
                    if j == k:
                        owners.setdefault(id(tensor), (module, tensor_name))
                    elif is_parameter:
                        uses.append(Use(*owners[id(tensor)], module, tensor_name))
                    else:
                        raise shared_error(name, j, prefix + tensor_name, k)
        found.append(uses)
    return found


def tie_partitions(partitions: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
    """Hooks each partition that uses earlier partitions' parameters to lend them to its
    layers at every call (:class:`TiedUses`); :class:`ValueError` as :func:`find_ties`,
    before hooking anything."""
    for partition, device, uses in zip(partitions, devices, find_ties(partitions)):
        if uses:
            tied = TiedUses(uses, device)
            partition.register_forward_pre_hook(tied)
            partition.register_forward_hook(tied.give_back, always_call=True)


def place_partitions(partitions: Sequence[nn.Module], devices: Sequence[torch.device]) -> None:
    """Moves each partition to its device, each tensor keeping its object; a parameter
    shared across partitions stays with the first. :class:`ValueError` as
    :func:`find_ties`, before changing anything."""
    tie_partitions(partitions, devices)
    # One memo for all: a tensor moves with its first partition only.
    placed: Dict[int, Tensor] = {}
    for partition, device in zip(partitions, devices):
        place(partition, device, placed)


class Share(torch.autograd.Function):
    """The master as a later partition uses it in a training step: its gradient goes to
    the partition's share, not to the master."""

    @staticmethod
    def forward(ctx: Any, master: Tensor, shares: Dict[int, Tensor]) -> Tensor:
        ctx.shares = shares
        ctx.key = id(master)
        return master.view_as(master)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[None, None]:
        # One worker runs a partition's backward passes: no other thread adds here.
        shares: Dict[int, Tensor] = ctx.shares
        share = shares.get(ctx.key)
        if share is None:
            shares[ctx.key] = grad.detach().clone()
        else:
            share.add_(grad)
        return None, None


def tied_uses(partitions: Sequence[nn.Module]) -> List[TiedUses]:
    """The hooks of the partitions that use earlier partitions' parameters, in order."""
    return [hook for partition in partitions for hook in partition._forward_pre_hooks.values()
            if isinstance(hook, TiedUses)]


def tied_masters(partitions: Sequence[nn.Module]) -> List[nn.Parameter]:
    """The parameters that layers of several partitions use, each once."""
    return list({id(m): m for hook in tied_uses(partitions) for m in hook.masters()}.values())


@contextmanager
def shares_apart(partitions: Sequence[nn.Module]) -> Iterator[None]:
    """Around a training step: the gradient of each tied master in one order of additions.

    Earlier steps' gradients are set aside; the owner's uses accumulate into
    ``.grad``, each later partition's into its share (:class:`Share`). As the
    step ends, also on failure, each master gets back its gradient plus the
    owner's plus the shares in partition order: the same bits on one thread,
    on worker threads, and across processes.
    """
    hooks = tied_uses(partitions)
    masters = tied_masters(partitions)
    kept = [m.grad for m in masters]
    for master in masters:
        master.grad = None
    for hook in hooks:
        hook.shares = {}
    try:
        yield
    finally:
        for master, earlier in zip(masters, kept):
            shares = (cast(Dict[int, Tensor], hook.shares).get(id(master)) for hook in hooks)
            master.grad = add_in_order(earlier, master.grad, [
                None if share is None else share.to(master.device) for share in shares])
        for hook in hooks:
            hook.shares = None


def add_in_order(kept: Optional[Tensor], first: Optional[Tensor],
                 rest: Iterable[Optional[Tensor]]) -> Optional[Tensor]:
    """``kept + (first + rest[0] + rest[1] + ...)``, added in that order (floating-point
    addition is not associative), into ``kept``'s memory, else ``first``'s, never into one
    of ``rest`` (which may be reused). ``None`` is no gradient."""
    total = first
    with torch.no_grad():
        for grad in rest:
            if grad is not None:
                total = grad.clone() if total is None else total.add_(grad)
        if kept is None or total is None:
            return total if kept is None else kept
        return kept.add_(total)

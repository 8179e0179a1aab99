"""FSDP2 units inside a rank's partitions: one gradient reduction per unit per step.

A partition's layers may be ``fully_shard`` units over a data-parallel mesh dimension.
Left alone, each unit reduce-scatters its gradients after every micro-batch's backward
pass, and gathers its parameters again for the next. Driven here, as
torch.distributed.pipelining drives them, the units keep their gradients (and their
gathered parameters) through the step, and each reduces once, after its partition's last
``B`` (or ``W``)::

    partition 1   B3 B2 B1 B0 ─► reduce its units (sync, reshard: on again)
    partition 0      B3 B2 B1 B0 ─► reduce its units

The units' parameters are gathered as the step starts, all at once: the gathering overlaps
the first passes (on CPU ranks too, where gloo gathers in its own threads). Units that
reshard after forward passes gather when needed, and reshard only where the rank runs
another partition next: ``F0 F1 B0`` on one partition gathers once, not three times.
"""
import sys
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

from torch import nn

from torchgpipe.engine.step import Reducer

__all__: List[str] = []


def fsdp_units(partitions: Mapping[int, nn.Module]) -> Dict[int, List[nn.Module]]:
    """The ``fully_shard`` units of each partition that holds any."""
    # Without FSDP imported there is no unit (and importing it costs a process a second).
    fsdp = sys.modules.get('torch.distributed.fsdp')
    FSDPModule = getattr(fsdp, 'FSDPModule', None)  # (none before torch 2.4)
    if FSDPModule is None:
        return {}
    units: Dict[int, List[nn.Module]] = {
        j: [m for m in p.modules() if isinstance(m, FSDPModule)] for j, p in partitions.items()}
    return {j: found for j, found in units.items() if found}


def synced(unit: nn.Module, on: bool) -> None:
    """Turns a unit's gradient sync, resharding after backward and last-backward flag on
    or off together."""
    unit.set_is_last_backward(on)  # type: ignore[operator]
    unit.set_reshard_after_backward(on)  # type: ignore[operator]
    unit.set_requires_gradient_sync(on)  # type: ignore[operator]


def reduce(unit: nn.Module) -> None:
    """Reduces the gradients ``unit`` kept: FSDP's post-backward work for each of its
    parameter groups, then its root's end of backward (the wait for the reductions). A
    unit that never ran (FSDP initializes one at its root's first forward pass) has none."""
    from torch.distributed.fsdp import fully_shard
    state = fully_shard.state(unit)  # type: ignore[attr-defined]
    if state._is_root is None:
        return
    for each in state._state_ctx.all_states:
        for group in each._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


class Units(Reducer):
    """The ``fully_shard`` units of each partition, driven through a training step."""

    def __init__(self, units: Dict[int, List[nn.Module]]) -> None:
        self.units = units
        every = {id(unit) for found in units.values() for unit in found}
        #: The ids of the units inside another, which FSDP never makes a root.
        self.inner = {id(m) for found in units.values() for unit in found
                      for m in unit.modules() if m is not unit and id(m) in every}

    def done(self, j: int) -> None:
        for unit in self.units.get(j, []):
            synced(unit, True)
            reduce(unit)

    @contextmanager
    def keep_gathered(self, j: int) -> Iterator[None]:
        """Partition ``j``'s units do not reshard after this forward pass (or
        recomputation), as FSDP leaves its root: the same partition runs next on this rank,
        and would gather the parameters again at once. They reshard after the step's
        reduction, or after a forward pass that another partition of the rank follows.
        Those resharded to a smaller group (``reshard_after_forward=<int>``) are left to
        FSDP, which gathers them from it."""
        kept = [(group, group.post_forward_mesh_info)
                for unit in self.units.get(j, []) for group in self.resharding(unit)
                if not group.is_sharded_post_forward]
        for group, _ in kept:
            group.post_forward_mesh_info = None
        try:
            yield
        finally:
            for group, info in kept:
                group.post_forward_mesh_info = info

    def resharding(self, unit: nn.Module) -> List[Any]:
        """The parameter groups of ``unit`` (its own, not its inner units') that reshard
        after a forward pass. None before FSDP's first forward pass of a unit it will make a
        root (not inside another): a root stops resharding, unless its user chose
        (``reshard_after_forward`` not ``None``)."""
        from torch.distributed.fsdp import fully_shard
        state = fully_shard.state(unit)  # type: ignore[attr-defined]
        if state._is_root is None and id(unit) not in self.inner and \
                getattr(state, '_auto_reshard_after_forward', False):
            return []
        return [group for group in state._fsdp_param_groups
                if group.post_forward_mesh_info is not None]

    def gather_ahead(self) -> List[Tuple[nn.Module, Any]]:
        """Starts gathering the parameters of the units that keep them after forward passes,
        in the order the passes need them: the gathering overlaps the first passes, and
        FSDP's pre-forward waits for each (``async_op``: see ``FSDPModule.unshard``). Those
        that reshard gather when needed, not to hold memory early. Returns each unit and
        its handle."""
        return [(unit, unit.unshard(async_op=True))  # type: ignore[operator]
                for j in sorted(self.units) for unit in self.units[j]
                if not self.resharding(unit)]


@contextmanager
def driving(partitions: Mapping[int, nn.Module]) -> Iterator[Optional[Units]]:
    """Runs a training step's backward passes with the FSDP units of ``partitions``
    keeping their gradients, their parameters gathered from the start; yields what reduces
    partition ``j``'s once they are final (``None`` without units). The units' flags are
    on again after."""
    units = fsdp_units(partitions)
    if not units:
        yield None
        return
    driven = Units(units)
    try:
        for found in units.values():
            for unit in found:
                synced(unit, False)
        ahead = driven.gather_ahead()
        yield driven
        # A unit that did not run leaves its gathering pending, which its next forward pass
        # would take, stale if its shards changed meanwhile: taken and freed here.
        for unit, handle in ahead:
            handle.wait()
            unit.reshard()  # type: ignore[operator]
    finally:
        for found in units.values():
            for unit in found:
                synced(unit, True)

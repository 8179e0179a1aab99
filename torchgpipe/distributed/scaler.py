"""Loss scaling across the ranks of a pipeline: one decision to skip a step, taken by all.

:class:`torch.amp.GradScaler` unscales the gradients an optimizer holds and
skips its step when one of them is infinite or NaN. On a rank of a
:class:`~torchgpipe.distributed.DistributedGPipe`, the optimizer holds that
rank's gradients only: an overflow in one partition would make its rank skip
the step while the others take theirs, and the copies of the model would no
longer be one model, silently. :class:`GradScaler` adds one all-reduce to the
unscaling: the flag "found an infinity" of every rank, combined by ``max``,
so that every rank skips, or steps, and updates its scale alike::

    rank 0:  unscale ─► found 0 ─┐                 ┌─► found 1: skip, scale / 2
                                 ├─ all-reduce max ┤
    rank 1:  unscale ─► found 1 ─┘                 └─► found 1: skip, scale / 2

Only the last partition's rank calls ``loss_fn``, and so ``scaler.scale``:
the gradients the other ranks receive are scaled all the same. Their scale
starts at ``init_scale`` as the last rank's does, and every update is the
same on every rank, so every rank unscales by the factor the loss was scaled by.
"""
from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ['GradScaler']


class GradScaler(torch.amp.GradScaler):
    """A :class:`torch.amp.GradScaler` for the ranks of a pipeline (or a group of
    pipelines), which skip a step together when any rank finds an infinity or NaN.

    Use it as torch's, on every rank, with ``scaler.scale`` inside the
    ``loss_fn`` of :meth:`~torchgpipe.distributed.DistributedGPipe.train_step`
    (the rank of the last partition calls it). Each :meth:`unscale_` (and
    ``step``, which unscales first if need be) is a collective of
    ``group``: every rank calls it, for the same number of optimizers, in the
    same order. In one process, :class:`torch.amp.GradScaler` itself sees every
    gradient of a :class:`~torchgpipe.GPipe`: it needs no other.

    Args:
        device (str): as for :class:`torch.amp.GradScaler` (default: ``'cuda'``)
        init_scale, growth_factor, backoff_factor, growth_interval, enabled:
            as for :class:`torch.amp.GradScaler`

    Keyword Args:
        group (torch.distributed.ProcessGroup, optional): the ranks that skip
            together: every rank of the pipeline, and of its replicas under
            DDP (default: the default group)

    Example::

        scaler = torchgpipe.distributed.GradScaler('cuda')
        for input, target in loader:
            optimizer.zero_grad()
            with torch.autocast('cuda'):
                pipe.train_step(input, target,
                                lambda out, tgt: scaler.scale(F.cross_entropy(out, tgt)))
            scaler.unscale_(optimizer)               # every rank
            pipe.clip_grad_norm_(1.0)                # the norm over every rank
            scaler.step(optimizer)                   # skipped on every rank, or on none
            scaler.update()
    """

    def __init__(self, device: str = 'cuda', init_scale: float = 2.0 ** 16,
                 growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, enabled: bool = True, *,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__(device, init_scale, growth_factor, backoff_factor, growth_interval,
                         enabled)
        self.group = group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscales the optimizer's gradients, as :meth:`torch.amp.GradScaler.unscale_`,
        and finds an infinity or NaN if any rank of the group finds one.

        Raises:
            RuntimeError: as :meth:`torch.amp.GradScaler.unscale_` raises
        """
        if not self.is_enabled():
            return
        if self._scale is None:
            # A rank that computes no loss has not scaled one: its gradients
            # are scaled by the last rank's scale, the same as this one's.
            self._lazy_init_scale_growth_tracker(torch.device(self._device))
        super().unscale_(optimizer)
        found: List[torch.Tensor] = list(
            self._per_optimizer_states[id(optimizer)]['found_inf_per_device'].values())
        assert self._scale is not None
        anywhere = torch.zeros((), dtype=torch.float32, device=self._scale.device)
        for flag in found:
            anywhere = torch.maximum(anywhere, flag.to(anywhere.device))
        dist.all_reduce(anywhere, dist.ReduceOp.MAX, group=self.group)
        for flag in found:
            flag.copy_(anywhere)

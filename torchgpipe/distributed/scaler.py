"""Loss scaling whose ranks skip a step together: an overflow on one rank skipping its
step alone would split the model."""
from typing import List, Optional

import torch
import torch.distributed as dist

__all__ = ['GradScaler']


class GradScaler(torch.amp.GradScaler):
    """A :class:`torch.amp.GradScaler` whose ranks (of a pipeline, or of its replicas too)
    skip a step together when any finds an infinity or NaN.

    Use it as torch's, on every rank, ``scaler.scale`` inside ``loss_fn``. Each
    :meth:`unscale_` (and ``step``) is a collective: every rank calls it, for the same
    optimizers in the same order.

    Args:
        device (str): as for :class:`torch.amp.GradScaler` (default: ``'cuda'``)
        init_scale, growth_factor, backoff_factor, growth_interval, enabled:
            as for :class:`torch.amp.GradScaler`

    Keyword Args:
        group (torch.distributed.ProcessGroup, optional): the ranks that skip together,
            the pipeline's and its replicas' (default: the default group)

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
        """:meth:`torch.amp.GradScaler.unscale_`, raising as it does, that finds an infinity
        or NaN if any rank of the group finds one."""
        if not self.is_enabled():
            return
        if self._scale is None:
            # No loss scaled here: the last rank's scale, equal to this one's, applies.
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

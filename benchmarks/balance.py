"""How the experiments split their models: even, by time, or by estimated memory on ``meta``."""
import warnings
from typing import Any, List, Sequence, Tuple

import torch
from torch import nn

__all__ = ['even_balance', 'auto_balance', 'size_balance', 'materialize']


def even_balance(num_layers: int, partitions: int) -> List[int]:
    """Splits layers into partitions of nearly equal counts."""
    base, extra = divmod(num_layers, partitions)
    return [base + (j < extra) for j in range(partitions)]


def auto_balance(model: nn.Sequential, partitions: int, sample: Any, device: torch.device,
                 timeout: float) -> Tuple[List[int], str]:
    """A balance by :func:`torchgpipe.balance.balance_by_time`, or an even split without it.

    Returns:
        (balance, method): ``method`` is ``'time'``, ``'even'`` or ``'single'``
    """
    if partitions == 1:
        return [len(model)], 'single'
    from torchgpipe.balance import balance_by_time
    try:
        balance = balance_by_time(partitions, model, sample, timeout=timeout, device=device)
    except Exception as exc:  # noqa: BLE001 - any failure falls back to the even split
        warnings.warn(f'balance_by_time failed ({exc!r}); using an even split')
        return even_balance(len(model), partitions), 'even'
    return list(balance), 'time'


def size_balance(model: nn.Sequential, partitions: int, sample: torch.Tensor, *,
                 param_scale: float = 2.0) -> Tuple[List[int], str]:
    """A balance by estimated memory, computed on the ``meta`` device (any model size).

    A layer costs ``param_scale`` times its parameter bytes (the parameters
    and their gradients under plain SGD) plus the bytes of its output for
    ``sample`` (a micro-batch, on the meta device). The costs are split by
    :func:`torchgpipe.balance.blockpartition.solve`.
    """
    if partitions == 1:
        return [len(model)], 'single'
    from torchgpipe.balance.blockpartition import solve
    costs: List[int] = []
    x: Any = sample
    with torch.no_grad():
        for layer in model:
            x = layer(x)
            outputs = (x,) if isinstance(x, torch.Tensor) else x
            activation = sum(t.numel() * t.element_size() for t in outputs)
            params = sum(p.numel() * p.element_size() for p in layer.parameters())
            costs.append(int(param_scale * params + activation))
    return [len(block) for block in solve(costs, partitions)], 'size (meta)'


def materialize(model: nn.Sequential, balance: Sequence[int],
                devices: Sequence[torch.device]) -> nn.Sequential:
    """Allocates a ``meta`` model's layers on their partitions' devices, freshly initialized.

    A model too large for one device (or for the host) is built on the meta
    device, and each layer is then allocated straight on its own device.
    """
    layers = iter(model)
    for count, device in zip(balance, devices):
        for _ in range(count):
            layer = next(layers)
            layer.to_empty(device=device)
            for module in layer.modules():
                reset = getattr(module, 'reset_parameters', None)
                if callable(reset):
                    reset()
    return model

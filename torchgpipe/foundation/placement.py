"""Placing layers on devices without replacing the tensors they hold.

A tensor may be held by several modules (a buffer a generated child
registers too). :meth:`torch.nn.Module.to` would split it in two, so that a
later ``load_state_dict`` or in-place change would not reach the pipeline.
Here every object is kept: a tensor already in the target's memory stays
(every CPU device is the one CPU memory; the index only gives a worker
thread), and one that must move takes its moved data in place
(``t.data = t.data.to(device)``), gradient included. Only on the ``'meta'``
device are tensors replaced.
"""
from typing import Dict, List, Optional, Sequence, cast

import torch
from torch import Tensor, nn

from torchgpipe.foundation.validation import describe

__all__: List[str] = []


def same_memory(a: torch.device, b: torch.device) -> bool:
    """Whether tensors on devices ``a`` and ``b`` are in the same memory, so
    that neither needs a copy to be used on the other.

    >>> same_memory(torch.device('cpu'), torch.device('cpu:1'))
    True
    """
    if a.type != b.type:
        return False
    if a.type == 'cpu':
        return True
    return _indexed(a) == _indexed(b)


def _indexed(device: torch.device) -> torch.device:
    # 'cuda' is where .to('cuda') puts a tensor: the current device.
    if device == torch.device('cuda'):
        return torch.device('cuda', torch.cuda.current_device())
    return device


def place(module: nn.Module, device: torch.device,
          placed: Optional[Dict[int, Tensor]] = None) -> None:
    """Moves the parameters, their gradients and the buffers of ``module``
    to ``device``, each keeping its object where PyTorch allows (see above).

    ``placed`` (by id, each tensor placed so far) leaves those where they are.
    """
    placed = {} if placed is None else placed
    moved = False
    for layer in module.modules():
        parameters = cast(Dict[str, Optional[Tensor]], layer._parameters)
        for slots in (parameters, layer._buffers):
            for name, tensor in slots.items():
                if tensor is None:
                    continue
                if id(tensor) not in placed:
                    moved = moved or not same_memory(tensor.device, device)
                    placed[id(tensor)] = _place(tensor, device)
                slots[name] = placed[id(tensor)]
    if not moved:
        return
    for layer in module.modules():
        # What nn.RNNBase does after Module.to: put the moved weights in one
        # block of memory for cuDNN (in place; a no-op elsewhere).
        if isinstance(layer, nn.RNNBase):
            layer.flatten_parameters()


def _place(tensor: Tensor, device: torch.device) -> Tensor:
    """The tensor on ``device``: itself, moved in place if it must move."""
    if same_memory(tensor.device, device):
        return tensor
    grad = tensor.grad if isinstance(tensor, nn.Parameter) else None
    with torch.no_grad():
        data = tensor.data.to(device)
        if torch._has_compatible_shallow_copy_type(tensor, data):
            tensor.data = data
            if grad is not None:
                grad.data = grad.data.to(device)
            return tensor
        # A device whose tensors cannot hold another's data: a new tensor,
        # as Module.to makes.
        if isinstance(tensor, nn.Parameter):
            parameter = nn.Parameter(data, tensor.requires_grad)
            if grad is not None:
                parameter.grad = grad.to(device)
            return parameter
        return data.requires_grad_(tensor.requires_grad)


def check_materialized(module: nn.Sequential, balance: Optional[List[int]] = None,
                       devices: Sequence[Optional[torch.device]] = ()) -> None:
    """Checks that the layers to place hold data: a layer on the meta device can be
    neither copied nor trained before its initialization. Partitions on the meta device,
    or ``None`` (another rank's), are not checked.

    Raises:
        ValueError: a parameter or buffer of a checked layer is on the meta device
    """
    layers = list(module.named_children())
    if balance is not None:
        placed = [d is not None and d.type != 'meta' for d, n in zip(devices, balance)
                  for _ in range(n)]
        layers = [layer for layer, kept in zip(layers, placed) if kept]
    for child, layer in layers:
        for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
            if tensor.is_meta:
                raise ValueError(describe(
                    'the layers must hold data to be placed on a device',
                    f"'{child}.{name}' on the meta device",
                    'materialize it first: model.to_empty(device=...), then initialize it '
                    '(reset_parameters() or load_state_dict()), or build it on a real device'))

"""Placing layers on devices without replacing the tensors they hold.

:meth:`torch.nn.Module.to` would split a tensor several modules hold, so a
later ``load_state_dict`` or in-place change would miss the pipeline. Here
a tensor already in the target's memory stays (every CPU device is one
memory), and one that must move takes its moved data in place, gradient
included. Only on the ``'meta'`` device are tensors replaced; one that is on
it stays there, for its owner to materialize (``to_empty``).
"""
from typing import Dict, List, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor, nn

from torchgpipe.foundation.validation import describe

__all__: List[str] = []


def same_memory(a: torch.device, b: torch.device) -> bool:
    """Whether tensors on devices ``a`` and ``b`` share one memory, needing no copy.

    >>> same_memory(torch.device('cpu'), torch.device('cpu:1'))
    True
    """
    if a.type != b.type:
        return False
    if a.type == 'cpu':
        return True
    return indexed(a) == indexed(b)


def indexed(device: torch.device) -> torch.device:
    """The device, a bare ``'cuda'`` as the current one (where ``.to('cuda')`` puts a tensor)."""
    if device == torch.device('cuda'):
        return torch.device('cuda', torch.cuda.current_device())
    return device


def place(module: nn.Module, device: torch.device,
          placed: Optional[Dict[int, Tensor]] = None) -> None:
    """Moves the parameters, their gradients and the buffers of ``module`` to ``device``,
    each keeping its object where PyTorch allows; those in ``placed`` (by id) stay."""
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
        # As nn.RNNBase after Module.to: one block of memory for cuDNN.
        if isinstance(layer, nn.RNNBase):
            layer.flatten_parameters()


def _place(tensor: Tensor, device: torch.device) -> Tensor:
    """The tensor on ``device``: itself, moved in place if it must move."""
    if same_memory(tensor.device, device) or tensor.is_meta:
        return tensor
    grad = tensor.grad if isinstance(tensor, nn.Parameter) else None
    with torch.no_grad():
        data = tensor.data.to(device)
        if torch._has_compatible_shallow_copy_type(tensor, data):
            tensor.data = data
            if grad is not None:
                grad.data = grad.data.to(device)
            return tensor
        # Tensors that cannot hold another device's data: a new one, as Module.to makes.
        if isinstance(tensor, nn.Parameter):
            parameter = nn.Parameter(data, tensor.requires_grad)
            if grad is not None:
                parameter.grad = grad.to(device)
            return parameter
        return data.requires_grad_(tensor.requires_grad)


def check_materialized(module: nn.Sequential, balance: Optional[List[int]] = None,
                       devices: Sequence[Optional[torch.device]] = ()) -> None:
    """Checks that the layers to place hold data (a meta layer can be neither copied nor
    trained); partitions on the meta device or ``None`` (another rank's) are skipped.

    Raises:
        ValueError: a parameter or buffer of a checked layer is on the meta device
    """
    layers = list(module.named_children())
    if balance is not None:
        placed = [d is not None and d.type != 'meta' for d, n in zip(devices, balance)
                  for _ in range(n)]
        layers = [layer for layer, kept in zip(layers, placed) if kept]
    on_meta = first_on_meta(layers)
    if on_meta is not None:
        raise ValueError(describe(
            'the layers must hold data to be placed on a device',
            f"'{on_meta}' on the meta device",
            'materialize it first: model.to_empty(device=...), then initialize it '
            '(reset_parameters() or load_state_dict()), or build it on a real device'))


def first_on_meta(layers: Sequence[Tuple[str, nn.Module]]) -> Optional[str]:
    """The name of the first parameter or buffer of ``layers`` (named) on the meta device."""
    for child, layer in layers:
        for name, tensor in [*layer.named_parameters(), *layer.named_buffers()]:
            if tensor.is_meta:
                return f'{child}.{name}'
    return None

"""Replacing layers of a module in place, and a BatchNorm's state shared by its replacement
(for :mod:`torchgpipe.runtime.batchnorm`)."""
from typing import Any, Callable, Dict, List, Optional

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__: List[str] = []


def share_state(source: _BatchNorm, target: _BatchNorm) -> None:
    """Gives ``target`` the parameters, running statistics, training mode and quantization
    config of ``source``: the same objects, so the optimizer keeps seeing them."""
    target.weight = source.weight
    target.bias = source.bias
    target.running_mean = source.running_mean
    target.running_var = source.running_var
    target.num_batches_tracked = source.num_batches_tracked

    target.train(source.training)
    qconfig: Any = getattr(source, 'qconfig', None)
    if qconfig is not None:
        target.qconfig = qconfig


def replace_layers(module: nn.Module,
                   replace: Callable[[nn.Module], Optional[nn.Module]]) -> nn.Module:
    """Replaces layers in ``module`` (itself included), in place, in their parents, and
    returns ``module`` or its replacement; ``replace`` gives a layer's replacement, or
    ``None`` to look into its children. A layer of several parents is replaced once."""
    memo: Dict[int, nn.Module] = {}

    def walk(layer: nn.Module) -> nn.Module:
        if id(layer) in memo:
            return memo[id(layer)]
        replacement = replace(layer)
        if replacement is None:
            replacement = layer
            for name, child in layer.named_children():
                new_child = walk(child)
                if new_child is not child:
                    layer.add_module(name, new_child)
        memo[id(layer)] = replacement
        return replacement

    return walk(module)

"""Replacing layers of a module in place, and a BatchNorm's state shared by its replacement.

Deferred BatchNorm (:mod:`torchgpipe.runtime.batchnorm`) replaces the BatchNorm
layers of a model by deferred ones, and :func:`~torchgpipe.runtime.batchnorm.restore_batch_norm`
replaces them back: both walk the model with :func:`replace_layers`, and
hand the replacement the very tensors of the layer it replaces
(:func:`share_state`).
"""
from typing import Any, Callable, Dict, List, Optional

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__: List[str] = []


def share_state(source: _BatchNorm, target: _BatchNorm) -> None:
    """Gives ``target`` the parameters, running statistics, training mode and
    quantization config of ``source``: the same objects, not copies."""
    # Share, don't copy: the optimizer and whoever else holds the
    # parameters and buffers keep seeing the live tensors.
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
    """Replaces layers in ``module``, in place, in their parents.

    Args:
        module (nn.Module): the module to walk, itself included
        replace (callable): the replacement of a layer, or ``None`` to keep
            the layer and look into its children instead

    Returns:
        nn.Module: ``module``, or its replacement

    A layer reached through several parents is replaced once, by one shared
    replacement.
    """
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

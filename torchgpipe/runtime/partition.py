"""Partitions: splitting a sequential module into them, and running one as a task's function."""
from collections import OrderedDict
from typing import Callable, Iterable, List, Tuple, cast

import torch
from torch import nn

from torchgpipe.foundation.microbatch import TensorOrTensors, check
from torchgpipe.foundation.tied import place_partitions
from torchgpipe.foundation.placement import check_materialized
from torchgpipe.foundation.validation import check_balance, check_devices
from torchgpipe.skip.tracker import SkipTracker, use_skip_tracker

__all__ = ['split_module']


def split_module(module: nn.Sequential, balance: Iterable[int],
                 devices: List[torch.device],
                 ) -> Tuple[List[nn.Sequential], List[int], List[torch.device]]:
    """Splits a module into partitions by the balance, each moved to its device.

    Every argument is checked before the first layer moves. Tensors move in place,
    keeping their objects; a parameter tied across partitions stays with its first
    (see :ref:`guide-tied-weights`).

    Args:
        module (nn.Sequential): the module to split
        balance (ints): the number of layers of each partition
        devices (list of torch.device): the devices, one per partition at least

    Returns:
        (partitions, balance, devices): the partitions (with the children's
        original names), the balance as a list, and the devices in use

    Raises:
        TypeError: the balance is not an iterable of ints
        BalanceError: the balance does not sum to the number of layers, or has
            a non-positive entry
        IndexError: fewer devices than partitions
        ValueError: a device in use is a CUDA device that does not exist here; a
            layer's tensor is on the meta device; or a buffer, or a layer with
            parameters or buffers, is in two partitions
    """
    balance = check_balance(module, balance)
    devices = check_devices(devices, len(balance))
    check_materialized(module, balance, devices)

    children = iter(module.named_children())
    partitions = []
    for size in balance:
        layers: 'OrderedDict[str, nn.Module]' = OrderedDict(next(children) for _ in range(size))
        partitions.append(nn.Sequential(layers))

    place_partitions(partitions, devices)

    return partitions, balance, devices[:len(balance)]


def partition_function(partition: nn.Sequential, j: int, skip_tracker: SkipTracker,
                       ) -> Callable[[TensorOrTensors], TensorOrTensors]:
    """A task's function of a partition: it checks the output type and runs with the
    micro-batch's skip tracker current, in any thread (a recomputation's too)."""
    what = f'output of partition {j}'

    def function(input: TensorOrTensors) -> TensorOrTensors:
        with use_skip_tracker(skip_tracker):
            output = partition(input)
        check(output, what)
        return cast(TensorOrTensors, output)
    return function

"""Automatic balancing: the ``balance`` argument of :class:`~torchgpipe.GPipe`, from profiling.

Each layer's time or memory is measured, and the costliest partition made as cheap
as possible (:func:`torchgpipe.balance.blockpartition.solve`).

Example::

    balance = balance_by_time(torch.cuda.device_count(), model, sample)
    model = GPipe(model, balance, chunks=8)
"""
from typing import List

import torch
from torch import nn

from torchgpipe.foundation.placement import check_materialized, indexed
from torchgpipe.foundation.validation import (Device, check_available, check_chunks,
                                              check_number, describe, parse_device,
                                              verify_module)
from torchgpipe.balance import blockpartition
from torchgpipe.balance.profile import profile_sizes, profile_times
from torchgpipe.foundation.microbatch import TensorOrTensors, check, scatter

__all__ = ['balance_by_time', 'balance_by_size']


def balance_cost(cost: List[int], partitions: int) -> List[int]:
    """Per-layer costs as a ``balance``."""
    return [len(block) for block in blockpartition.solve(cost, partitions)]


def balance_by_time(partitions: int, module: nn.Sequential, sample: TensorOrTensors, *,
                    timeout: float = 1.0, device: Device = torch.device('cuda')) -> List[int]:
    """Computes a ``balance`` that evens out the time of each partition.

    Every layer is timed, forward and backward, on a copy on ``device``, over whole passes
    repeated until ``timeout`` (after one to warm up). ``module`` is left untouched.

    Args:
        partitions (int): how many partitions, usually the number of devices
        module (torch.nn.Sequential): the model to split
        sample (torch.Tensor or tuple of tensors): an input, best of the training batch size

    Keyword Args:
        timeout (float): how long to profile, in seconds (default: ``1.0``)
        device ('cpu' or 'cuda' device): where to time the layers, like the partitions'
            devices (default: the current CUDA device)

    Returns:
        list of ints: the number of layers of each partition, the ``balance``

    Raises:
        TypeError: ``module`` is not an ``nn.Sequential``, ``sample`` is not a tensor or a
            tuple of tensors, or an argument has the wrong type
        ValueError: ``partitions`` is not positive or exceeds the layers, ``timeout`` is
            negative, ``device`` is not available, or a parameter already has a gradient

    Example::

        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        >>> balance = balance_by_time(2, model, torch.rand(16, 8), timeout=0.1, device='cpu')
        >>> gpipe = GPipe(model, balance, devices=['cpu', 'cpu'], chunks=4)
        >>> sum(balance)
        4
    """
    check_splittable(partitions, module)
    check(sample, 'sample')
    check_number('timeout', timeout, 'give a time in seconds, such as timeout=1.0')
    profile_device = profiling_device(device)
    check_materialized(module, [len(module)], [profile_device])

    times = profile_times(module, sample, timeout, profile_device)
    return balance_cost(times, partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: TensorOrTensors, *,
                    chunks: int = 1, param_scale: float = 2.0,
                    device: Device = torch.device('cuda')) -> List[int]:
    """Computes a ``balance`` that evens out the memory each partition needs for training.

    A layer's size is what its forward keeps for the first of ``chunks`` micro-batches
    of ``input`` (on CUDA, the allocator's growth; on CPU, the storages saved for
    backward, output or stashed), plus ``param_scale`` times its parameters' bytes.
    ``module`` is left untouched.

    Args:
        partitions (int): how many partitions, usually the number of devices
        module (torch.nn.Sequential): the model to split
        input (torch.Tensor or tuple of tensors): a mini-batch of the training size

    Keyword Args:
        chunks (int): the number of micro-batches (default: ``1``)
        param_scale (float): parameter-sized tensors per parameter: 2 for the parameter
            and its gradient (default), 3 with SGD's momentum, 4 with Adam
        device ('cpu' or 'cuda' device): where to measure the layers (default: the
            current CUDA device)

    Returns:
        list of ints: the number of layers of each partition, the ``balance``

    Raises:
        TypeError: as for :func:`balance_by_time`
        ValueError: as for :func:`balance_by_time`, or ``chunks`` or ``param_scale`` is
            wrong, or ``input`` cannot be split into micro-batches

    Example::

        >>> model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
        >>> balance = balance_by_size(2, model, torch.rand(512, 64), chunks=8,
        ...                           param_scale=4.0, device='cpu')  # 4 for Adam
        >>> len(balance), sum(balance)
        (2, 3)
    """
    check_splittable(partitions, module)
    check(input)
    check_chunks(chunks)
    check_number('param_scale', param_scale,
                 'give the number of parameter-sized copies training keeps, such as '
                 'param_scale=4.0 for Adam')
    profile_device = profiling_device(device)
    check_materialized(module, [len(module)], [profile_device])
    # Fails before the long profiling.
    scatter(input, chunks)

    sizes = profile_sizes(module, input, chunks, param_scale, profile_device)
    return balance_cost(sizes, partitions)


def check_splittable(partitions: int, module: nn.Sequential) -> None:
    """Checks ``partitions``, and that ``module`` can be split into that many."""
    blockpartition.check_partitions(partitions)
    verify_module(module)
    if partitions > len(module):
        raise ValueError(describe('partitions must not exceed the number of layers, since every '
                                  'partition needs a layer',
                                  f'partitions: {partitions}, layers: {len(module)}',
                                  f'ask for at most {len(module)} partitions'))


def profiling_device(value: object) -> torch.device:
    """The device to profile on, checked; a bare ``'cuda'`` gets the current index."""
    device = parse_device('device', value, "use a device such as device='cpu' or device='cuda:0'")
    check_available('device', device, "profile on the CPU with device='cpu'")
    return indexed(device)

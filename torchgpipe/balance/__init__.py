"""Automatic balancing: a ``balance`` for :class:`~torchgpipe.GPipe` from profiling.

Each layer of an :class:`nn.Sequential <torch.nn.Sequential>` is profiled,
by time (:func:`balance_by_time`) or by memory (:func:`balance_by_size`), and
the costs are split into contiguous partitions by
:func:`torchgpipe.balance.blockpartition.solve`: the costliest partition is
as cheap as possible, since the slowest (or fullest) device decides the
pipeline's speed (or whether it fits), and among such splits the partitions
are as even as possible.

Example::

    from torchgpipe import GPipe
    from torchgpipe.balance import balance_by_time

    partitions = torch.cuda.device_count()
    sample = torch.empty(128, 3, 224, 224)
    balance = balance_by_time(partitions, model, sample)

    model = GPipe(model, balance, chunks=8)
"""
import math
import numbers
from typing import List, Optional, Union

import torch
from torch import nn

from torchgpipe import microbatch
from torchgpipe._validation import check_available, check_chunks, describe, parse_device
from torchgpipe.balance import blockpartition
from torchgpipe.balance.profile import profile_sizes, profile_times
from torchgpipe.gpipe import verify_module
from torchgpipe.microbatch import TensorOrTensors

__all__ = ['balance_by_time', 'balance_by_size']

Device = Union[torch.device, int, str]


def balance_cost(cost: List[int], partitions: int) -> List[int]:
    """The number of layers in each block of the optimal partition of the costs."""
    return [len(block) for block in blockpartition.solve(cost, partitions)]


def balance_by_time(partitions: int, module: nn.Sequential, sample: TensorOrTensors, *,
                    timeout: float = 1.0, device: Device = torch.device('cuda')) -> List[int]:
    """Naive automatic balancing by elapsed time per layer.

    Each layer runs its forward and backward passes on a copy of itself on
    ``device``, one layer after the other, starting from ``sample``. After a
    warm-up pass that is not counted (it pays for one-time initializations),
    whole passes are repeated until ``timeout`` seconds have passed since
    the start, at least one. The layers are then split so that the slowest
    partition is as fast as possible.

    ``module`` is left as it was: its device, parameters, buffers and
    training flag do not change, and no gradient is left behind. The random
    number generators are restored too. Layers made with :func:`@skippable
    <torchgpipe.skip.skippable>`, layers working in place, and tuples of
    tensors between layers are supported.

    Example::

        sample = torch.empty(128, 3, 224, 224)
        balance = balance_by_time(torch.cuda.device_count(), model, sample)
        gpipe = GPipe(model, balance, chunks=8)

    On CPU, profile there too:

        >>> model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU())
        >>> balance = balance_by_time(2, model, torch.rand(16, 8), timeout=0.1, device='cpu')
        >>> gpipe = GPipe(model, balance, devices=['cpu', 'cpu'], chunks=4)
        >>> sum(balance)
        4

    Args:
        partitions (int):
            intended number of partitions
        module (torch.nn.Sequential):
            sequential module to be partitioned
        sample (torch.Tensor or tuple of tensors):
            example input with arbitrary batch size

    Keyword Args:
        timeout (float):
            profiling iterates again if the timeout (in seconds) is not
            exceeded (default: ``1.0``)
        device ('cpu' or 'cuda' device):
            CPU or CUDA device where each layer is profiled (default: the
            current CUDA device)

    Returns:
        A list of number of layers in each partition. Use it for the
        ``balance`` parameter of :class:`~torchgpipe.GPipe`.

    Raises:
        TypeError: ``module`` is not an :class:`nn.Sequential
            <torch.nn.Sequential>`, ``sample`` is neither a tensor nor a
            tuple of tensors, or an argument has the wrong type
        ValueError: ``partitions`` is not positive or exceeds the number of
            layers, ``timeout`` is negative, ``device`` is not available, or
            a parameter already has a gradient (``'some parameter already has
            gradient'``)

    .. note::
        ``module`` and ``sample`` need not be on ``device``: the layers and
        the sample are copied there.
    """
    check_partitions(partitions, module)
    microbatch.check(sample, 'sample')
    check_real('timeout', timeout, 'give a time in seconds, such as timeout=1.0')
    profile_device = check_device(device)

    times = profile_times(module, sample, timeout, profile_device)
    return balance_cost(times, partitions)


def balance_by_size(partitions: int, module: nn.Sequential, input: TensorOrTensors, *,
                    chunks: int = 1, param_scale: float = 2.0,
                    device: Device = torch.device('cuda')) -> List[int]:
    """Naive automatic balancing by memory usage per layer.

    A layer's size is the memory its training needs on one device: the
    activations its forward pass keeps for one micro-batch (the first of
    ``chunks`` micro-batches of ``input``, the largest) plus ``param_scale``
    times its parameters' bytes. The layers are then split so that the
    fullest partition is as small as possible.

    On CUDA, the activations are measured by the caching allocator's
    statistics. On other devices (CPU), they are the bytes of the tensors
    autograd saves for the backward pass
    (:class:`torch.autograd.graph.saved_tensors_hooks`), together with the
    layer's outputs and stashed skip tensors, each storage counted once.

    ``module`` is left as it was: its device, parameters, buffers and
    training flag do not change, and no gradient is left behind. The random
    number generators are restored too.

    During training, the memory for parameters depends on the optimizer:
    besides the parameters (1×) and their gradients (1×), optimizers keep
    buffers of the same size per parameter to track statistics, such as the
    momentum buffer of SGD. The default ``param_scale`` is 2 instead of 1
    because of the gradients, which every optimizer needs. Choose
    ``param_scale`` for your optimizer with this guide:

    =======================  ===============  ==============================================
    Optimizer                ``param_scale``  Internal state kept per parameter
    =======================  ===============  ==============================================
    SGD                      2                none
    SGD with momentum        3                ``momentum_buffer``
    Adam, AdamW              4                ``exp_avg``, ``exp_avg_sq``
    Adam with ``amsgrad``    5                ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``
    Adadelta                 4                ``square_avg``, ``acc_delta``
    Adagrad                  3                ``sum``
    RMSprop                  3--5             ``square_avg``, (``momentum_buffer`` with
                                              ``momentum``), (``grad_avg`` if ``centered``)
    =======================  ===============  ==============================================

    Here's a simple example with the Adam optimizer::

        balance = balance_by_size(
            torch.cuda.device_count(),
            model,

            # Same size with mini-batch to train
            torch.empty(1024, 3, 224, 224),

            # Number of micro-batches to train with GPipe
            chunks=8,

            # 4 for Adam
            param_scale=4.0,
        )

        gpipe = GPipe(model, balance, chunks=8)
        adam = Adam(gpipe.parameters())

    Args:
        partitions (int):
            intended number of partitions
        module (torch.nn.Sequential):
            sequential module to be partitioned
        input (torch.Tensor or tuple of tensors):
            example mini-batch with the same size to train

    Keyword Args:
        chunks (int):
            number of micro-batches will be used to train (default: ``1``)
        param_scale (float):
            how many copies of parameters would be allocated for training.
            It depends on optimizer. See the above guide. (default: ``2.0``)
        device ('cpu' or 'cuda' device):
            device where each layer is profiled (default: the current CUDA
            device)

    Returns:
        A list of number of layers in each partition. Use it for the
        ``balance`` parameter of :class:`~torchgpipe.GPipe`.

    Raises:
        TypeError: ``module`` is not an :class:`nn.Sequential
            <torch.nn.Sequential>`, ``input`` is neither a tensor nor a
            tuple of tensors, or an argument has the wrong type
        ValueError: ``partitions`` is not positive or exceeds the number of
            layers, ``chunks`` is not a positive integer, ``param_scale`` is
            negative, ``input`` cannot be split into micro-batches (no
            tensor, no batch dimension, or sizes differing in dimension 0),
            ``device`` is not
            available, or a parameter already has a gradient (``'some
            parameter already has gradient'``)

    .. note::
        ``module`` and ``input`` need not be on ``device``: the layers and
        the micro-batch are copied there.
    """
    check_partitions(partitions, module)
    microbatch.check(input)
    check_chunks(chunks)
    check_real('param_scale', param_scale,
               'give the number of parameter-sized copies training keeps, such as '
               'param_scale=4.0 for Adam')
    profile_device = check_device(device)
    # Fails early, before profiling, if the input cannot be split.
    microbatch.scatter(input, chunks)

    sizes = profile_sizes(module, input, chunks, param_scale, profile_device)
    return balance_cost(sizes, partitions)


def check_partitions(partitions: int, module: nn.Sequential) -> None:
    """Checks the module and that it has enough layers for the partitions."""
    fix = 'give the number of devices to balance over, such as partitions=2'
    if isinstance(partitions, bool) or not isinstance(partitions, int):
        raise TypeError(describe('partitions must be an int',
                                 f'partitions: {partitions!r}', fix))
    if partitions < 1:
        raise ValueError(describe('partitions must be a positive integer',
                                  f'partitions: {partitions!r}', fix))
    verify_module(module)
    if partitions > len(module):
        raise ValueError(describe('partitions must not exceed the number of layers, since every '
                                  'partition needs a layer',
                                  f'partitions: {partitions}, layers: {len(module)}',
                                  f'ask for at most {len(module)} partitions'))


def check_real(name: str, value: object, fix: str) -> None:
    """Checks that ``value`` is a finite, non-negative real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(describe(f'{name} must be a real number', f'{name}: {value!r}', fix))
    if not math.isfinite(value) or value < 0:
        raise ValueError(describe(f'{name} must be finite and non-negative',
                                  f'{name}: {value!r}', fix))


def check_device(value: object) -> torch.device:
    """Resolves the device to profile on, and checks that it exists."""
    device = parse_device('device', value, "use a device such as device='cpu' or device='cuda:0'")
    check_available('device', device, "profile on the CPU with device='cpu'")
    # torch's stubs type the index as int, but a bare 'cuda' has none.
    index: Optional[int] = device.index
    if device.type == 'cuda' and index is None:
        device = torch.device('cuda', torch.cuda.current_device())
    return device

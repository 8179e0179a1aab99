"""The GPipe interface: partitioning a sequential module and running it as a pipeline."""
from collections import OrderedDict
from typing import Any, Iterable, Iterator, List, Optional, Tuple, Union, cast

import torch
from torch import Tensor, nn

from torchgpipe import microbatch
from torchgpipe.batchnorm import DeferredBatchNorm
from torchgpipe.microbatch import TensorOrTensors
from torchgpipe.pipeline import Pipeline
from torchgpipe.skip.layout import inspect_skip_layout
from torchgpipe.skip.skippable import verify_skippables
from torchgpipe.stream import AbstractStream, current_stream, new_stream, use_device
from torchgpipe.traits import RunState

__all__ = ['GPipe', 'BalanceError', 'verify_module', 'split_module']

Device = Union[torch.device, int, str]
Devices = Union[Iterable[Device], List[Device]]

MOVING_DENIED = TypeError('denied to move parameters and buffers, '
                          'because GPipe should manage device placement')


def recommend_auto_balance(message: str) -> str:
    """Expands a message with a recommendation to :mod:`torchgpipe.balance`."""
    return f'''{message}

If your model is still under development, its optimal balance would change
frequently. In this case, we highly recommend 'torchgpipe.balance' for naive
automatic balancing:

  from torchgpipe import GPipe
  from torchgpipe.balance import balance_by_time

  partitions = torch.cuda.device_count()
  sample = torch.empty(...)
  balance = balance_by_time(partitions, model, sample)

  model = GPipe(model, balance, ...)
'''


class BalanceError(ValueError):
    """The balance does not fit the module."""


def verify_module(module: nn.Sequential) -> None:
    """Checks that the module can be partitioned.

    Raises:
        TypeError: the module is not :class:`~torch.nn.Sequential`
        ValueError: a child appears twice, or a parameter is shared by two children
    """
    if not isinstance(module, nn.Sequential):
        raise TypeError('module must be nn.Sequential to be partitioned')

    named_children = list(module.named_children())
    if len(named_children) != len(module):
        raise ValueError('module with duplicate children is not supported')

    num_parameters = len(list(module.parameters()))
    num_child_parameters = sum(len(list(child.parameters())) for child in module.children())
    if num_parameters != num_child_parameters:
        raise ValueError('module with duplicate parameters in distinct children is not supported')


def split_module(module: nn.Sequential, balance: Iterable[int],
                 devices: List[torch.device],
                 ) -> Tuple[List[nn.Sequential], List[int], List[torch.device]]:
    """Splits a module into partitions by the balance, each moved to its device.

    Args:
        module (nn.Sequential): the module to split
        balance (ints): the number of layers of each partition
        devices (list of torch.device): the devices, one per partition at least

    Returns:
        (partitions, balance, devices): the partitions (with the children's
        original names), the balance as a list, and the devices in use

    Raises:
        BalanceError: the balance does not sum to the number of layers, or
            has a non-positive entry
        IndexError: fewer devices than partitions
    """
    balance = list(balance)

    if len(module) != sum(balance):
        raise BalanceError('module and sum of balance have different length '
                           f'(module: {len(module)}, sum of balance: {sum(balance)})')
    if any(x <= 0 for x in balance):
        raise BalanceError(f'all balance numbers must be positive integer (balance: {balance})')
    if len(balance) > len(devices):
        raise IndexError('too few devices to hold given partitions '
                         f'(devices: {len(devices)}, partitions: {len(balance)})')

    children = iter(module.named_children())
    partitions = []
    for size, device in zip(balance, devices):
        layers: 'OrderedDict[str, nn.Module]' = OrderedDict(next(children) for _ in range(size))
        partition = nn.Sequential(layers)
        partition.to(device)
        partitions.append(partition)

    return partitions, balance, devices[:len(balance)]


class GPipe(nn.Module):
    """Wraps an arbitrary :class:`nn.Sequential <torch.nn.Sequential>` module
    to train on GPipe_. If the module requires lots of memory, GPipe will be
    very efficient.

    .. _GPipe: https://arxiv.org/abs/1811.06965

    GPipe combines pipeline parallelism with checkpointing to reduce peak
    memory required to train while minimizing device under-utilization.

    You should determine the balance when defining a GPipe module, as
    balancing will not be done automatically. The module will be partitioned
    into multiple devices according to the given balance.

    GPipe does not change the input and output signature of the module, with
    one restriction: input and output, also at every partition boundary, have
    to be a tensor or a tuple of tensors.

    Args:
        module (torch.nn.Sequential): sequential module to be parallelized
        balance (ints): list of number of layers in each partition

    Keyword Args:
        devices (iterable of devices): devices to use, as ``torch.device``,
            strings or CUDA indices (default: all CUDA devices)
        chunks (int): number of micro-batches (default: ``1``)
        checkpoint (str): when to enable checkpointing, one of ``'always'``,
            ``'except_last'``, or ``'never'`` (default: ``'except_last'``)
        deferred_batch_norm (bool): whether to use deferred BatchNorm moving
            statistics (default: ``False``)

    Raises:
        TypeError: the module is not a :class:`nn.Sequential <torch.nn.Sequential>`.
        ValueError: invalid arguments, or wrong balance
        IndexError: the number of devices is fewer than the number of
            partitions.

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> model = GPipe(model, balance=[2, 1], devices=['cpu', 'cpu'], chunks=4)
        >>> model(torch.rand(8, 4)).shape
        torch.Size([8, 2])
    """

    #: The number of layers in each partition.
    balance: List[int]

    #: The devices mapped to each partition.
    #:
    #: ``devices[-1]`` refers to the device of the last partition, which means
    #: it is the output device. Probably, you need to use it to transfer the
    #: target to calculate the loss without a device mismatch
    #: :exc:`RuntimeError`. For example::
    #:
    #:     out_device = gpipe.devices[-1]
    #:
    #:     for input, target in loader:
    #:         target = target.to(out_device, non_blocking=True)
    #:         output = gpipe(input)
    #:         loss = F.cross_entropy(output, target)
    #:
    devices: List[torch.device]

    #: The number of micro-batches.
    chunks: int = 1

    #: The checkpoint mode to determine when to enable checkpointing. It is one
    #: of ``'always'``, ``'except_last'``, or ``'never'``.
    checkpoint: str = 'except_last'

    def __init__(self, module: nn.Sequential, balance: Optional[Iterable[int]] = None, *,
                 devices: Optional[Devices] = None, chunks: int = chunks,
                 checkpoint: str = checkpoint, deferred_batch_norm: bool = False) -> None:
        super().__init__()

        if balance is None:
            raise ValueError(recommend_auto_balance('balance is required'))
        if not isinstance(chunks, int) or isinstance(chunks, bool) or chunks <= 0:
            raise ValueError(f'number of chunks must be positive integer (chunks: {chunks!r})')
        if checkpoint not in ('always', 'except_last', 'never'):
            raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")

        verify_module(module)
        # Every skip must be stashed and popped exactly once, in this order.
        verify_skippables(module)

        self.chunks = chunks
        self.checkpoint = checkpoint

        if deferred_batch_norm:
            module = cast(nn.Sequential,
                          DeferredBatchNorm.convert_deferred_batch_norm(module, chunks))

        if devices is None:
            devices = range(torch.cuda.device_count())
        device_list = [torch.device(d) for d in devices]

        try:
            partitions, self.balance, self.devices = split_module(module, balance, device_list)
        except BalanceError as exc:
            raise ValueError(recommend_auto_balance(str(exc))) from None

        self.partitions = nn.ModuleList(partitions)
        self._skip_layout = inspect_skip_layout(partitions)
        self._deferred_batch_norms = [m for m in self.partitions.modules()
                                      if isinstance(m, DeferredBatchNorm)]

        # Copy streams and what runs learn about the partitions: never part
        # of a copy of this module.
        self._run_state = RunState(len(self.partitions))

    def _partitions(self) -> List[nn.Sequential]:
        return cast(List[nn.Sequential], list(self.partitions))

    def __len__(self) -> int:
        """Counts the length of the underlying sequential module."""
        return sum(len(p) for p in self._partitions())

    def __getitem__(self, index: int) -> nn.Module:
        """Gets a layer in the underlying sequential module (negative indices too).

        Raises:
            IndexError: the index is out of range
        """
        layers = list(self)
        if not -len(layers) <= index < len(layers):
            raise IndexError(f'index {index} is out of range for {len(layers)} layers')
        return layers[index]

    def __iter__(self) -> Iterator[nn.Module]:
        """Iterates over children of the underlying sequential module."""
        for partition in self._partitions():
            yield from partition

    # GPipe owns device placement: moving the whole module would break it.

    def cuda(self, device: Optional[Union[int, torch.device]] = None) -> 'GPipe':
        raise MOVING_DENIED

    def cpu(self) -> 'GPipe':
        raise MOVING_DENIED

    def to(self, *args: Any, **kwargs: Any) -> 'GPipe':
        """Casts parameters and buffers, as :meth:`torch.nn.Module.to`, but never moves them.

        Raises:
            TypeError: a device is given; GPipe manages device placement
        """
        # Deny these usages:
        #
        # - to(device[, dtype, non_blocking])
        # - to(tensor[, non_blocking])
        #
        # But allow this:
        #
        # - to(dtype[, non_blocking])
        #
        if 'device' in kwargs or 'tensor' in kwargs:
            raise MOVING_DENIED
        if args:
            if isinstance(args[0], (torch.device, int, str)):
                raise MOVING_DENIED
            if torch.is_tensor(args[0]):
                raise MOVING_DENIED
        return super().to(*args, **kwargs)

    def _ensure_copy_streams(self) -> List[List[AbstractStream]]:
        """Creates a copy stream per device per micro-batch, once."""
        copy_streams = self._run_state.copy_streams
        if not copy_streams:
            for device in self.devices:
                copy_streams.append([new_stream(device) for _ in range(self.chunks)])
        return copy_streams

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """:class:`GPipe` is a fairly transparent module wrapper. It doesn't
        modify the input and output signature of the underlying module. But
        there's type restriction. Input and output have to be a
        :class:`~torch.Tensor` or a tuple of tensors. This restriction is
        applied at partition boundaries too.

        An input that is not on the first partition's device is moved there.

        Args:
            input (torch.Tensor or tensors): input mini-batch

        Returns:
            tensor or tensors: output mini-batch, on ``devices[-1]``

        Raises:
            TypeError: input is not a tensor or tensors.
        """
        microbatch.check(input)

        if not self.devices:
            # An empty sequential module is the identity.
            return input

        input = _to_device(input, self.devices[0])
        batches = microbatch.scatter(input, self.chunks)

        # Checkpointing only pays off when there is a backward pass to come.
        m = len(batches)
        # A short batch splits into fewer micro-batches than chunks: deferred
        # BatchNorm must commit its statistics after this many.
        for layer in self._deferred_batch_norms:
            layer.chunks = m

        if self.training and torch.is_grad_enabled():
            checkpoint_stop = {'always': m, 'except_last': m - 1, 'never': 0}[self.checkpoint]
        else:
            checkpoint_stop = 0

        streams = [current_stream(d) for d in self.devices]
        with use_device(self.devices[0]):
            copy_streams = self._ensure_copy_streams()
        pipeline = Pipeline(batches, self._partitions(), self.devices, copy_streams, streams,
                            self._skip_layout, checkpoint_stop, self._run_state.traits)
        pipeline.run()

        return microbatch.gather(batches)


def _to_device(input: TensorOrTensors, device: torch.device) -> TensorOrTensors:
    """Moves the input to the device (a differentiable copy where needed)."""
    if isinstance(input, Tensor):
        return input.to(device)
    return tuple(x.to(device) for x in input)

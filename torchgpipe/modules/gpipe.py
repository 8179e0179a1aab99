"""The GPipe interface: partitioning a sequential module and running it as a pipeline."""
import copy
from collections import OrderedDict
from typing import Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union, cast

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from torchgpipe.engine.core import Core
from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.validation import (BalanceError, Device, Devices, check_available,
                                              check_balance, check_devices, deny_moving,
                                              describe, example_balance, parse_device,
                                              recommend_auto_balance, verify_module)
from torchgpipe.modules.base import CoreModule
from torchgpipe.runtime.batchnorm import restore_batch_norm
from torchgpipe.runtime.partition import split_module

__all__ = ['GPipe', 'BalanceError', 'verify_module', 'split_module']


class GPipe(CoreModule):
    """Trains an :class:`nn.Sequential <torch.nn.Sequential>` as a pipeline over
    several devices, with the results of the unwrapped module (GPipe_).

    .. _GPipe: https://arxiv.org/abs/1811.06965

    Partition ``j`` holds the next ``balance[j]`` children, moved in place to
    ``devices[j]``; each mini-batch flows through them as ``chunks`` micro-batches, a
    clock cycle apart, a tensor or a tuple of tensors at every boundary.

    Args:
        module (torch.nn.Sequential): sequential module to be parallelized
        balance (ints): list of number of layers in each partition

    Keyword Args:
        devices (iterable of devices): devices to use, as ``torch.device``,
            strings or CUDA indices (default: all CUDA devices)
        chunks (int): number of micro-batches (default: ``1``)
        checkpoint (str): when to checkpoint: ``'always'``, ``'except_last'`` (default) or
            ``'never'``
        deferred_batch_norm (bool): whether to use deferred BatchNorm moving statistics
            (default: ``False``)
        planned_threads (int, optional): the intra-op threads :func:`torchgpipe.plan`
            measured with; the first step warns if they differ (default: no check)

    Raises:
        TypeError: the module is not an ``nn.Sequential``, or an argument's type is wrong
        ValueError: a wrong value (:doc:`troubleshooting`): a balance that does not fit
            (see :mod:`torchgpipe.balance`), a missing CUDA device, a meta tensor, or a
            buffer in two partitions (tied parameters are fine: :ref:`guide-tied-weights`)
        IndexError: fewer devices than partitions

    Example::

        >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> model = GPipe(model, balance=[2, 1], devices=['cpu', 'cpu'], chunks=4)
        >>> model(torch.rand(8, 4)).shape
        torch.Size([8, 2])
    """

    #: The number of layers in each partition.
    balance: List[int]
    #: The device of each partition. The output is on ``devices[-1]``, where the
    #: target goes: ``F.cross_entropy(output, target.to(gpipe.devices[-1]))``.
    devices: List[torch.device]

    def __init__(self, module: nn.Sequential, balance: Optional[Iterable[int]] = None, *,
                 devices: Optional[Devices] = None, chunks: int = 1,
                 checkpoint: str = 'except_last', deferred_batch_norm: bool = False,
                 planned_threads: Optional[int] = None) -> None:
        super().__init__()

        def locate(balance: Optional[Iterable[int]]) -> Tuple[List[int], List[torch.device]]:
            if balance is None:
                raise ValueError(recommend_auto_balance(describe(
                    'balance is required', 'balance: None',
                    f'give the number of layers of each partition, such as '
                    f'balance={example_balance(len(module))}')))
            try:
                balance = check_balance(module, balance)
            except BalanceError as exc:
                raise ValueError(recommend_auto_balance(str(exc))) from None
            self.devices = check_devices(devices, len(balance))[:len(balance)]
            return balance, self.devices
        partitions, _, settings = self.build(module, balance, chunks, checkpoint,
                                             deferred_batch_norm, planned_threads, locate)
        self.partitions = nn.ModuleList(partitions)
        #: The pipeline of every partition, in this process.
        self.core = Core(dict(enumerate(partitions)), self.devices, *settings)

    def __len__(self) -> int:
        """Counts the length of the underlying sequential module."""
        return sum(len(p) for p in self.core.partitions.values())

    def __getitem__(self, index: int) -> nn.Module:
        """Gets a layer of the underlying sequential module; ``IndexError`` past the end."""
        layers = list(self)
        if not -len(layers) <= index < len(layers):
            raise IndexError(f'index {index} is out of range for {len(layers)} layers')
        return layers[index]

    def __iter__(self) -> Iterator[nn.Module]:
        """Iterates over children of the underlying sequential module."""
        for partition in self.core.partitions.values():
            yield from partition

    # GPipe owns device placement: moving the whole module would break it.

    def cuda(self, device: Optional[Union[int, torch.device]] = None) -> 'GPipe':
        raise deny_moving()

    def cpu(self) -> 'GPipe':
        raise deny_moving()

    def to(self, *args: Any, **kwargs: Any) -> 'GPipe':
        """Casts parameters and buffers, as :meth:`torch.nn.Module.to`; a device or a
        tensor to move to is a ``TypeError``, as GPipe places the partitions."""
        # to(device, ...) and to(tensor, ...) would move; to(dtype, ...) only casts.
        if 'device' in kwargs or 'tensor' in kwargs or args and (
                isinstance(args[0], (torch.device, int, str)) or torch.is_tensor(args[0])):
            raise deny_moving()
        return super().to(*args, **kwargs)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False,
                        foreach: Optional[bool] = None) -> torch.Tensor:
        """Clips the gradients of every partition by their norm together, as
        :func:`torch.nn.utils.clip_grad_norm_` clips the unwrapped module's.

        Args:
            max_norm (float): the largest norm the gradients keep
            norm_type, error_if_nonfinite, foreach: as for ``clip_grad_norm_``

        Returns:
            torch.Tensor: the norm of all the gradients before clipping

        Raises:
            RuntimeError: with ``error_if_nonfinite``, the norm is not finite

        Example::

            >>> model = GPipe(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)),
            ...               balance=[2, 1], devices=['cpu', 'cpu'], chunks=4)
            >>> loss = model.train_step(torch.randn(16, 4), torch.randn(16, 2), F.mse_loss)
            >>> norm = model.clip_grad_norm_(max_norm=0.1)    # the norm before clipping
        """
        return torch.nn.utils.clip_grad_norm_(self.parameters(), max_norm, norm_type,
                                              error_if_nonfinite, foreach)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> _IncompatibleKeys:
        """As :meth:`torch.nn.Module.load_state_dict`, with the keys of either GPipe
        (``partitions.<j>.<child name>.<name>``, as in 0.0.7) or the unwrapped module
        (``<child name>.<name>``); a plain BatchNorm's state loads into its deferred one.

        Args:
            state_dict (dict): the state, in either style
            strict, assign: as for :meth:`torch.nn.Module.load_state_dict`

        Returns:
            ``NamedTuple`` with ``missing_keys`` and ``unexpected_keys``, in the style given

        Raises:
            RuntimeError: with ``strict=True``, a key is missing or unexpected; or a
                tensor has the wrong shape

        Example::

            >>> def make_model():
            ...     return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
            >>> trained = make_model()  # trained without GPipe
            >>> gpipe = GPipe(make_model(), balance=[2, 1], devices=['cpu', 'cpu'])
            >>> gpipe.load_state_dict(trained.state_dict())
            <All keys matched successfully>
            >>> list(gpipe.state_dict())[0]
            'partitions.0.0.weight'
        """
        # The child names are unique across partitions: each names its partition.
        partition_of = {name: j for j, partition in enumerate(self.core.partitions.values())
                        for name in partition._modules}

        def in_gpipe_style(key: str) -> Optional[str]:
            # The module path of metadata keys has no parameter name: '0'.
            child = key.split('.', 1)[0]
            return f'partitions.{partition_of[child]}.{key}' if child in partition_of else None

        def is_own(key: str) -> bool:
            parts = key.split('.', 3)
            return (len(parts) > 2 and parts[0] == 'partitions'
                    and str(partition_of.get(parts[2])) == parts[1])

        if any(map(is_own, state_dict)) or not any(map(in_gpipe_style, state_dict)):
            return cast(_IncompatibleKeys, super().load_state_dict(state_dict, strict, assign))

        # Keys of no child stay as they are, to be reported unexpected.
        renamed = {key: in_gpipe_style(key) or key for key in state_dict}
        translated: Any = OrderedDict((renamed[key], value) for key, value in state_dict.items())
        metadata = getattr(state_dict, '_metadata', None)
        if metadata is not None:
            # The versions of the layers, which BatchNorm's loading reads.
            translated._metadata = OrderedDict(
                (in_gpipe_style(path) or path, value) for path, value in metadata.items())
        given = {new: old for old, new in renamed.items()}

        def report_in_given_style(_: nn.Module, keys: _IncompatibleKeys) -> None:
            # Every missing key is one of ours: 'partitions.<j>.<child name>...'.
            keys.missing_keys[:] = [key.split('.', 2)[2] for key in keys.missing_keys]
            keys.unexpected_keys[:] = [given.get(key, key) for key in keys.unexpected_keys]

        hook = self.register_load_state_dict_post_hook(  # type: ignore[no-untyped-call]
            report_in_given_style)
        try:
            return cast(_IncompatibleKeys, super().load_state_dict(translated, strict, assign))
        finally:
            hook.remove()

    def unwrap(self, device: Optional[Device] = None) -> nn.Sequential:
        """The plain :class:`nn.Sequential <torch.nn.Sequential>` this GPipe trains, on
        one device, for use without torchgpipe: deep copies of the layers under their names
        and in their modes, deferred BatchNorm layers back as the class they replaced.

        Args:
            device (torch.device, str or int, optional): its device (default: the CPU)

        Raises:
            TypeError: ``device`` is not a device
            ValueError: ``device`` is a CUDA device that does not exist here

        Example::

            >>> def make_model():
            ...     return nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
            >>> gpipe = GPipe(make_model(), balance=[1, 1], devices=['cpu', 'cpu'],
            ...               chunks=2, deferred_batch_norm=True)
            >>> gpipe(torch.rand(8, 4)).sum().backward()  # training
            >>> model = gpipe.unwrap('cpu')
            >>> type(model[1]).__name__
            'BatchNorm1d'
            >>> make_model().load_state_dict(model.state_dict())
            <All keys matched successfully>
        """
        if device is None:
            target = torch.device('cpu')
        else:
            target = parse_device('device', device,
                                  "use a device such as device='cpu' or device='cuda:0'")
            check_available('device', target, "unwrap on the CPU with device='cpu'")

        # One memo for all layers keeps what they share shared.
        memo: Dict[int, Any] = {}
        layers: 'OrderedDict[str, nn.Module]' = OrderedDict()
        for partition in self.core.partitions.values():
            for name, layer in partition.named_children():
                # One layer's copy at a time on its device; one memo keeps ties tied.
                layers[name] = copy.deepcopy(layer, memo).to(target)

        module = nn.Sequential(layers)
        # Not train(): each layer keeps its own mode.
        module.training = self.training
        return cast(nn.Sequential, restore_batch_norm(module))

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Runs a mini-batch through the pipeline, split along dimension 0 into
        micro-batches (moved to the first device), gathered back into one.

        Args:
            input (torch.Tensor or tuple): a tensor, or a tuple of tensors that may also
                hold ``None``, numbers, strings and :class:`~torchgpipe.NoChunk`
                tensors, which every micro-batch gets as is

        Returns:
            tensor or tuple: the output mini-batch, on ``devices[-1]`` (its non-tensor
            values and NoChunk tensors, unwrapped, are the first micro-batch's)

        Raises:
            TypeError: input is not a tensor or such a tuple
            ValueError: input cannot be split into micro-batches
        """
        microbatch.check(input)
        if not self.devices:
            # The identity, as in 0.0.7: nothing is split (NoChunk unwrapped).
            return microbatch.Batch(input).plain
        # Split first: an input that cannot be split fails before any work.
        batches = microbatch.scatter(input, self.chunks)
        self.core.forward(batches, self.training)
        return microbatch.gather(batches)

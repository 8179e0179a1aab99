"""Deferred batch normalization: running statistics of the whole mini-batch.

Inside GPipe a BatchNorm layer would take ``chunks`` noisy momentum steps
per step. :class:`DeferredBatchNorm` normalizes each micro-batch as
``nn.BatchNorm`` does but commits the statistics once per mini-batch; a
recomputation counts nothing, and a failed step commits nothing
(``deferred_step``).
"""
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Type

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.lazy import LazyModuleMixin

from torchgpipe.foundation.phase import is_recomputing
from torchgpipe.foundation.validation import check_chunks, describe

__all__ = ['DeferredBatchNorm']


class DeferredBatchNorm(_BatchNorm):
    """A BatchNorm layer that commits its running statistics once per mini-batch.

    In training (with ``track_running_stats=True``), every call normalizes its
    input by its own statistics and accumulates them; after ``chunks`` calls,
    the running statistics are updated once, to what ``nn.BatchNorm`` would
    hold after one call on the concatenated inputs. Recomputations are not
    counted. Otherwise it is ``nn.BatchNorm``. Inputs are 2D to 5D,
    ``(N, C, *)``. :class:`~torchgpipe.GPipe` with ``deferred_batch_norm=True``
    makes them (:meth:`convert_deferred_batch_norm`).

    Args:
        num_features (int): number of channels ``C``
        eps (float): added to the denominator for numerical stability (default: ``1e-5``)
        momentum (float or None): factor of the exponential moving average, or
            ``None`` for a cumulative average (default: ``0.1``)
        affine (bool): whether to have learnable affine parameters (default: ``True``)
        chunks (int): training calls per commit (default: ``1``)

    Keyword Args:
        track_running_stats (bool): whether to track running statistics (default: ``True``)
        bias (bool): whether the affine transformation has a bias (default: ``True``)
        device (torch.device, optional): device of the parameters and buffers
        dtype (torch.dtype, optional): dtype of the parameters and buffers

    Raises:
        TypeError: ``chunks`` is not a number.
        ValueError: ``chunks`` is not a positive integer.
    """

    # Accumulated over a mini-batch; attributes, not buffers: half() must keep them
    # float64 and DDP must not broadcast them. The state dict shows them, as 0.0.7's.
    sum: Optional[Tensor]
    sum_squares: Optional[Tensor]
    count: int
    counter: int

    #: The class of the BatchNorm layer this one replaced, restored by
    #: :func:`restore_batch_norm`; ``None`` for a layer made directly.
    replaced_class: Optional[Type[_BatchNorm]] = None

    #: Whether GPipe (``deferred_step``) commits the statistics at the end of a
    #: step, rather than the layer itself after ``chunks`` micro-batches.
    held: bool = False

    def __init__(self,
                 num_features: int,
                 eps: float = 1e-5,
                 momentum: Optional[float] = 0.1,
                 affine: bool = True,
                 chunks: int = 1,
                 *,
                 track_running_stats: bool = True,
                 bias: bool = True,
                 device: Optional[torch.device] = None,
                 dtype: Optional[torch.dtype] = None,
                 ) -> None:
        chunks = check_chunks(chunks)

        super().__init__(num_features, eps, momentum, affine, track_running_stats,
                         device=device, dtype=dtype)
        if affine and not bias:
            # Older PyTorch has no ``bias`` argument on BatchNorm.
            self.register_parameter('bias', None)

        self.chunks = chunks
        self._reset_accumulators()

    def extra_repr(self) -> str:
        # nn.BatchNorm's fields, plus chunks (super's is untyped).
        return (f'{self.num_features}, eps={self.eps}, momentum={self.momentum}, '
                f'affine={self.affine}, track_running_stats={self.track_running_stats}, '
                f'chunks={self.chunks}')

    def _check_input_dim(self, input: Tensor) -> None:
        # Stands in for BatchNorm1d (2D/3D), BatchNorm2d (4D) and BatchNorm3d (5D).
        if not 2 <= input.dim() <= 5:
            raise ValueError(f'expected 2D, 3D, 4D or 5D input (got {input.dim()}D input)')

    def _reset_accumulators(self) -> None:
        self.sum = None
        self.sum_squares = None
        self.count = 0
        self.counter = 0

    def _save_to_state_dict(self, destination: Dict[str, Any], prefix: str,
                            keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.running_mean is None:
            return
        # 0.0.7's state dicts have the sums as buffers, zeros between mini-batches.
        for name, value in (('sum', self.sum), ('sum_squares', self.sum_squares)):
            if value is None:
                destination[prefix + name] = torch.zeros_like(self.running_mean)
            else:
                destination[prefix + name] = value.to(self.running_mean.dtype)

    def _load_from_state_dict(self, state_dict: Dict[str, Any], prefix: str,
                              local_metadata: Dict[str, Any], strict: bool,
                              missing_keys: List[str], unexpected_keys: List[str],
                              error_msgs: List[str]) -> None:
        # The sums are optional and unused: 0.0.7's state dicts have them, a plain
        # BatchNorm's has not, and both load strictly.
        if self.running_mean is not None:
            state_dict.pop(prefix + 'sum', None)
            state_dict.pop(prefix + 'sum_squares', None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)

    def _accumulate(self, input: Tensor, mean: Tensor, unbiased_var: Tensor) -> None:
        """Adds one micro-batch's statistics, ``mean`` and ``unbiased_var`` as the kernel computed
        them, to the accumulators."""
        self.counter += 1
        count = input.numel() // input.size(1)
        if count == 0:
            # Counted as a call, as nn.BatchNorm counts an empty batch, but no values.
            return

        with torch.no_grad():
            # The kernel's mean is rounded to the input precision, an error that
            # does not cancel between micro-batches (|mean| >> std): recover the
            # lost digits from the small residuals.
            shift = mean.to(input.dtype)
            shape = [1, -1] + [1] * (input.dim() - 2)
            dims = [0] + list(range(2, input.dim()))
            residual = (input.detach() - shift.view(shape)).sum(dims)
            exact_mean = shift.to(torch.float64) + residual.to(torch.float64) / count

            biased_var = unbiased_var.to(torch.float64) * ((count - 1) / count)

            # float64: sum_squares/n - mean**2 at the commit, free of cancellation.
            batch_sum = exact_mean * count
            batch_sum_squares = (biased_var + exact_mean * exact_mean) * count

        if self.sum is None or self.sum_squares is None:
            self.sum = batch_sum
            self.sum_squares = batch_sum_squares
        else:
            # .to() is a no-op unless the module moved in mid-mini-batch.
            self.sum = self.sum.to(batch_sum.device) + batch_sum
            self.sum_squares = self.sum_squares.to(batch_sum.device) + batch_sum_squares
        self.count += count

    def _commit(self) -> None:
        """Updates the running statistics once for the whole mini-batch."""
        assert self.running_mean is not None and self.running_var is not None

        # As nn.BatchNorm.forward chooses it.
        factor = 0.0 if self.momentum is None else self.momentum
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                factor = 1.0 / float(self.num_batches_tracked)

        # No sum: every micro-batch was empty; count the batch, keep the statistics.
        if self.sum is not None and self.sum_squares is not None:
            count = self.count
            mean = self.sum / count
            # Rounding can make a zero variance slightly negative.
            biased_var = (self.sum_squares / count - mean * mean).clamp_(min=0)
            # count > 1: F.batch_norm refuses one value per channel.
            unbiased_var = biased_var * (count / (count - 1))

            running_mean = self.running_mean.to(torch.float64)
            running_var = self.running_var.to(torch.float64)
            self.running_mean.copy_(factor * mean + (1.0 - factor) * running_mean)
            self.running_var.copy_(factor * unbiased_var + (1.0 - factor) * running_var)

        self._reset_accumulators()

    def forward(self, input: Tensor) -> Tensor:
        """Normalizes ``input``, a micro-batch ``(N, C, *)``, and in training accumulates its
        statistics.

        Raises:
            ValueError: ``input`` is not 2D to 5D, or has only one value per
                channel in training mode.
        """
        if not (self.training and self.track_running_stats):
            # Nothing to defer: nn.BatchNorm's own logic is the reference.
            return super().forward(input)

        self._check_input_dim(input)

        if is_recomputing():
            # These samples were counted by the first pass already.
            return F.batch_norm(input, None, None, self.weight, self.bias,
                                True, 0.0, self.eps)

        assert self.running_mean is not None
        # With momentum=1 the kernel writes the micro-batch's mean and unbiased
        # variance into these scratch "running" statistics: no second pass.
        mean = torch.zeros_like(self.running_mean)
        unbiased_var = torch.zeros_like(self.running_mean)
        output = F.batch_norm(input, mean, unbiased_var, self.weight, self.bias,
                              True, 1.0, self.eps)

        self._accumulate(input, mean, unbiased_var)
        if self.counter == self.chunks and not self.held:
            self._commit()

        return output

    @classmethod
    def convert_deferred_batch_norm(cls, module: nn.Module, chunks: int = 1) -> nn.Module:
        """Replaces every BatchNorm layer in ``module`` with :class:`DeferredBatchNorm`, in place.

        Each replacement shares its layer's parameters and running statistics, with
        the same ``eps``, ``momentum``, ``affine`` and mode. A layer already
        deferred over ``chunks``, or without running statistics, stays; one
        deferred over other ``chunks`` is replaced, as in torchgpipe 0.0.7.

        Args:
            module (nn.Module): the module to convert (a BatchNorm layer itself is
                replaced by a new module, returned)
            chunks (int): number of micro-batches per mini-batch (default: ``1``)

        Returns:
            nn.Module: ``module``, or its replacement

        Raises:
            TypeError: ``chunks`` is not a number.
            ValueError: ``chunks`` is not a positive integer, or a lazy BatchNorm
                layer is not initialized yet; ``module`` is then left as it was.

        Example::

            >>> model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU())
            >>> model = DeferredBatchNorm.convert_deferred_batch_norm(model, chunks=4)
            >>> model[1].chunks
            4
            >>> type(model[1]).__name__
            'DeferredBatchNorm'
            >>> DeferredBatchNorm.convert_deferred_batch_norm(model[1], chunks=4) is model[1]
            True
            >>> DeferredBatchNorm.convert_deferred_batch_norm(model[1], chunks=8).chunks
            8
        """
        chunks = check_chunks(chunks)
        # Checked before any replacement: a failure leaves ``module`` as it was.
        for name, layer in module.named_modules():
            if (isinstance(layer, _BatchNorm) and isinstance(layer, LazyModuleMixin)
                    and layer.has_uninitialized_params()):
                path = f'module.{name}' if name else 'module'
                raise ValueError(describe('cannot convert a lazy BatchNorm layer before its first '
                                          'forward has inferred num_features',
                                          f'{path}: {type(layer).__name__}',
                                          'run one forward pass first, such as model(sample)'))
        return replace_layers(module, lambda layer: cls._from_batch_norm(layer, chunks))

    @classmethod
    def _from_batch_norm(cls, layer: nn.Module, chunks: int) -> Optional['DeferredBatchNorm']:
        """The deferred replacement of a BatchNorm layer; ``None``: nothing to replace."""
        if not isinstance(layer, _BatchNorm) or not layer.track_running_stats:
            return None
        if isinstance(layer, DeferredBatchNorm) and layer.chunks == chunks:
            return None
        # On the meta device: share_state replaces every tensor.
        deferred = cls(layer.num_features, layer.eps, layer.momentum, layer.affine, chunks,
                       device=torch.device('meta'))
        share_state(layer, deferred)
        # The original class, for restore_batch_norm.
        deferred.replaced_class = (layer.replaced_class if isinstance(layer, DeferredBatchNorm)
                                   else type(layer))
        return deferred


@contextmanager
def deferred_step(layers: Sequence[DeferredBatchNorm], chunks: int) -> Iterator[None]:
    """Runs a step of ``chunks`` micro-batches; the layers commit their statistics once
    at its end, or drop them if it ends by an exception (``KeyboardInterrupt`` too)."""
    for layer in layers:
        # Leftovers of a call outside a step would mix into this one.
        layer._reset_accumulators()
        layer.chunks = chunks
        layer.held = True
    try:
        yield
    except BaseException:
        for layer in layers:
            layer._reset_accumulators()
        raise
    finally:
        for layer in layers:
            layer.held = False
    for layer in layers:
        if layer.counter:
            layer._commit()


def restore_batch_norm(module: nn.Module) -> nn.Module:
    """Turns every :class:`DeferredBatchNorm` that
    :meth:`~DeferredBatchNorm.convert_deferred_batch_norm` made in ``module`` back into the
    layer it replaced (same tensors), in place; returns ``module`` or its replacement."""
    def restore(layer: nn.Module) -> Optional[nn.Module]:
        if not isinstance(layer, DeferredBatchNorm) or layer.replaced_class is None:
            return None
        restored = layer.replaced_class(layer.num_features, layer.eps, layer.momentum,
                                        layer.affine, device=torch.device('meta'))
        share_state(layer, restored)
        return restored

    return replace_layers(module, restore)


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

"""Micro-batches: splitting a mini-batch, carrying the pieces, and gathering them.

A mini-batch is a tensor or a tuple of tensors. :func:`scatter` splits it along
dimension 0 into micro-batches (:class:`Batch`), the pipeline runs each of
them through every partition, and :func:`gather` concatenates the outputs.
"""
from typing import Callable, Iterator, List, Optional, Sequence, Tuple, Union, cast, overload

import torch
from torch import Tensor

from torchgpipe._validation import describe

__all__: List[str] = []

Tensors = Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]

Function = Callable[[TensorOrTensors], TensorOrTensors]


class Batch:
    """One micro-batch: a tensor (atomic) or a tuple of tensors.

    It behaves like a sequence of tensors in both cases, so the pipeline can
    copy, wait on and fork every tensor without caring which it is, while
    :meth:`call` hands a layer the value in its original form.

    Example::

        >>> batch = Batch(torch.zeros(2, 3))
        >>> batch.atomic, len(batch)
        (True, 1)
        >>> batch[0] = torch.ones(2, 3)
        >>> batch.tensor.sum().item()
        6.0
    """

    __slots__ = ('_values', 'atomic')

    def __init__(self, values: TensorOrTensors) -> None:
        self._values = values
        self.atomic = isinstance(values, Tensor)

    @property
    def tensor(self) -> Tensor:
        """The tensor of an atomic batch.

        Raises:
            AttributeError: the batch is a tuple; use :attr:`tensors`
        """
        if not self.atomic:
            raise AttributeError('not atomic batch')
        return cast(Tensor, self._values)

    @property
    def tensors(self) -> Tensors:
        """The tensors of a non-atomic batch.

        Raises:
            AttributeError: the batch is a single tensor; use :attr:`tensor`
        """
        if self.atomic:
            raise AttributeError('batch is atomic')
        return cast(Tensors, self._values)

    @property
    def values(self) -> TensorOrTensors:
        """The tensor or the tuple of tensors, in the form a layer receives it."""
        return self._values

    def call(self, function: Function) -> 'Batch':
        """Calls ``function`` on the value, as a layer is called, and wraps the result.

        Args:
            function (callable): takes and returns a tensor or a tuple of
                tensors

        Returns:
            Batch: a new batch holding what ``function`` returned
        """
        return Batch(function(self._values))

    def find(self, predicate: Callable[[Tensor], bool]) -> Optional[int]:
        """Returns the index of the first tensor satisfying ``predicate``, or ``None``."""
        return next((i for i, x in enumerate(self) if predicate(x)), None)

    def __repr__(self) -> str:
        return f'Batch[atomic={self.atomic!r}]({self._values!r})'

    def __iter__(self) -> Iterator[Tensor]:
        if self.atomic:
            yield cast(Tensor, self._values)
        else:
            yield from cast(Tensors, self._values)

    def __len__(self) -> int:
        return 1 if self.atomic else len(cast(Tensors, self._values))

    def __getitem__(self, index: int) -> Tensor:
        if not self.atomic:
            return cast(Tensors, self._values)[index]
        if index != 0:
            raise IndexError('atomic batch allows index 0 only')
        return cast(Tensor, self._values)

    @overload
    def __setitem__(self, index: int, value: Tensor) -> None: ...

    @overload
    def __setitem__(self, index: slice, value: Tensors) -> None: ...

    def __setitem__(self, index: Union[int, slice], value: TensorOrTensors) -> None:
        if isinstance(index, slice):
            self._setitem_by_slice(index, cast(Tensors, value))
        else:
            self._setitem_by_index(index, cast(Tensor, value))

    def _setitem_by_index(self, index: int, value: Tensor) -> None:
        if self.atomic:
            if index != 0:
                raise IndexError('atomic batch allows index 0 only')
            self._values = value
            return
        values = list(cast(Tensors, self._values))
        values[index] = value
        self._values = tuple(values)

    def _setitem_by_slice(self, index: slice, value: Sequence[Tensor]) -> None:
        # Only [:], replacing every tensor at once: other slices would make a
        # tuple batch of a different length, which no caller needs.
        if not (index.start is index.stop is index.step is None):
            raise NotImplementedError('only slice [:] supported')
        value = tuple(value)
        if self.atomic:
            if len(value) != 1:
                raise IndexError('atomic batch cannot be replaced with multiple tensors')
            self._values = value[0]
        else:
            self._values = value


def check(input: object, what: str = 'input') -> None:
    """Checks that ``input`` is a tensor or a tuple of tensors.

    Args:
        input: the value to check
        what (str): how to name the value in the error message

    Raises:
        TypeError: ``input`` is neither a tensor nor a tuple of tensors
    """
    requirement = f'{what} must be a tensor or a tuple of tensors'
    if isinstance(input, tuple):
        for index, x in enumerate(input):
            if not isinstance(x, Tensor):
                raise TypeError(describe(requirement,
                                         f'{what}: a tuple holding {type(x).__name__} '
                                         f'at index {index}',
                                         'make it a tensor, such as torch.tensor(value), or '
                                         'give the value to the layer another way'))
        return
    if not isinstance(input, Tensor):
        if isinstance(input, list):
            fix = 'use a tuple instead, such as tuple(values)'
        else:
            fix = 'make it a tensor, or give the value to the layer another way'
        raise TypeError(describe(requirement, f'{what}: {type(input).__name__}', fix))


def scatter(input: TensorOrTensors, chunks: int) -> List[Batch]:
    """Splits the input along dimension 0 into at most ``chunks`` micro-batches.

    It follows :func:`torch.chunk`: a batch that does not divide evenly gets a
    smaller last micro-batch, and a batch smaller than ``chunks`` gets fewer
    micro-batches. Every tensor of a tuple must have the same size in
    dimension 0, whatever ``chunks`` is.

    Args:
        input (torch.Tensor or tuple of tensors): the mini-batch
        chunks (int): the number of micro-batches wanted

    Returns:
        list of :class:`Batch`: the micro-batches, in order

    Raises:
        ValueError: the input is an empty tuple, a tensor has no batch
            dimension, or the tensors of a tuple differ in size in dimension 0
    """
    atomic = isinstance(input, Tensor)
    tensors: Tensors = (input,) if isinstance(input, Tensor) else input
    if not tensors:
        raise ValueError(describe('input must hold at least one tensor to be split into '
                                  'micro-batches', 'input: ()',
                                  'give the mini-batch, such as gpipe(x) or gpipe((x, mask))'))
    for index, x in enumerate(tensors):
        if x.dim() == 0:
            raise ValueError(describe('input tensors must have a batch dimension (dimension 0) '
                                      'to be split into micro-batches',
                                      f"{'input' if atomic else f'input[{index}]'}: "
                                      f'a 0-dimensional tensor',
                                      'give it one entry per sample, such as '
                                      'x.expand(batch_size)'))
    # Same sizes, not only the same number of micro-batches: with 8 and 7
    # rows, both split into 4 pieces, but the last ones would not match.
    if not atomic and any(x.size(0) != tensors[0].size(0) for x in tensors):
        raise ValueError(describe('tensors of the input tuple must have the same size in '
                                  'dimension 0',
                                  f'input: sizes {[x.size(0) for x in tensors]} in dimension 0',
                                  'give every tensor one entry per sample of the mini-batch'))

    if chunks == 1:
        # One micro-batch is the input itself: no views, no autograd nodes.
        return [Batch(input)]
    if atomic:
        return [Batch(x) for x in tensors[0].chunk(chunks)]
    return [Batch(values) for values in zip(*[x.chunk(chunks) for x in tensors])]


def gather(outputs: List[Batch]) -> TensorOrTensors:
    """Concatenates the output micro-batches into a mini-batch along dimension 0.

    Args:
        outputs (list of :class:`Batch`): the micro-batches, in order, all
            of the same form (a tensor, or tuples of the same length)

    Returns:
        torch.Tensor or tuple of tensors: the mini-batch, in that form
    """
    if len(outputs) == 1:
        # Nothing to concatenate: spare a copy.
        return outputs[0].values
    if outputs[0].atomic:
        return torch.cat([b.tensor for b in outputs])
    rotated = [b.tensors for b in outputs]
    return tuple(torch.cat(pieces) for pieces in zip(*rotated))


def map_tensors(function: Callable[[Tensor], Tensor], values: TensorOrTensors) -> TensorOrTensors:
    """Applies ``function`` to every tensor of a tensor or a tuple, keeping its form.

    Args:
        function (callable): takes and returns one tensor
        values (torch.Tensor or tuple of tensors): the tensors

    Returns:
        torch.Tensor or tuple of tensors: ``function(values)`` for a tensor,
        else the tuple of ``function(x)`` for every ``x`` of ``values``

    Example::

        >>> map_tensors(lambda x: x * 2, (torch.ones(1), torch.zeros(1)))
        (tensor([2.]), tensor([0.]))
    """
    if isinstance(values, Tensor):
        return function(values)
    return tuple(function(x) for x in values)

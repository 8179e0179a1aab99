"""Micro-batches: splitting a mini-batch, carrying the pieces, and gathering them.

:func:`scatter` splits the tensors of a mini-batch (a tensor or a tuple)
along dimension 0 into micro-batches (:class:`Batch`), and :func:`gather`
concatenates the outputs. A tuple's other values (``None``, booleans,
numbers, strings, :class:`~torchgpipe.NoChunk` tensors) go to every
micro-batch as they are.
"""
from typing import (Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union,
                    cast, overload)

import torch
from torch import Tensor

from torchgpipe.foundation.nochunk import PLAIN_TYPES, Layout, NoChunk
from torchgpipe.foundation.placement import same_memory
from torchgpipe.foundation.validation import describe

__all__: List[str] = []

Tensors = Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]

Function = Callable[[TensorOrTensors], TensorOrTensors]


class Batch:
    """One micro-batch: a tensor (atomic) or a tuple, a sequence of its tensors either way,
    so the pipeline copies, waits on and forks them alike; :meth:`call` hands a layer
    the value in its original form. ``layout``: where the tensors are among other values
    (``None`` if all are tensors), for values whose NoChunk tensors are unwrapped already.

    Example::

        >>> batch = Batch(torch.zeros(2, 3))
        >>> batch.atomic, len(batch)
        (True, 1)
        >>> batch[0] = torch.ones(2, 3)
        >>> batch.tensor.sum().item()
        6.0
        >>> batch = Batch((torch.zeros(2), None, NoChunk(torch.ones(3))))
        >>> len(batch), batch[1].size()
        (2, torch.Size([3]))
    """

    __slots__ = ('_values', 'atomic', 'layout')

    def __init__(self, values: TensorOrTensors, layout: Optional[Layout] = None) -> None:
        self.atomic = isinstance(values, Tensor)
        # A layout only for tuples holding other values: the common case costs nothing.
        if layout is None and not self.atomic:
            for x in values:
                if not isinstance(x, Tensor):
                    layout, plain = Layout.of(cast(Tensors, values))
                    values = cast(Tensors, plain)
                    break
        self._values = values
        self.layout = layout

    @property
    def tensor(self) -> Tensor:
        """The tensor of an atomic batch (:class:`AttributeError` for a tuple)."""
        if not self.atomic:
            raise AttributeError('not atomic batch')
        return cast(Tensor, self._values)

    @property
    def tensors(self) -> Tensors:
        """The tensors of a non-atomic batch, without its other values (:class:`AttributeError`
        for an atomic batch)."""
        if self.atomic:
            raise AttributeError('batch is atomic')
        return cast(Tensors, self._values) if self.layout is None else tuple(self)

    @property
    def values(self) -> TensorOrTensors:
        """The tensor or the tuple in the form it was given, with NoChunk tensors wrapped."""
        if self.layout is None or not self.layout.nochunk:
            return self._values
        return cast(Tensors, self.layout.wrap(cast(Tensors, self._values)))

    @property
    def plain(self) -> TensorOrTensors:
        """The tensor or the tuple as a layer receives it, with NoChunk tensors unwrapped."""
        return self._values

    def with_tensors(self, tensors: Sequence[Tensor]) -> TensorOrTensors:
        """:attr:`plain`, with ``tensors`` in place of the batch's own (copies of them, say)."""
        return arrange(self.atomic, self.layout, tensors)

    def call(self, function: Function) -> 'Batch':
        """A new batch of what ``function`` returns on the value, called as a layer is."""
        return Batch(function(self._values))

    def find(self, predicate: Callable[[Tensor], bool]) -> Optional[int]:
        """The index of the first tensor satisfying ``predicate``, or ``None``."""
        if self.atomic:
            # The common case, several times per task: spare the iterators.
            return 0 if predicate(cast(Tensor, self._values)) else None
        return next((i for i, x in enumerate(self) if predicate(x)), None)

    def __repr__(self) -> str:
        return f'Batch[atomic={self.atomic!r}]({self.values!r})'

    def __iter__(self) -> Iterator[Tensor]:
        if self.atomic:
            yield cast(Tensor, self._values)
        elif self.layout is None:
            yield from cast(Tensors, self._values)
        else:
            yield from map(cast(Tensors, self._values).__getitem__, self.layout.indices)

    def __len__(self) -> int:
        if self.atomic:
            return 1
        if self.layout is None:
            return len(cast(Tensors, self._values))
        return len(self.layout.indices)

    def __getitem__(self, index: int) -> Tensor:
        if not self.atomic:
            if self.layout is not None:
                index = self.layout.indices[index]
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
            # Only [:], replacing every tensor at once.
            if not (index.start is index.stop is index.step is None):
                raise NotImplementedError('only slice [:] supported')
            value = tuple(cast(Tensors, value))
            if self.atomic and len(value) != 1:
                raise IndexError('atomic batch cannot be replaced with multiple tensors')
            self._values = self.with_tensors(value)
        elif self.atomic:
            if index != 0:
                raise IndexError('atomic batch allows index 0 only')
            self._values = value
        else:
            if self.layout is not None:
                index = self.layout.indices[index]
            values = list(cast(Tensors, self._values))
            values[index] = cast(Tensor, value)
            self._values = tuple(values)


def arrange(atomic: bool, layout: Optional[Layout], tensors: Sequence[Tensor]) -> TensorOrTensors:
    """The value a layer receives: ``tensors`` in the form of the batch they came from."""
    if atomic:
        return tensors[0]
    if layout is None:
        return tuple(tensors)
    return cast(Tensors, layout.fill(tensors))


def check(input: object, what: str = 'input') -> None:
    """Checks that ``input`` (named ``what`` in the message) is a tensor, or a tuple of at
    least one tensor and :class:`~torchgpipe.NoChunk` tensors, ``None``, booleans, numbers
    and strings; else :class:`TypeError`."""
    requirement = f'{what} must be a tensor or a tuple of tensors'
    # A dict cannot be split or sent as it is: its values, in a tuple, can.
    by_position = ('use a tuple of its values instead, such as tuple(d.values()), and take '
                   'them by position where they are used')
    if isinstance(input, tuple):
        has_tensor = False
        for index, x in enumerate(input):
            if isinstance(x, (Tensor, NoChunk)):
                has_tensor = True
            elif not isinstance(x, PLAIN_TYPES):
                raise TypeError(describe(requirement,
                                         f'{what}: a tuple holding {type(x).__name__} '
                                         f'at index {index}',
                                         by_position if isinstance(x, Mapping) else
                                         'make it a tensor, or a value a tuple may hold besides '
                                         'tensors: None, bool, int, float, str or '
                                         'NoChunk(tensor)'))
        if input and not has_tensor:
            raise TypeError(describe(f'{what} must hold at least one tensor',
                                     f'{what}: a tuple of '
                                     f'{", ".join(type(x).__name__ for x in input)}',
                                     'give the tensors along with the other values, such as '
                                     '(x, None)'))
        return
    if not isinstance(input, Tensor):
        if isinstance(input, list):
            fix = 'use a tuple instead, such as tuple(values)'
        elif isinstance(input, Mapping):
            fix = by_position
        else:
            fix = 'make it a tensor, or give the value to the layer another way'
        raise TypeError(describe(requirement, f'{what}: {type(input).__name__}', fix))


def scatter(input: TensorOrTensors, chunks: int, what: str = 'input') -> List[Batch]:
    """Splits ``input`` along dimension 0 into at most ``chunks`` micro-batches, as
    :func:`torch.chunk` does; other values and :class:`~torchgpipe.NoChunk` tensors
    (unwrapped) go to every micro-batch.

    Raises:
        ValueError: the input holds no tensor to split, a tensor to split has no
            batch dimension, or the tensors to split differ in size in dimension 0
    """
    atomic = isinstance(input, Tensor)
    batch = Batch(input)
    layout = batch.layout
    indices: Sequence[int] = range(len(batch)) if layout is None else \
        [i for i in layout.indices if i not in layout.nochunk]
    if not indices:
        received = f'{what}: ()' if not input else \
            f'{what}: a tuple of {", ".join(type(x).__name__ for x in input)}'
        raise ValueError(describe(f'{what} must hold at least one tensor to be split into '
                                  'micro-batches', received,
                                  'give the mini-batch, such as gpipe(x) or gpipe((x, mask))'))
    values = cast(Tensors, batch.plain)
    tensors = [batch[0]] if atomic else [values[i] for i in indices]
    for index, x in zip(indices, tensors):
        if x.dim() == 0:
            raise ValueError(describe(f'{what} tensors must have a batch dimension (dimension 0) '
                                      'to be split into micro-batches',
                                      f"{what if atomic else f'{what}[{index}]'}: "
                                      f'a 0-dimensional tensor',
                                      'give it one entry per sample, such as '
                                      'x.expand(batch_size)'))
    # The same sizes: 8 and 7 rows both make 4 pieces, of other sizes.
    if any(x.size(0) != tensors[0].size(0) for x in tensors):
        raise ValueError(describe(f'tensors of the {what} tuple must have the same size in '
                                  'dimension 0',
                                  f'{what}: sizes {[x.size(0) for x in tensors]} in dimension 0',
                                  'give every tensor one entry per sample of the mini-batch'))

    if chunks == 1:
        # One micro-batch is the input itself: no views, no autograd nodes.
        return [batch]
    if atomic:
        return [Batch(x) for x in tensors[0].chunk(chunks)]
    if layout is None:
        return [Batch(pieces) for pieces in zip(*[x.chunk(chunks) for x in tensors])]
    # The other values, and NoChunk tensors, are shared by every micro-batch.
    batches = []
    for pieces in zip(*[x.chunk(chunks) for x in tensors]):
        micro = list(values)
        for i, piece in zip(indices, pieces):
            micro[i] = piece
        batches.append(Batch(cast(Tensors, tuple(micro)), layout))
    return batches


def gather(outputs: List[Batch]) -> TensorOrTensors:
    """Concatenates output micro-batches (of one form) into a mini-batch along dimension 0;
    other values and :class:`~torchgpipe.NoChunk` tensors (unwrapped) come from the first."""
    first = outputs[0]
    if len(outputs) == 1:
        # Nothing to concatenate: spare a copy.
        return first.plain
    layout = first.layout
    for k, x in enumerate(first):
        position = k if layout is None else layout.indices[k]
        if x.dim() == 0 and (layout is None or position not in layout.nochunk):
            where = 'output' if first.atomic else f'output[{position}]'
            raise ValueError(describe(
                'output tensors must have a batch dimension (dimension 0) to be gathered '
                'from micro-batches', f'{where}: a 0-dimensional tensor, such as a loss',
                'compute the loss from the output, outside the model (train_step takes a '
                'loss_fn), or return one value per sample'))
    if first.atomic:
        return torch.cat([b.tensor for b in outputs])
    if layout is None:
        rotated = [b.tensors for b in outputs]
        return tuple(torch.cat(pieces) for pieces in zip(*rotated))
    values = list(cast(Tensors, first.plain))
    for i in layout.indices:
        if i not in layout.nochunk:
            values[i] = torch.cat([cast(Tensors, b.plain)[i] for b in outputs])
    return cast(Tensors, tuple(values))


def map_tensors(function: Callable[[Tensor], Tensor], values: TensorOrTensors) -> TensorOrTensors:
    """Applies ``function`` to every tensor of a tensor or a tuple, keeping its form;
    a :class:`~torchgpipe.NoChunk` gets ``function`` of its tensor, wrapped again.

    Example::

        >>> map_tensors(lambda x: x * 2, (torch.ones(1), torch.zeros(1)))
        (tensor([2.]), tensor([0.]))
    """
    if isinstance(values, Tensor):
        return function(values)
    return cast(Tensors, tuple(function(x) if isinstance(x, Tensor)
                               else NoChunk(function(x.tensor)) if isinstance(x, NoChunk)
                               else x for x in cast(Tuple[Any, ...], values)))


def move(batches: List[Batch], device: torch.device) -> None:
    """Moves the micro-batches to ``device`` in place by differentiable copies, unless the
    first is in its memory already; a shared NoChunk tensor is moved once."""
    if all(same_memory(x.device, device) for x in batches[0]):
        return
    moved: Dict[int, Tensor] = {}
    for batch in batches:
        for x in batch:
            if id(x) not in moved:
                moved[id(x)] = x.to(device)
        batch[:] = tuple(moved[id(x)] for x in batch)

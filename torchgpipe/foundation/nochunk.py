"""What a tuple between partitions holds besides the tensors split into micro-batches:
:class:`~torchgpipe.NoChunk` tensors and ``PLAIN_TYPES``, whose places a :class:`Layout` keeps."""
from dataclasses import dataclass
from typing import Any, FrozenSet, Sequence, Tuple

from torch import Tensor

from torchgpipe.foundation.validation import describe

__all__ = ['NoChunk']


# The values a tuple at a boundary may hold besides tensors and NoChunk.
PLAIN_TYPES = (type(None), bool, int, float, str)


class NoChunk:
    """Wraps a tensor that every micro-batch gets whole, instead of a slice of it.

    For a tensor without a batch dimension (a mask, a bias). Layers get the
    tensor itself in every micro-batch, so its gradient sums over them as
    without GPipe; the output holds the first micro-batch's, unwrapped.

    Args:
        tensor (torch.Tensor): the tensor not to split

    Raises:
        TypeError: ``tensor`` is not a tensor

    Example::

        >>> class AddBias(nn.Module):
        ...     def forward(self, input):
        ...         x, bias = input  # the tensor itself, whole
        ...         return x + bias, NoChunk(bias)  # passed on whole
        >>> model = GPipe(nn.Sequential(AddBias(), AddBias()), balance=[1, 1],
        ...               devices=['cpu', 'cpu'], chunks=4)
        >>> output, bias = model((torch.zeros(8, 3), NoChunk(torch.ones(3))))
        >>> output.shape, bias.shape
        (torch.Size([8, 3]), torch.Size([3]))
    """

    __slots__ = ('tensor',)

    def __init__(self, tensor: Tensor) -> None:
        if not isinstance(tensor, Tensor):
            raise TypeError(describe('NoChunk must wrap a tensor',
                                     f'tensor: {type(tensor).__name__}',
                                     'put a value that is not a tensor in the tuple as it is, '
                                     'without NoChunk, such as (x, 0.5)'))
        self.tensor = tensor

    def __repr__(self) -> str:
        return f'NoChunk({self.tensor!r})'


@dataclass(slots=True, eq=False)
class Layout:
    """Where the tensors are in a tuple that holds other values too: ``template`` is the
    tuple with ``None`` for each tensor (a checkpoint keeps it, not the tensors, to rebuild
    its input), ``indices`` the tensors' places, ``nochunk`` those of NoChunk tensors."""

    template: Tuple[Any, ...]
    indices: Tuple[int, ...]
    nochunk: FrozenSet[int]

    @staticmethod
    def of(values: Tuple[Any, ...]) -> Tuple['Layout', Tuple[Any, ...]]:
        """The layout of ``values``, and ``values`` with every NoChunk unwrapped."""
        plain = tuple(x.tensor if isinstance(x, NoChunk) else x for x in values)
        indices = tuple(i for i, x in enumerate(plain) if isinstance(x, Tensor))
        nochunk = frozenset(i for i, x in enumerate(values) if isinstance(x, NoChunk))
        template = tuple(None if isinstance(x, Tensor) else x for x in plain)
        return Layout(template, indices, nochunk), plain

    def fill(self, tensors: Sequence[Tensor]) -> Tuple[Any, ...]:
        """The tuple, with ``tensors`` in their places, unwrapped."""
        values = list(self.template)
        for i, x in zip(self.indices, tensors):
            values[i] = x
        return tuple(values)

    def wrap(self, plain: Tuple[Any, ...]) -> Tuple[Any, ...]:
        """``plain`` with its NoChunk tensors wrapped again."""
        return tuple(NoChunk(x) if i in self.nochunk else x for i, x in enumerate(plain))

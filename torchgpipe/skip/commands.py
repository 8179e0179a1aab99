"""The commands a skippable layer's ``forward`` yields: :class:`stash` and :class:`pop`.

They only carry a name (and a tensor): :class:`~torchgpipe.skip.skippable.Skippable`
reads them from the generator and routes them to the current skip tracker.
"""
from typing import List, Optional

from torch import Tensor

__all__: List[str] = []


class stash:
    """The command a skippable layer yields to stash a skip tensor.

    Args:
        name (str): a name declared in ``@skippable(stash=[...])``
        tensor (torch.Tensor or None): the tensor to hand over; ``None`` is
            handed over as it is, and popped as ``None``

    Example::

        @skippable(stash=['identity'])
        class Save(nn.Module):
            def forward(self, input):
                yield stash('identity', input)
                return input * 2
    """

    __slots__ = ('name', 'tensor')

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        self.name = name
        self.tensor = tensor

    def __repr__(self) -> str:
        return f'stash({self.name!r})'


class pop:
    """The command a skippable layer yields to pop a skip tensor.

    The ``yield`` expression evaluates to the tensor that an earlier layer
    stashed under the same name (in the same namespace).

    Args:
        name (str): a name declared in ``@skippable(pop=[...])``

    Example::

        @skippable(pop=['identity'])
        class AddBack(nn.Module):
            def forward(self, input):
                identity = yield pop('identity')
                return input + identity
    """

    __slots__ = ('name',)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f'pop({self.name!r})'

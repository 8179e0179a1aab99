"""The commands a skippable layer's ``forward`` yields: :class:`stash` and :class:`pop`."""
from typing import List, Optional

from torch import Tensor

__all__: List[str] = []


class stash:
    """The command a skippable layer yields to stash a skip tensor.

    Args:
        name (str): a name declared in ``@skippable(stash=[...])``
        tensor (torch.Tensor or None): the tensor to hand over (``None`` pops as ``None``)

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
    """The command a skippable layer yields to pop a skip tensor: the ``yield`` evaluates to
    the tensor an earlier layer stashed under the name.

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

"""How to call a flattened sequential as the original module was called.

:func:`~torchgpipe.to_sequential` puts an :class:`Interface` on the
sequential it returns: the sequential takes and returns tensors, the
original keyword arguments and structured outputs (a dict, a transformers
``ModelOutput``).
"""
from typing import Any, Dict, Optional, Sequence

from torch.utils import _pytree as pytree

from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.validation import describe

__all__ = ['Interface']


class Interface:
    """How to call a flattened sequential as the original module was called.

    :func:`~torchgpipe.to_sequential` puts one on the sequential it returns,
    as ``seq.interface``. The sequential (and GPipe around it) takes one
    tensor, or a tuple of tensors in the order of ``names``, and returns
    a tensor or a tuple of tensors; :meth:`inputs` and :meth:`outputs`
    translate from and to the original's way.

    Args:
        names (tuple of strs): the original's arguments the sequential
            takes, in order
        fixed (dict): the arguments fixed while capturing, with their value
        structure: how the original arranges the tensors it returns, or
            ``None`` for a tensor or a tuple of tensors as the sequential
        training (bool, optional): the mode the graph was captured in first,
            when the generated children depend on it; they run the other
            mode's graph in the other mode

    Example::

        >>> from torchgpipe import to_sequential
        >>> class Scale(nn.Module):
        ...     def forward(self, x, scale, inverse=False):
        ...         return {'y': x / scale if inverse else x * scale}
        >>> seq = to_sequential(Scale(), example_inputs={'x': torch.ones(2, 3),
        ...                                              'scale': torch.ones(2, 1)})
        >>> seq.interface.names
        ('x', 'scale')
        >>> output = seq(seq.interface.inputs(torch.ones(4, 3), scale=torch.full((4, 1), 2.)))
        >>> seq.interface.outputs(output)
        {'y': tensor([[2., 2., 2.],
                [2., 2., 2.],
                [2., 2., 2.],
                [2., 2., 2.]])}
    """

    def __init__(self, names: Sequence[str], fixed: Dict[str, Any],
                 structure: Optional[pytree.TreeSpec] = None,
                 training: Optional[bool] = None) -> None:
        self.names = tuple(names)
        self.fixed = dict(fixed)
        self.structure = structure
        self.training = training

    def __repr__(self) -> str:
        return f'Interface(names={self.names})'

    # pickle and copy.deepcopy: a TreeSpec's leaves do not copy quietly
    # (torch warns about the class they are made again with), so the
    # structure travels as nested tuples and is built again.
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state['structure'] = _encode(self.structure)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.structure = None if state['structure'] is None else _decode(state['structure'])

    def inputs(self, *args: Any, **kwargs: Any) -> TensorOrTensors:
        """Arranges arguments given as to the original module into the sequential's input.

        Returns:
            torch.Tensor or tuple: the one input tensor, or the tuple of them
            in the order of ``names``

        Raises:
            TypeError: an input is missing, unknown or given twice, or an
                argument fixed while capturing is given another value
        """
        if len(args) > len(self.names):
            raise TypeError(describe(f'inputs takes at most {len(self.names)} positional '
                                     'arguments', f'{len(args)} given',
                                     f'give them by name: {", ".join(self.names)}'))
        given = dict(zip(self.names, args))
        for name, value in kwargs.items():
            if name in given:
                raise TypeError(describe(f'inputs got {name!r} twice', f'{name}: given twice',
                                         'give it once, by position or by name'))
            if name in self.fixed and name not in self.names:
                if value is not self.fixed[name] and value != self.fixed[name]:
                    raise TypeError(describe(
                        f'{name} was fixed to {self.fixed[name]!r} when the model was captured',
                        f'{name}: {value!r}', f'capture the model with {name} in '
                        f'to_sequential(module, example_inputs=...) to make it an input'))
                continue
            if name not in self.names:
                raise TypeError(describe(f'the sequential takes no input {name!r}',
                                         f'{name}: given', 'give only '
                                         f'{", ".join(self.names)}, or capture the model with '
                                         f'{name} in to_sequential(module, example_inputs=...)'))
            given[name] = value
        missing = [name for name in self.names if name not in given]
        if missing:
            raise TypeError(describe(f'the sequential needs {", ".join(missing)}',
                                     f'given: {", ".join(given) or "nothing"}',
                                     f'give every one of {", ".join(self.names)}'))
        values = tuple(given[name] for name in self.names)
        return values[0] if len(values) == 1 else values

    def outputs(self, output: TensorOrTensors) -> Any:
        """Arranges the sequential's output as the original module returns it.

        Args:
            output (torch.Tensor or tuple): what the sequential (or GPipe
                around it) returned

        Returns:
            the original's output: a ``ModelOutput`` of transformers, a
            dict, a dataclass... holding those tensors

        Raises:
            TypeError: ``output`` holds another number of tensors than the
                sequential returns
        """
        if self.structure is None:
            return output
        leaves = list(output) if isinstance(output, tuple) else [output]
        if len(leaves) != self.structure.num_leaves:
            raise TypeError(describe(f'outputs takes the {self.structure.num_leaves} tensors '
                                     'the sequential returns', f'output: {len(leaves)} '
                                     'tensors', 'give it what the sequential, or GPipe around '
                                     'it, returned'))
        return pytree.tree_unflatten(leaves, self.structure)

def _encode(spec: Optional[pytree.TreeSpec]) -> Any:
    """A tree structure as nested tuples: ``None`` for a leaf, else (type, context, children)."""
    if spec is None or spec.is_leaf():
        return None
    # children() in recent releases of torch, the field children_specs before.
    children = spec.children() if callable(getattr(spec, 'children', None)) \
        else spec.children_specs
    return (spec.type, spec.context, [_encode(child) for child in children])

def _decode(encoded: Any) -> pytree.TreeSpec:
    """The tree structure :func:`_encode` encoded."""
    if encoded is None:
        return pytree.tree_structure(0)
    kind, context, children = encoded
    return pytree.TreeSpec(kind, context, [_decode(child) for child in children])

"""How to call a flattened sequential as the original module was called."""
from typing import Any, Dict, Optional, Sequence

from torch.utils import _pytree as pytree

from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.validation import describe

__all__ = ['Interface']


class Interface:
    """How to call a flattened sequential as the original module was called.

    :func:`~torchgpipe.to_sequential` puts one on the sequential it returns, as
    ``seq.interface``: :meth:`inputs` and :meth:`outputs` translate the
    original's arguments and structured outputs (a dict, a transformers
    ``ModelOutput``) from and to the tensors the sequential takes and returns.

    Args:
        names (tuple of strs): the original's arguments the sequential
            takes, in order
        fixed (dict): the arguments fixed while capturing, with their value
        structure: how the original arranges the tensors it returns, or
            ``None`` for a tensor or a tuple of tensors as the sequential
        training (bool, optional): the mode the graph was captured in first,
            when the generated children depend on it

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

    # pickle and deepcopy: a TreeSpec's leaves copy with a warning, so nested tuples travel.
    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state['structure'] = _encode(self.structure)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.structure = None if state['structure'] is None else _decode(state['structure'])

    def inputs(self, *args: Any, **kwargs: Any) -> TensorOrTensors:
        """Arranges arguments given as to the original module into the sequential's input: one
        tensor, or a tuple in the order of ``names``.

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
        """Arranges the sequential's (or GPipe's) ``output`` as the original module returns it.

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

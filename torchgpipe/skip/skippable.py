"""Skippable layers: ``@skippable`` and the ``stash`` and ``pop`` commands.

A skippable layer's ``forward`` is a generator yielding :class:`~torchgpipe.skip.stash`
and :class:`~torchgpipe.skip.pop`; :class:`Skippable` runs it and routes the commands
to the current skip tracker (:mod:`torchgpipe.skip.tracker`).
"""
import sys
from typing import (Any, Callable, ClassVar, Dict, FrozenSet, Generator, Iterable, Optional, Set,
                    SupportsIndex, Tuple, Type, TypeVar, cast)

from torch import Tensor, nn

from torchgpipe.foundation.microbatch import Batch, TensorOrTensors
from torchgpipe.skip.namespace import Namespace, default_namespace
from torchgpipe.skip.tracker import current_skip_tracker
from torchgpipe.skip.layout import verify_skippables

__all__ = ['skippable', 'stash', 'pop', 'verify_skippables', 'Skippable']

T = TypeVar('T', bound='Skippable')


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


# The key under which a pickled skippable layer keeps its wrapped module's
# state when the wrapped module's class cannot be saved by name.
WRAPPED_STATE = 'skippable_wrapped_state'


class Skippable(nn.Module):
    """The base of every class :func:`@skippable <torchgpipe.skip.skippable>` returns: it
    wraps an instance of the decorated class as ``module``. Make subclasses with the
    decorator."""

    module_cls: ClassVar[Type[nn.Module]]
    stashable_names: ClassVar[FrozenSet[str]]
    poppable_names: ClassVar[FrozenSet[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        # Only the names isolated by isolate(); the others use the default.
        self.namespaces: Dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f'@skippable({self.module})'

    # pickle saves a class by its name, which finds only one of the two classes:
    #
    #   @skippable(...)            the name means the skippable class; the
    #   class Layer(nn.Module)     wrapped one is only Layer.module_cls
    #
    #   skippable(...)(Layer)      the name means the wrapped class; the
    #   called at run time         skippable class has none (to_sequential's)
    #
    # So the other class is reached from the one found: the wrapped module is
    # saved as its state alone, or the skippable class is made again (remade).

    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        cls = type(self)
        if found_by_name(cls):
            return super().__reduce_ex__(protocol)
        return (remade, (cls.module_cls, tuple(sorted(cls.stashable_names)),
                         tuple(sorted(cls.poppable_names))), self.__getstate__())

    def __getstate__(self) -> Dict[str, Any]:
        state: Dict[str, Any] = super().__getstate__()  # type: ignore[no-untyped-call]
        wrapped = self._modules.get('module')
        if type(wrapped) is self.module_cls and not found_by_name(self.module_cls):
            # None keeps the slot, and so the order, of the child.
            state['_modules'] = dict(state['_modules'], module=None)
            state[WRAPPED_STATE] = wrapped.__getstate__()  # type: ignore[no-untyped-call]
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        state = dict(state)
        wrapped_state = state.pop(WRAPPED_STATE, None)
        super().__setstate__(state)  # type: ignore[no-untyped-call]
        if wrapped_state is not None:
            module = self.module_cls.__new__(self.module_cls)
            module.__setstate__(wrapped_state)  # type: ignore[no-untyped-call]
            self._modules['module'] = module

    def namespaced(self, name: str) -> Tuple[Namespace, str]:
        """The key a tracker stores the skip ``name`` under: ``(namespace, name)``."""
        return self.namespaces.get(name, default_namespace), name

    def stashable(self) -> Iterable[Tuple[Namespace, str]]:
        """The key of each name this layer stashes, in name order."""
        return map(self.namespaced, sorted(self.stashable_names))

    def poppable(self) -> Iterable[Tuple[Namespace, str]]:
        """The key of each name this layer pops, in name order."""
        return map(self.namespaced, sorted(self.poppable_names))

    def isolate(self: T, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> T:
        """Moves skip names of this layer into the namespace ``ns``, so that
        pairs of layers isolated apart may use the same name.

        Args:
            ns (Namespace): the namespace to move the names into

        Keyword Args:
            only (iterable of strs, optional): the names to move (default: all)

        Returns:
            this layer, so that it can be written inline in an ``nn.Sequential``

        Raises:
            ValueError: ``only`` holds a name the layer does not declare

        Example::

            >>> @skippable(stash=['x'])
            ... class Keep(nn.Module):
            ...     def forward(self, input):
            ...         yield stash('x', input)
            ...         return input
            >>> @skippable(pop=['x'])
            ... class Add(nn.Module):
            ...     def forward(self, input):
            ...         x = yield pop('x')
            ...         return input + x
            >>> outer, inner = Namespace(), Namespace()
            >>> model = nn.Sequential(Keep().isolate(outer), Keep().isolate(inner),
            ...                       Add().isolate(inner), Add().isolate(outer))
            >>> verify_skippables(model)  # without the namespaces, 'x' would clash
        """
        declared = self.stashable_names | self.poppable_names
        names = declared if only is None else set(only)
        undeclared = names - declared
        if undeclared:
            raise ValueError(f'cannot isolate {sorted(undeclared)}: not declared by '
                             f'{type(self.module).__name__} (stash='
                             f'{sorted(self.stashable_names)}, '
                             f'pop={sorted(self.poppable_names)})')
        for name in names:
            self.namespaces[name] = ns
        return self

    def dispatch(self, input: TensorOrTensors,
                 handle_stash: Callable[[str, Optional[Tensor]], None],
                 handle_pop: Callable[[str], Optional[Tensor]]) -> Any:
        """Runs the wrapped module's ``forward``, answering ``yield stash(name, tensor)`` with
        ``handle_stash(name, tensor)`` and ``yield pop(name)`` with ``handle_pop(name)``; a
        module holding a skippable layer may call it to take over the layer's skips.

        Raises:
            TypeError: ``forward`` yielded something other than :class:`stash` or :class:`pop`
        """
        generator = self.module(input)

        # @skippable() may decorate a module whose forward never yields:
        # then calling it already computed the output.
        if not isinstance(generator, Generator):
            return generator

        try:
            command = next(generator)
            while True:
                if isinstance(command, stash):
                    handle_stash(command.name, command.tensor)
                    command = next(generator)
                elif isinstance(command, pop):
                    command = generator.send(handle_pop(command.name))
                else:
                    raise TypeError(f'{command!r} is not a command from @skippable')
        except StopIteration as stop:
            return stop.value

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Runs the wrapped module, taking and leaving its skips in the current tracker.

        Raises:
            RuntimeError: a name is popped before it was stashed, popped twice in
                one call, stashed or popped without being declared, or declared but
                not stashed or popped by the call
        """
        skip_tracker = current_skip_tracker()

        # Pops first: inside GPipe the tracker ties them to the input the module sees.
        batch = Batch(input)
        poppable_tensors: Dict[str, Optional[Tensor]] = {}
        for ns, name in self.poppable():
            try:
                poppable_tensors[name] = skip_tracker.load(batch, ns, name)
            except KeyError:
                raise RuntimeError(f"'{name}' has not been stashed") from None
        input = batch.values

        stashed_tensors: Dict[str, Optional[Tensor]] = {}
        popped: Set[str] = set()

        def handle_stash(name: str, tensor: Optional[Tensor]) -> None:
            if name not in self.stashable_names:
                raise RuntimeError(f"'{name}' has not been declared as stashable")
            stashed_tensors[name] = tensor

        def handle_pop(name: str) -> Optional[Tensor]:
            if name not in self.poppable_names:
                raise RuntimeError(f"'{name}' has not been declared as poppable")
            if name in popped:
                raise RuntimeError(f"'{name}' has already been popped")
            popped.add(name)
            return poppable_tensors[name]

        output = self.dispatch(input, handle_stash, handle_pop)

        # GPipe planned portals from the declarations: a skip left out fails here, not later.
        not_stashed = self.stashable_names - stashed_tensors.keys()
        if not_stashed:
            raise RuntimeError(f'{quote_names(not_stashed)} must be stashed but have not')
        not_popped = self.poppable_names - popped
        if not_popped:
            raise RuntimeError(f'{quote_names(not_popped)} must be popped but have not')

        # With the output: inside GPipe the tracker ties the stashes' gradients to it.
        batch = Batch(output)
        for ns, name in self.stashable():
            skip_tracker.save(batch, ns, name, stashed_tensors[name])
        return batch.values


def found_by_name(cls: type) -> bool:
    """Whether pickle finds ``cls`` again by its module and qualified name."""
    found: object = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split('.'):
        # A class defined in a function has '<locals>' in its name: not found.
        found = getattr(found, part, None)
    return found is cls


def remade(module_cls: Type[nn.Module], stash: Tuple[str, ...],
           pop: Tuple[str, ...]) -> Skippable:
    """An empty layer of a skippable class made again from its decorated class and
    skip names, for pickle to fill in."""
    cls = skippable_class(module_cls, stash, pop)
    return cls.__new__(cls)


# The classes skippable_class made, by its arguments.
_classes: Dict[Tuple[type, Tuple[str, ...], Tuple[str, ...]], Type[Skippable]] = {}


def skippable_class(module_cls: Type[nn.Module], stash: Tuple[str, ...],
                    pop: Tuple[str, ...]) -> Type[Skippable]:
    """``skippable(stash, pop)(module_cls)``, made once per arguments, so that a copy or
    unpickled layer of a class made at run time is of its original's class."""
    key = (module_cls, stash, pop)
    cls = _classes.get(key)
    if cls is None:
        cls = _classes[key] = skippable(stash=stash, pop=pop)(module_cls)
    return cls


def quote_names(names: Iterable[str]) -> str:
    """Formats skip names for a message: ``'a', 'b'``, sorted."""
    return ', '.join(repr(name) for name in sorted(names))


def skippable(stash: Iterable[str] = (),
              pop: Iterable[str] = (),
              ) -> Callable[[Type[nn.Module]], Type[Skippable]]:
    """Makes a module class whose ``forward`` can stash and pop skip tensors.

    The decorated ``forward`` is a generator: ``yield stash(name, tensor)`` hands a
    tensor to a later layer, ``tensor = yield pop(name)`` receives it, ``return``
    gives the output. Every call stashes or pops each declared name once. In one
    model each name has exactly one stashing layer and one later popping layer
    (:func:`verify_skippables`); :meth:`~torchgpipe.skip.skippable.Skippable.isolate`
    reuses a name. Works with or without :class:`~torchgpipe.GPipe`, which copies a
    skip straight from the stashing partition's device to the popping one.

    .. note::

        Type checkers cannot see the :class:`~torchgpipe.skip.skippable.Skippable`
        subclass a class decorator returns: use ``# type: ignore``, or
        ``Layer = skippable(stash=['x'])(Layer)``. Define the class at module
        level for pickling.

    Args:
        stash (iterable of strs): the names the layer stashes (default: none)
        pop (iterable of strs): the names the layer pops (default: none)

    Returns:
        a class decorator returning a :class:`~torchgpipe.skip.skippable.Skippable`
        subclass of the same name, whose instances wrap the decorated class's

    Raises:
        TypeError: ``stash`` or ``pop`` is a string rather than a list of names

    Example::

        >>> @skippable(stash=['identity'])
        ... class Save(nn.Module):
        ...     def forward(self, input):
        ...         yield stash('identity', input)
        ...         return input * 2
        >>> @skippable(pop=['identity'])
        ... class AddBack(nn.Module):
        ...     def forward(self, input):
        ...         identity = yield pop('identity')
        ...         return input + identity
        >>> model = nn.Sequential(Save(), nn.ReLU(), AddBack())
        >>> model(torch.tensor([[1.0, -1.0]]))
        tensor([[ 3., -1.]])
    """
    # A string is an iterable of names too, each one character long.
    if isinstance(stash, str) or isinstance(pop, str):
        raise TypeError("stash and pop take an iterable of names, such as ['1to3'], "
                        'not a single string')
    stashable_names = frozenset(stash)
    poppable_names = frozenset(pop)

    def extend_skippable(module_cls: Type[nn.Module]) -> Type[Skippable]:
        # Named as the decorated class, for reprs, pickles and documentation.
        attrs = {'module_cls': module_cls, 'stashable_names': stashable_names,
                 'poppable_names': poppable_names, '__module__': module_cls.__module__,
                 '__qualname__': module_cls.__qualname__, '__doc__': module_cls.__doc__}
        return cast(Type[Skippable], type(module_cls.__name__, (Skippable,), attrs))

    return extend_skippable



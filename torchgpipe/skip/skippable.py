"""The user interface of skip connections: ``@skippable``, ``stash`` and ``pop``."""
from typing import (Any, Callable, ClassVar, Dict, FrozenSet, Generator, Iterable, List,
                    Optional, Set, Tuple, Type, TypeVar, Union, cast)

from torch import Tensor, nn

from torchgpipe.microbatch import Batch
from torchgpipe.skip.namespace import Namespace, default_namespace
from torchgpipe.skip.tracker import current_skip_tracker

__all__ = ['skippable', 'stash', 'pop', 'verify_skippables', 'Skippable']

Tensors = Tuple[Tensor, ...]
TensorOrTensors = Union[Tensor, Tensors]

StashPop = Union['stash', 'pop']
StashPopGenerator = Generator[StashPop, Optional[Tensor], TensorOrTensors]
SkippableModule = nn.Module

T = TypeVar('T', bound='Skippable')


class Skippable(nn.Module):
    """The base class of skippable modules.

    Do not use this class directly. Define a subclass by
    :func:`~torchgpipe.skip.skippable` instead.
    """

    module_cls: ClassVar[Type[SkippableModule]]
    stashable_names: ClassVar[FrozenSet[str]]
    poppable_names: ClassVar[FrozenSet[str]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        self.module = self.module_cls(*args, **kwargs)
        self.namespaces: Dict[str, Namespace] = {}

    def __repr__(self) -> str:
        return f'@skippable({self.module})'

    def namespaced(self, name: str) -> Tuple[Namespace, str]:
        """Prepends the namespace of a skip name."""
        return self.namespaces.get(name, default_namespace), name

    def stashable(self) -> Iterable[Tuple[Namespace, str]]:
        """Iterates over the namespaced names of the skip tensors to stash."""
        for name in sorted(self.stashable_names):
            yield self.namespaced(name)

    def poppable(self) -> Iterable[Tuple[Namespace, str]]:
        """Iterates over the namespaced names of the skip tensors to pop."""
        for name in sorted(self.poppable_names):
            yield self.namespaced(name)

    def isolate(self: T, ns: Namespace, *, only: Optional[Iterable[str]] = None) -> T:
        r"""Isolates a specified subset or the whole set of skip tensors into a
        namespace. In a single sequential module, skip tensors with the same
        name are not allowed unless they are isolated by different namespaces.

        Here's an example using the same name for skip tensors twice. Each pair
        of ``Layer1`` and ``Layer2`` is isolated with its own namespace ``ns1``
        and ``ns2``. There is no conflict anymore::

            ns1 = Namespace()
            ns2 = Namespace()

            model = nn.Sequential(
                Layer1().isolate(ns1),
                Layer1().isolate(ns2),
                Layer2(),
                Layer3().isolate(ns2),
                Layer3().isolate(ns1),
            )

        When ``only`` parameter is omitted, all skip tensors are isolated. You
        can isolate a subset of skip tensors by passing ``only`` parameter::

            ns_alice = Namespace()
            ns_bob = Namespace()

            model = nn.Sequential(
                ...
                StashStashPop().isolate(ns_alice, only=['alice']) \
                               .isolate(ns_bob, only=['bob']),
                ...
            )

        Args:
            ns (Namespace): namespace for isolation

        Keyword Args:
            only (iterable of strs): names of specific skip tensors to be
                isolated (omit this option to isolate all skip tensors
                declared in this module)

        Returns:
            this module itself

        Raises:
            ValueError: a name in ``only`` is not declared by this module
        """
        names: Iterable[str]
        if only is None:
            names = self.stashable_names | self.poppable_names
        else:
            names = set(only)
            undeclared = names - (self.stashable_names | self.poppable_names)
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
        """Runs the wrapped module's forward, handling its stash and pop commands."""
        generator = self.module(input)

        if not isinstance(generator, Generator):
            # A forward without any yield is a plain function.
            return generator

        try:
            op = next(generator)
            while True:
                if isinstance(op, stash):
                    handle_stash(op.name, op.tensor)
                    op = next(generator)
                elif isinstance(op, pop):
                    op = generator.send(handle_pop(op.name))
                else:
                    raise TypeError(f'{op!r} is not a command from @skippable')
        except StopIteration as stop:
            return stop.value

    def forward(self, input: TensorOrTensors) -> TensorOrTensors:
        """Runs the wrapped module, carrying its skip tensors through the current tracker.

        Raises:
            RuntimeError: a skip name is stashed or popped without being
                declared, popped before it is stashed or twice, or a declared
                name is not stashed or popped
        """
        skip_tracker = current_skip_tracker()
        stashed_tensors: Dict[str, Optional[Tensor]] = {}

        # Load the skip tensors this layer may pop.
        batch = Batch(input)
        poppable_tensors: Dict[str, Optional[Tensor]] = {}
        for ns, name in self.poppable():
            try:
                poppable_tensors[name] = skip_tracker.load(batch, ns, name)
            except KeyError:
                raise RuntimeError(f"'{name}' has not been stashed") from None
        input = batch.values
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

        # Every declared skip name must be stashed and popped.
        not_stashed = self.stashable_names - stashed_tensors.keys()
        if not_stashed:
            raise RuntimeError(f'{join_names(not_stashed)} must be stashed but have not')
        not_popped = self.poppable_names - popped
        if not_popped:
            raise RuntimeError(f'{join_names(not_popped)} must be popped but have not')

        # Save the stashed skip tensors.
        batch = Batch(output)
        for ns, name in self.stashable():
            skip_tracker.save(batch, ns, name, stashed_tensors[name])
        return batch.values


def join_names(names: Iterable[str]) -> str:
    return ', '.join(repr(n) for n in sorted(names))


def skippable(stash: Iterable[str] = (),
              pop: Iterable[str] = (),
              ) -> Callable[[Type[SkippableModule]], Type[Skippable]]:
    """The decorator to define a :class:`nn.Module <torch.nn.Module>` with skip
    connections. Decorated modules are called "skippable". This functionality
    works perfectly fine even when the module is not wrapped by
    :class:`~torchgpipe.GPipe`.

    Each skip tensor is managed by its name. Before manipulating skip tensors,
    a skippable module must statically declare the names for skip tensors by
    `stash` and/or `pop` parameters. Skip tensors with pre-declared name can be
    stashed by ``yield stash(name, tensor)`` or popped by ``tensor = yield
    pop(name)``.

    Here is an example with three layers. A skip tensor named "1to3" is
    stashed and popped at the first and last layer, respectively::

        @skippable(stash=['1to3'])
        class Layer1(nn.Module):
            def forward(self, input):
                yield stash('1to3', input)
                return f1(input)

        class Layer2(nn.Module):
            def forward(self, input):
                return f2(input)

        @skippable(pop=['1to3'])
        class Layer3(nn.Module):
            def forward(self, input):
                skip_1to3 = yield pop('1to3')
                return f3(input) + skip_1to3

        model = nn.Sequential(Layer1(), Layer2(), Layer3())

    One skippable module can stash or pop multiple skip tensors::

        @skippable(stash=['alice', 'bob'], pop=['carol'])
        class StashStashPop(nn.Module):
            def forward(self, input):
                yield stash('alice', f_alice(input))
                yield stash('bob', f_bob(input))
                carol = yield pop('carol')
                return input + carol

    Every skip tensor must be associated with exactly one pair of `stash` and
    `pop`. :class:`~torchgpipe.GPipe` checks this restriction automatically
    when wrapping a module. You can also check the restriction by
    :func:`~torchgpipe.skip.verify_skippables` without
    :class:`~torchgpipe.GPipe`.

    .. note::

        :func:`@skippable <skippable>` changes the type of the wrapped class.
        But currently mypy does not understand class decorators that change
        the type (mypy issue #3135). There are two workarounds:

        1. Naively ignore type errors by ``# type: ignore``.
        2. Use ``skippable()()`` as a function instead of a decorator.

    Args:
        stash (iterable of strs): names of the skip tensors to stash
        pop (iterable of strs): names of the skip tensors to pop

    Returns:
        a class decorator that returns a
        :class:`~torchgpipe.skip.skippable.Skippable` subclass
    """
    if isinstance(stash, str) or isinstance(pop, str):
        raise TypeError("stash and pop take an iterable of names, such as ['1to3'], "
                        'not a single string')
    stashable_names = frozenset(stash)
    poppable_names = frozenset(pop)

    def extend_skippable(module_cls: Type[SkippableModule]) -> Type[Skippable]:
        name = module_cls.__name__
        bases = (Skippable,)
        attrs = {'module_cls': module_cls, 'stashable_names': stashable_names,
                 'poppable_names': poppable_names, '__module__': module_cls.__module__,
                 '__qualname__': module_cls.__qualname__, '__doc__': module_cls.__doc__}
        return cast(Type[Skippable], type(name, bases, attrs))

    return extend_skippable


class stash:
    """The command to stash a skip tensor.

    ::

        def forward(self, input):
            yield stash('name', input)
            return f(input)

    Args:
        name (str): name of skip tensor
        tensor (torch.Tensor or None): tensor to pass to the skip connection
    """

    __slots__ = ('name', 'tensor')

    def __init__(self, name: str, tensor: Optional[Tensor]) -> None:
        self.name = name
        self.tensor = tensor

    def __repr__(self) -> str:
        return f'stash({self.name!r})'


class pop:
    """The command to pop a skip tensor.

    ::

        def forward(self, input):
            skip = yield pop('name')
            return f(input) + skip

    Args:
        name (str): name of skip tensor

    Returns:
        the skip tensor previously stashed by another layer under the same name
    """

    __slots__ = ('name',)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f'pop({self.name!r})'


def verify_skippables(module: nn.Sequential) -> None:
    """Verifies if the underlying skippable modules satisfy integrity.

    Every skip tensor must have only one pair of `stash` and `pop`. If there
    are one or more unmatched pairs, it will raise :exc:`TypeError` with the
    detailed messages.

    Skippable modules nested in the layers of ``module`` (in plain modules or
    sequentials, at any depth) count as well, in the order of the layers that
    hold them. Within one layer, a pop may match a stash registered after it,
    as the layer's ``forward`` may call them in any order.

    Here are a few failure cases. :func:`verify_skippables` will report failure
    for these cases::

        # Layer1 stashes "1to3".
        # Layer3 pops "1to3".

        nn.Sequential(Layer1(), Layer2())
        #               └──── ?

        nn.Sequential(Layer2(), Layer3())
        #                   ? ────┘

        nn.Sequential(Layer1(), Layer2(), Layer3(), Layer3())
        #               └───────────────────┘       ^^^^^^

        nn.Sequential(Layer1(), Layer1(), Layer2(), Layer3())
        #             ^^^^^^      └───────────────────┘

    To use the same name for multiple skip tensors, they must be isolated by
    different namespaces. See :meth:`isolate()
    <torchgpipe.skip.skippable.Skippable.isolate>`.

    Args:
        module (nn.Sequential): the module to verify

    Raises:
        TypeError:
            one or more pairs of `stash` and `pop` are not matched.
    """
    stashed: Set[Tuple[Namespace, str]] = set()
    popped: Set[Tuple[Namespace, str]] = set()
    msgs: List[str] = []

    for child_name, child in module.named_children():
        # Skippable layers may be nested in plain modules, whose forward may
        # call them in any order: within one layer of the sequential, every
        # stash counts before any pop. (A pop that runs before its stash is
        # still a RuntimeError when it runs.)
        layers = [(layer_name, layer) for layer_name, layer
                  in child.named_modules(prefix=child_name) if isinstance(layer, Skippable)]

        for layer_name, layer in layers:
            for name in layer.stashable_names & layer.poppable_names:
                msg = f"'{layer_name}' declared '{name}' both as stashable and as poppable"
                msgs.append(msg)

            for ns, name in layer.stashable():
                if name in layer.poppable_names:
                    continue
                if (ns, name) in stashed:
                    msg = f"'{layer_name}' redeclared '{name}' as stashable " \
                          'but not isolated by namespace'
                    msgs.append(msg)
                    continue
                stashed.add((ns, name))

        for layer_name, layer in layers:
            for ns, name in layer.poppable():
                if name in layer.stashable_names:
                    continue
                if (ns, name) in popped:
                    msg = f"'{layer_name}' redeclared '{name}' as poppable " \
                          'but not isolated by namespace'
                    msgs.append(msg)
                    continue
                if (ns, name) not in stashed:
                    msg = f"'{layer_name}' declared '{name}' as poppable but it was not stashed"
                    msgs.append(msg)
                    continue
                popped.add((ns, name))

    for (_, name) in sorted(stashed - popped):
        msg = f"no module declared '{name}' as poppable but stashed"
        msgs.append(msg)

    if msgs:
        raise TypeError('one or more pairs of stash and pop do not match:\n\n%s'
                        '' % '\n'.join('* %s' % x for x in msgs))

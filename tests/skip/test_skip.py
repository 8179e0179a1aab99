"""Skip connections: @skippable, stash/pop, namespaces, verification, and portals in GPipe."""
import copy
import gc
import threading
import warnings
from typing import Any, Callable, Dict, Generator, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from helpers import CHECKPOINT_MODES, COPIERS, assert_same_training_step, cpu_devices
from test_train_step import assert_train_step_as_unwrapped
from torchgpipe import GPipe
from torchgpipe.skip import Namespace, pop, skippable, stash, verify_skippables
from torchgpipe.skip.portal import Portal, PortalCopy
from torchgpipe.skip.skippable import Skippable
from torchgpipe.skip.tracker import current_skip_tracker

W = 4


@skippable(stash=['skip'])
class Stash(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash('skip', x)
        return x


@skippable(pop=['skip'])
class PopAdd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.rand(W) + 0.5)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop('skip')
        return x + skip * self.scale


@skippable(stash=['cross'], pop=['skip'])
class PopStash(nn.Module):
    """Pops one skip and stashes another, in one layer."""

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop('skip')
        yield stash('cross', skip.tanh())
        return x * 2


@skippable(pop=['cross'])
class PopCross(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        cross = yield pop('cross')
        return x - cross


def linear() -> nn.Module:
    return nn.Sequential(nn.Linear(W, W), nn.Tanh())


def unet() -> nn.Sequential:
    """Nested long skips a (outermost), b, c (innermost), and d crossing b's end."""
    a, b, c, d = Namespace(), Namespace(), Namespace(), Namespace()
    return nn.Sequential(
        linear(),                   # 0
        Stash().isolate(a),         # 1  a ──────────────────────────┐
        linear(),                   # 2                              │
        Stash().isolate(b),         # 3  b ───────────────┐          │
        linear(),                   # 4                   │          │
        Stash().isolate(c),         # 5  c ──┐            │          │
        linear(),                   # 6      │            │          │
        PopAdd().isolate(c),        # 7  c ◄─┘            │          │
        Stash().isolate(d),         # 8  d ─────────┐     │          │
        linear(),                   # 9             │     │          │
        PopStash().isolate(b, only=['skip']),  # 10 b ◄────────┼─────┘, cross ─┐│
        PopAdd().isolate(d),        # 11 d ◄────────┘               ││
        linear(),                   # 12                            ││
        PopCross(),                 # 13 cross ◄────────────────────┘│
        PopAdd().isolate(a),        # 14 a ◄─────────────────────────┘
        linear(),                   # 15
    ).double()


N_LAYERS = 16
# (namespace stash layer, pop layer) of each skip in unet(), for counting.
SKIPS = [(1, 14), (3, 10), (5, 7), (8, 11), (10, 13)]


def partition_of(layer: int, balance: List[int]) -> int:
    bound = 0
    for j, size in enumerate(balance):
        bound += size
        if layer < bound:
            return j
    raise AssertionError


def assert_same_as_without_gpipe(model: nn.Sequential, balance: List[int], chunks: int,
                                 checkpoint: str, input: Tensor, threaded: bool) -> None:
    assert_same_training_step(
        model, lambda m: GPipe(m, balance, devices=cpu_devices(len(balance), threaded),
                               chunks=chunks, checkpoint=checkpoint),
        input)


@pytest.mark.parametrize('balance', [[16], [8, 8], [4, 4, 4, 4], [2, 6, 5, 3], [1, 1, 13, 1],
                                     [6, 2, 2, 6], [11, 2, 2, 1]])
@pytest.mark.parametrize('chunks', [1, 3])
def test_unet_equals_the_model_without_gpipe(balance: List[int], chunks: int,
                                             checkpoint: str, threaded: bool) -> None:
    assert_same_as_without_gpipe(unet(), balance, chunks, checkpoint,
                                 torch.randn(7, W, dtype=torch.double), threaded)


@settings(max_examples=30, deadline=None)
@given(st.sets(st.integers(1, N_LAYERS - 1), max_size=3), st.integers(1, 5),
       st.sampled_from(CHECKPOINT_MODES), st.integers(1, 9), st.booleans())
def test_unet_any_balance(cuts: set, chunks: int, checkpoint: str, batch: int,
                          threaded: bool) -> None:
    bounds = [0, *sorted(cuts), N_LAYERS]
    balance = [b - a for a, b in zip(bounds, bounds[1:])]
    assert_same_as_without_gpipe(unet(), balance, chunks, checkpoint,
                                 torch.randn(batch, W, dtype=torch.double), threaded)


@pytest.fixture
def portal_copies(monkeypatch: pytest.MonkeyPatch) -> List[Tuple[str, int]]:
    """Records every PortalCopy: ('forward' or 'backward', id of its portal)."""
    transfers: List[Tuple[str, int]] = []

    original_forward, original_backward = PortalCopy.forward, PortalCopy.backward

    def forward(ctx: Any, portal: Portal, *args: Any) -> Tensor:
        transfers.append(('forward', id(portal)))
        return original_forward(ctx, portal, *args)

    def backward(ctx: Any, grad: Any) -> Any:
        transfers.append(('backward', id(ctx.portal)))
        return original_backward(ctx, grad)

    monkeypatch.setattr(PortalCopy, 'forward', staticmethod(forward))
    monkeypatch.setattr(PortalCopy, 'backward', staticmethod(backward))
    return transfers


def assert_one_copy_each_way(gpipe: GPipe, input: Tensor, crossing: int, chunks: int,
                             transfers: List[Tuple[str, int]]) -> None:
    """Asserts one portal copy per crossing skip and micro-batch, forward and backward."""
    output = gpipe(input)
    assert len(transfers) == crossing * chunks
    assert all(kind == 'forward' for kind, _ in transfers)
    # One portal per crossing skip per micro-batch, each copied once.
    assert len({portal for _, portal in transfers}) == crossing * chunks

    transfers.clear()
    output.sum().backward()
    assert len(transfers) == crossing * chunks
    assert all(kind == 'backward' for kind, _ in transfers)


@pytest.mark.parametrize('balance', [[16], [8, 8], [4, 4, 4, 4], [1, 1, 13, 1], [2, 6, 5, 3]])
def test_skip_tensors_cross_devices_once_each_way(balance: List[int], checkpoint: str,
                                                 portal_copies: List[Tuple[str, int]],
                                                 threaded: bool) -> None:
    """Exactly one transfer per crossing skip per micro-batch, none for a skip within a partition.

    The skip tensor goes straight from the stashing partition to the popping
    one; the partitions between never see it.
    """
    chunks = 3
    gpipe = GPipe(unet(), balance, devices=cpu_devices(len(balance), threaded), chunks=chunks,
                  checkpoint=checkpoint)
    crossing = sum(partition_of(s, balance) != partition_of(p, balance) for s, p in SKIPS)
    assert_one_copy_each_way(gpipe, torch.randn(6, W, dtype=torch.double, requires_grad=True),
                             crossing, chunks, portal_copies)


def test_intermediate_partitions_see_only_their_own_input() -> None:
    seen: List[Any] = []

    class Look(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(x)
            return x

    model = nn.Sequential(Stash(), Look(), Look(), PopAdd()).double()
    gpipe = GPipe(model, [1, 1, 1, 1], devices=['cpu'] * 4, chunks=2)
    gpipe(torch.randn(4, W, dtype=torch.double))
    assert len(seen) == 4 and all(isinstance(x, Tensor) and x.shape == (2, W) for x in seen)


@skippable(stash=['maybe'])
class StashNone(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash('maybe', None)
        return x * 2


@skippable(pop=['maybe'])
class PopNone(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        maybe = yield pop('maybe')
        assert maybe is None
        return x + 1


@pytest.mark.parametrize('balance', [[3], [1, 2], [1, 1, 1]])
def test_stash_none(balance: List[int], checkpoint: str, threaded: bool) -> None:
    model = nn.Sequential(StashNone(), nn.Linear(W, W), PopNone()).double()
    assert_same_as_without_gpipe(model, balance, 2, checkpoint,
                                 torch.randn(4, W, dtype=torch.double), threaded)


@skippable(pop=['skip'])
class PopOnly(nn.Module):
    """Returns the popped skip and ignores its input: only the skip carries a gradient."""

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop('skip')
        return skip


@pytest.mark.parametrize('balance', [[5], [3, 2], [2, 3], [1, 2, 2], [2, 1, 1, 1]])
@pytest.mark.parametrize('chunks', [1, 2, 3])
def test_a_pop_that_ignores_its_input(balance: List[int], chunks: int, checkpoint: str,
                                      threaded: bool) -> None:
    """The layers before the stash get the skip's gradient; those between, none (None)."""
    model = nn.Sequential(nn.Linear(W, W), Stash(), nn.Linear(W, W), PopOnly(),
                          nn.Linear(W, W)).double()
    assert_same_as_without_gpipe(model, balance, chunks, checkpoint,
                                 torch.randn(6, W, dtype=torch.double), threaded)


@pytest.mark.parametrize('balance', [[3, 2], [1, 2, 2]])
@pytest.mark.parametrize('schedule', ['1f1b', 'fill_drain'])
def test_a_pop_that_ignores_its_input_in_train_step(balance: List[int], schedule: str,
                                                    checkpoint: str, threaded: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(W, W), Stash(), nn.Linear(W, W), PopOnly(),
                          nn.Linear(W, W)).double()
    assert_train_step_as_unwrapped(model, torch.randn(6, W, dtype=torch.double),
                                   torch.randn(6, W, dtype=torch.double), F.mse_loss,
                                   schedule=schedule, balance=balance,
                                   devices=cpu_devices(len(balance), threaded), chunks=3,
                                   checkpoint=checkpoint)


@skippable(stash=['const'])
class StashConstant(nn.Module):
    """Stashes a tensor that does not require grad."""

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash('const', torch.ones_like(x).detach())
        return x


@skippable(pop=['const'])
class PopConstant(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        const = yield pop('const')
        return x * const


def test_skip_that_needs_no_grad(checkpoint: str, threaded: bool) -> None:
    model = nn.Sequential(StashConstant(), nn.Linear(W, W), PopConstant(),
                          nn.Linear(W, W)).double()
    assert_same_as_without_gpipe(model, [1, 2, 1], 3, checkpoint,
                                 torch.randn(6, W, dtype=torch.double), threaded)


@skippable(stash=['ids'])
class KeepIds(nn.Module):
    """Takes (ids, x); stashes the integer token ids for a later embedding."""

    def forward(self, pair: Tuple[Tensor, Tensor]) -> Generator[Any, Any, Tensor]:
        ids, x = pair
        yield stash('ids', ids)
        return x


@skippable(pop=['ids'])
class EmbedIds(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(10, W)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        ids = yield pop('ids')
        assert ids.dtype == torch.int64
        return x + self.embedding(ids)


@pytest.mark.parametrize('balance', [[1, 1, 1], [2, 1], [1, 2]])
def test_integer_skip_tensor_and_tuple_input(balance: List[int], checkpoint: str,
                                             threaded: bool) -> None:
    model = nn.Sequential(KeepIds(), nn.Linear(W, W), EmbedIds()).double()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, balance, devices=cpu_devices(len(balance), threaded), chunks=3,
                  checkpoint=checkpoint)
    ids = torch.randint(10, (6,))
    x = torch.randn(6, W, dtype=torch.double)
    expected = reference((ids, x))
    actual = gpipe((ids, x))
    torch.testing.assert_close(actual, expected)
    expected.sum().backward()
    actual.sum().backward()
    for p, q in zip(gpipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_skippable_works_alone_and_without_yield() -> None:
    @skippable()
    class Plain(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x + 1

    assert torch.equal(Plain()(torch.zeros(1)), torch.ones(1))
    model = nn.Sequential(Stash(), nn.Identity(), PopAdd())
    x = torch.randn(2, W)
    torch.testing.assert_close(model(x), x + x * model[2].module.scale)
    assert 'Stash' in repr(model[0]) and repr(model[0]).startswith('@skippable(')


def test_default_tracker_is_per_thread() -> None:
    trackers = []
    thread = threading.Thread(target=lambda: trackers.append(current_skip_tracker()))
    thread.start()
    thread.join()
    assert trackers[0] is not current_skip_tracker()
    assert current_skip_tracker() is current_skip_tracker()


def test_runtime_errors_name_the_skip() -> None:
    @skippable(stash=['declared'])
    class StashUndeclared(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield stash('other', x)
            return x

    @skippable(pop=['skip'])
    class PopUndeclared(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield pop('other')
            return x

    @skippable(pop=['skip'])
    class PopTwice(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield pop('skip')
            yield pop('skip')
            return x

    @skippable(stash=['skip'])
    class NeverStash(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x

    @skippable(pop=['skip'])
    class NeverPop(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x

    x = torch.zeros(1)
    with pytest.raises(RuntimeError, match="'other' has not been declared as stashable"):
        StashUndeclared()(x)
    Stash()(x)
    with pytest.raises(RuntimeError, match="'other' has not been declared as poppable"):
        PopUndeclared()(x)
    Stash()(x)
    with pytest.raises(RuntimeError, match="'skip' has already been popped"):
        PopTwice()(x)
    with pytest.raises(RuntimeError, match="'skip' has not been stashed"):
        PopAdd()(x)
    with pytest.raises(RuntimeError, match="'skip' must be stashed but have not"):
        NeverStash()(x)
    Stash()(x)
    with pytest.raises(RuntimeError, match="'skip' must be popped but have not"):
        NeverPop()(x)

    class NotACommand(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield 'stash'
            return x

    with pytest.raises(TypeError, match='is not a command'):
        skippable()(NotACommand)()(x)


def verify_message(*layers: nn.Module) -> str:
    with pytest.raises(TypeError) as excinfo:
        verify_skippables(nn.Sequential(*layers))
    return str(excinfo.value)


def test_verify_skippables_reports_every_failure_case() -> None:
    # Stashed but never popped.
    assert "no module declared 'skip' as poppable but stashed" in \
        verify_message(Stash(), nn.Identity())
    # Popped but never stashed.
    assert "'1' declared 'skip' as poppable but it was not stashed" in \
        verify_message(nn.Identity(), PopAdd())
    # Popped twice.
    assert "'3' redeclared 'skip' as poppable but not isolated by namespace" in \
        verify_message(Stash(), nn.Identity(), PopAdd(), PopAdd())
    # Stashed twice.
    assert "'1' redeclared 'skip' as stashable but not isolated by namespace" in \
        verify_message(Stash(), Stash(), nn.Identity(), PopAdd())
    # Several problems: one line each.
    message = verify_message(Stash(), Stash(), PopAdd(), PopAdd(), PopAdd())
    assert message.count('\n* ') == 3

    @skippable(stash=['x'], pop=['x'])
    class Both(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x

    assert "declared 'x' both as stashable and as poppable" in verify_message(Both())


def test_gpipe_verifies_skippables() -> None:
    with pytest.raises(TypeError, match='stash and pop do not match'):
        GPipe(nn.Sequential(Stash(), Stash(), PopAdd()), [3], devices=['cpu'])


def test_namespaces_isolate_the_same_class_twice(threaded: bool) -> None:
    with pytest.raises(TypeError):
        verify_skippables(nn.Sequential(Stash(), Stash(), PopAdd(), PopAdd()))
    ns1, ns2 = Namespace(), Namespace()
    model = nn.Sequential(Stash().isolate(ns1), Stash().isolate(ns2),
                          PopAdd().isolate(ns2), PopAdd().isolate(ns1))
    verify_skippables(model)
    assert ns1 != ns2 and ns1 == ns1 and 'Namespace' in repr(ns1)
    assert_same_as_without_gpipe(model.double(), [1, 1, 1, 1], 2, 'except_last',
                                 torch.randn(4, W, dtype=torch.double), threaded)


def test_isolate_only_some_names() -> None:
    @skippable(stash=['alice', 'bob'])
    class StashStash(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield stash('alice', x)
            yield stash('bob', x * 2)
            return x

    @skippable(pop=['alice', 'bob'])
    class PopPop(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            alice = yield pop('alice')
            bob = yield pop('bob')
            return x + alice - bob

    ns_alice = Namespace()
    layer = StashStash().isolate(ns_alice, only=['alice'])
    assert dict(layer.namespaces) == {'alice': ns_alice}
    # bob stays in the default namespace: a pop that isolates both misses it.
    with pytest.raises(TypeError, match="'bob'"):
        verify_skippables(nn.Sequential(layer, PopPop().isolate(ns_alice)))
    verify_skippables(nn.Sequential(layer, PopPop().isolate(ns_alice, only=['alice'])))
    with pytest.raises(ValueError, match='not declared'):
        layer.isolate(ns_alice, only=['carol'])


class Call(nn.Module):
    """A plain module that calls the layer it holds after a linear layer of its own."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.linear = nn.Linear(W, W)
        self.layer = layer

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(self.linear(x))


class StashThenPop(nn.Module):
    """Registers its popping layer before its stashing one, but calls them the other way."""

    def __init__(self, ns: Namespace) -> None:
        super().__init__()
        self.pop = PopAdd().isolate(ns)
        self.inner = linear()
        self.stash = Stash().isolate(ns)

    def forward(self, x: Tensor) -> Tensor:
        return self.pop(self.inner(self.stash(x)))


def nested() -> nn.Sequential:
    """Skips a, b, c stashed and popped by layers nested in plain modules and sequentials."""
    a, b, c = Namespace(), Namespace(), Namespace()
    return nn.Sequential(
        Call(Stash().isolate(a)),                                     # 0 a ─────┐
        linear(),                                                     # 1        │
        nn.Sequential(linear(), nn.Sequential(Stash().isolate(b))),  # 2 b ─┐   │
        Call(PopAdd().isolate(b)),                                    # 3 b ◄┘   │
        Call(StashThenPop(c)),                                        # 4 c ⟲    │
        nn.Sequential(Call(PopAdd().isolate(a))),                     # 5 a ◄────┘
    ).double()


NESTED_SKIPS = [(0, 5), (2, 3), (4, 4)]


@pytest.mark.parametrize('threaded', [False, True])
@pytest.mark.parametrize('balance', [[6], [3, 3], [1, 5], [4, 2], [2, 2, 2], [1, 1, 1, 1, 1, 1]])
def test_nested_skippables_equal_the_model_without_gpipe(balance: List[int], checkpoint: str,
                                                        threaded: bool) -> None:
    assert_same_training_step(
        nested(), lambda m: GPipe(m, balance, devices=cpu_devices(len(balance), threaded),
                                  chunks=3, checkpoint=checkpoint),
        torch.randn(7, W, dtype=torch.double))


@pytest.mark.parametrize('threaded', [False, True])
@pytest.mark.parametrize('checkpoint', ['always', 'never'])
@pytest.mark.parametrize('balance', [[6], [3, 3], [4, 2], [2, 2, 2], [1, 1, 1, 1, 1, 1]])
def test_nested_skips_cross_through_portals(balance: List[int], checkpoint: str, threaded: bool,
                                            portal_copies: List[Tuple[str, int]]) -> None:
    chunks = 3
    gpipe = GPipe(nested(), balance, devices=cpu_devices(len(balance), threaded), chunks=chunks,
                  checkpoint=checkpoint)
    crossing = sum(partition_of(s, balance) != partition_of(p, balance)
                   for s, p in NESTED_SKIPS)
    assert_one_copy_each_way(gpipe, torch.randn(6, W, dtype=torch.double, requires_grad=True),
                             crossing, chunks, portal_copies)


def no_stash(name: str, tensor: Optional[Tensor]) -> None:
    raise AssertionError(f'unexpected stash of {name!r}')


def no_pop(name: str) -> Optional[Tensor]:
    raise AssertionError(f'unexpected pop of {name!r}')


class StashInTuple(nn.Module):
    """Runs a stashing layer by its dispatch() and passes the skip on beside the output."""

    def __init__(self, layer: Skippable) -> None:
        super().__init__()
        self.linear = nn.Linear(W, W)
        self.layer = layer

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        stashed: Dict[str, Optional[Tensor]] = {}
        output = self.layer.dispatch(self.linear(x), stashed.__setitem__, no_pop)
        skip = stashed['skip']
        assert skip is not None
        return output, skip


class First(nn.Module):
    """Applies a layer to the first tensor of a pair and passes the second on."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        x, skip = pair
        return self.layer(x), skip


class PopFromTuple(nn.Module):
    """Runs a popping layer by its dispatch(), handing it the skip carried in the pair."""

    def __init__(self, layer: Skippable) -> None:
        super().__init__()
        self.linear = nn.Linear(W, W)
        self.layer = layer

    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tensor:
        x, skip = pair
        output: Tensor = self.layer.dispatch(self.linear(x), no_stash, lambda name: skip)
        return output


def carried_in_tuples() -> nn.Sequential:
    """A skip carried by its wrappers in a tuple, inside one the tracker carries."""
    ns = Namespace()
    return nn.Sequential(
        Call(Stash()),                              # 0 skip ─────────┐
        StashInTuple(Stash().isolate(ns)),          # 1 ns skip ─┐    │
        First(linear()),                            # 2       (tuple) │
        PopFromTuple(PopAdd().isolate(ns)),         # 3 ns skip ◄┘    │
        Call(PopAdd()),                             # 4 skip ◄────────┘
    ).double()


@pytest.mark.parametrize('threaded', [False, True])
@pytest.mark.parametrize('balance', [[5], [1, 4], [2, 3], [4, 1], [1, 2, 2],
                                     [1, 1, 1, 1, 1]])
def test_skip_carried_by_wrappers_calling_dispatch(balance: List[int], checkpoint: str,
                                                   threaded: bool,
                                                   portal_copies: List[Tuple[str, int]]) -> None:
    """A wrapper may run a skippable layer by dispatch() and carry the skip itself.

    The tracker never sees that skip: it travels in the tuple, and only the
    one stashed and popped through the tracker goes through a portal.
    """
    def factory(model: nn.Sequential) -> GPipe:
        return GPipe(model, balance, devices=cpu_devices(len(balance), threaded), chunks=3,
                     checkpoint=checkpoint)

    assert_same_training_step(carried_in_tuples(), factory, torch.randn(7, W, dtype=torch.double))

    portal_copies.clear()
    crossing = int(partition_of(0, balance) != partition_of(4, balance))
    assert_one_copy_each_way(factory(carried_in_tuples()),
                             torch.randn(6, W, dtype=torch.double, requires_grad=True),
                             crossing, 3, portal_copies)


def test_verify_skippables_sees_nested_layers() -> None:
    verify_skippables(nested())
    verify_skippables(carried_in_tuples())
    # Stashed but never popped.
    assert "no module declared 'skip' as poppable but stashed" in \
        verify_message(Call(Stash()), nn.Identity())
    # Popped but never stashed: named by its path.
    assert "'1.layer' declared 'skip' as poppable but it was not stashed" in \
        verify_message(nn.Identity(), Call(PopAdd()))
    # Popped in a layer before the one that stashes.
    message = verify_message(nn.Sequential(Call(PopAdd())), Call(Stash()))
    assert "'0.0.layer' declared 'skip' as poppable but it was not stashed" in message
    assert "no module declared 'skip' as poppable but stashed" in message
    # Popped twice, at different depths.
    assert "'2.0.layer' redeclared 'skip' as poppable but not isolated by namespace" in \
        verify_message(Call(Stash()), PopAdd(), nn.Sequential(Call(PopAdd())))
    # Stashed twice, in one layer.
    assert "'0.1' redeclared 'skip' as stashable but not isolated by namespace" in \
        verify_message(nn.Sequential(Stash(), Stash()), PopAdd())
    with pytest.raises(TypeError, match="'1.layer' declared 'skip' as poppable"):
        GPipe(nn.Sequential(nn.Identity(), Call(PopAdd())), [1, 1], devices=['cpu'] * 2)


def live() -> Tuple[int, int]:
    """The portals and the tensors alive, counted in one walk of the heap (a walk
    takes seconds in a worker that imported much, and the test needs three)."""
    gc.collect()
    portals = tensors = 0
    with warnings.catch_warnings():
        # isinstance() on some torch module objects warns about deprecations.
        warnings.simplefilter('ignore')
        for obj in gc.get_objects():
            if isinstance(obj, Portal):
                portals += 1
            elif isinstance(obj, Tensor):
                tensors += 1
    return portals, tensors


@pytest.mark.slow
@pytest.mark.parametrize('checkpoint', ['always', 'never'])
def test_no_leak_after_many_steps(checkpoint: str) -> None:
    model = GPipe(unet(), [4, 4, 4, 4], devices=['cpu'] * 4, chunks=3, checkpoint=checkpoint)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        optimizer.zero_grad()
        model(torch.randn(6, W, dtype=torch.double)).pow(2).mean().backward()
        optimizer.step()

    portals, _ = live()
    step()
    # A step releases every portal it made.
    after_one = live()
    assert after_one[0] == portals
    # A leak of every step, or of every few steps, shows as a count that grows.
    for _ in range(10):
        step()
    assert live() == after_one


def test_portal_releases_the_tensor_after_the_last_pop() -> None:
    portal = Portal(torch.ones(1), tensor_life=2)
    phony = torch.empty(0)
    assert portal.orange(phony) is not None and portal.tensor is not None
    assert portal.orange(phony) is not None and portal.tensor is None
    with pytest.raises(RuntimeError, match='already popped'):
        portal.orange(phony)


@skippable(stash=['weighted'])
class StashWeighted(nn.Module):
    """Stashes a tensor that requires grad while passing on one that does not."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.rand(W) + 0.5)

    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash('weighted', x * self.weight)
        return x


@skippable(pop=['weighted'])
class PopWeighted(nn.Module):
    def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
        weighted = yield pop('weighted')
        return x + weighted


def test_skip_requiring_grad_beside_a_main_path_that_does_not(checkpoint: str,
                                                              threaded: bool) -> None:
    """Only the skip carries gradient: the portals must still bring it back."""
    model = nn.Sequential(StashWeighted(), nn.Identity(), nn.ReLU(), PopWeighted()).double()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [1, 1, 1, 1], devices=cpu_devices(4, threaded), chunks=2,
                  checkpoint=checkpoint)
    x = torch.randn(4, W, dtype=torch.double)
    reference(x).pow(2).sum().backward()
    gpipe(x).pow(2).sum().backward()
    weight = gpipe.partitions[0][0].module.weight
    assert weight.grad is not None
    torch.testing.assert_close(weight.grad, reference[0].module.weight.grad)


@pytest.mark.parametrize('copier', COPIERS)
def test_module_level_skippables_copied_inside_gpipe_train_like_the_original(
        copier: Callable[[nn.Module], nn.Module], threaded: bool) -> None:
    """pickle finds classes by name, and @skippable gives the decorated
    class's name to the class it makes: both must still be found."""
    ns = Namespace()
    model = nn.Sequential(StashWeighted().isolate(ns), nn.Linear(W, W), nn.Tanh(),
                          PopWeighted().isolate(ns)).double()
    input = torch.randn(6, W, dtype=torch.double)

    def copied_after_a_step(model: nn.Sequential) -> nn.Module:
        gpipe = GPipe(model, [1, 2, 1], devices=cpu_devices(3, threaded), chunks=3)
        gpipe(input).sum().backward()
        gpipe.zero_grad()
        clone = copier(gpipe)
        # The classes themselves, not classes made again.
        assert type(clone[0]) is StashWeighted
        assert type(clone[0].module) is StashWeighted.module_cls
        assert clone[0].module.weight is not gpipe[0].module.weight
        return clone

    assert_same_training_step(model, copied_after_a_step, input)


def test_a_skip_gradient_needs_a_floating_point_tensor_to_travel_on() -> None:
    @skippable(stash=['skip'])
    class StashToIds(nn.Module):
        def forward(self, x: Tensor) -> Generator[Any, Any, Tensor]:
            yield stash('skip', x)
            return torch.zeros(x.size(0), dtype=torch.long)

    @skippable(pop=['skip'])
    class PopFromIds(nn.Module):
        def forward(self, ids: Tensor) -> Generator[Any, Any, Tensor]:
            skip = yield pop('skip')
            return skip + ids.unsqueeze(1)

    x = torch.randn(4, W, requires_grad=True)
    gpipe = GPipe(nn.Sequential(StashToIds(), PopFromIds()), [1, 1], devices=['cpu'] * 2,
                  checkpoint='never')
    with pytest.raises(RuntimeError, match="skip tensor 'skip' requires grad, but the stashing"):
        gpipe(x)
    # Without grad there is no gradient to carry: it works.
    with torch.no_grad():
        torch.testing.assert_close(gpipe(x), x)


def test_plain_tracker_does_not_copy() -> None:
    from torchgpipe.foundation.microbatch import Batch
    from torchgpipe.skip.namespace import default_namespace
    from torchgpipe.skip.tracker import SkipTracker
    from torchgpipe.foundation.stream import CPUStream

    with pytest.raises(TypeError, match='copy is not supported'):
        SkipTracker().copy(Batch(torch.zeros(1)), CPUStream, CPUStream, default_namespace, 'x')


def test_namespaces_are_distinct_and_ordered() -> None:
    a, b = Namespace(), Namespace()
    assert a != b and a == a and hash(a) != hash(b)
    assert sorted([a, b]) == sorted([b, a])
    assert (a < b) != (b < a)
    assert a != 'namespace'
    with pytest.raises(TypeError):
        a < 'namespace'  # noqa: B015


def test_tracker_keeps_its_old_misspelled_name() -> None:
    """0.0.7 spelled the class SkipTrackerThroughPotals; code importing that name still works."""
    from torchgpipe.skip.tracker import SkipTrackerThroughPortals, SkipTrackerThroughPotals

    assert SkipTrackerThroughPotals is SkipTrackerThroughPortals


@skippable(stash=['skip'])
class StashBesideATuple(nn.Module):
    """Stashes its input and returns two tensors: the stash's phony joins the first."""

    def forward(self, x: Tensor) -> Generator[Any, None, Tuple[Tensor, Tensor]]:
        yield stash('skip', x * 3)
        return x * 2, x * 5


class Swap(nn.Module):
    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        a, b = pair
        return b * 1, a * 1


@skippable(pop=['skip'])
class PopIntoATuple(nn.Module):
    def forward(self, pair: Tuple[Tensor, Tensor]) -> Generator[Any, Tensor, Tensor]:
        skip = yield pop('skip')
        return pair[0] * pair[1] + skip


@pytest.mark.parametrize('chunks', [1, 3])
def test_skip_gradient_waits_for_every_tensor_of_the_popping_input(
        checkpoint: str, chunks: int, threaded: bool) -> None:
    """The stashing layer's first output reaches the popping partition second.

    The gradient of every tensor crossing into the popping partition must
    wait for the skip's gradient to be in its portal: otherwise the
    stashing partition's backward pass may take the portal's gradient
    before it is there, and the skip's gradient is lost.
    """
    model = nn.Sequential(StashBesideATuple(), Swap(), PopIntoATuple())
    assert_same_training_step(
        model, lambda m: GPipe(m, [2, 1], devices=cpu_devices(2, threaded), chunks=chunks,
                               checkpoint=checkpoint), torch.randn(6, 4))


class DropFirst(nn.Module):
    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tensor:
        return pair[1] * 1


class DetachFirst(nn.Module):
    def forward(self, pair: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
        return pair[0].detach(), pair[1] * 1


@skippable(pop=['skip'])
class PopOntoTheLast(nn.Module):
    def forward(self, input: Any) -> Generator[Any, Tensor, Tensor]:
        skip = yield pop('skip')
        last = input[-1] if isinstance(input, tuple) else input
        return last + skip


@pytest.mark.parametrize('middle', [DropFirst, DetachFirst])
def test_skip_gradient_survives_a_dropped_first_output(
        middle: Callable[[], nn.Module], checkpoint: str, threaded: bool) -> None:
    """The stashing layer's first output never reaches the loss.

    The skip's gradient leaves its portal once the outputs of the stashing
    layer have their gradients: hung on the first output alone, it never did.
    """
    model = nn.Sequential(StashBesideATuple(), middle(), PopOntoTheLast())
    assert_same_training_step(
        model, lambda m: GPipe(m, [2, 1], devices=cpu_devices(2, threaded), chunks=3,
                               checkpoint=checkpoint), torch.randn(6, 4))

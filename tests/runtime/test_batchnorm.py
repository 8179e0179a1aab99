"""DeferredBatchNorm against nn.BatchNorm, without GPipe.

The property: feeding a mini-batch to a converted layer as ``chunks``
micro-batches (``torch.chunk``) normalizes each micro-batch as nn.BatchNorm
in training would, and leaves the running statistics exactly where
nn.BatchNorm would after one call on the whole mini-batch; recomputations
are not counted. Every expected value comes from an nn.BatchNorm reference.
"""
import copy
import re
from typing import Dict, List, Optional, Tuple, Type

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from torchgpipe.runtime.batchnorm import DeferredBatchNorm, restore_batch_norm
from torchgpipe.runtime.checkpoint import checkpoint, enable_recomputing

C = 3

# (BatchNorm class, input shape after (N, C)): 1d takes 2D and 3D inputs.
KINDS: Dict[str, Tuple[Type[_BatchNorm], Tuple[int, ...]]] = {
    '1d-2D': (nn.BatchNorm1d, ()),
    '1d-3D': (nn.BatchNorm1d, (5,)),
    '2d': (nn.BatchNorm2d, (4, 3)),
    '3d': (nn.BatchNorm3d, (2, 3, 2)),
}
MOMENTA = [0.1, None]


def make_input(kind: str, batch: int, *, scale: float = 2.0, offset: float = 1.5) -> Tensor:
    _, tail = KINDS[kind]
    # Per-channel offsets so that a mix-up between channels would show.
    shift = torch.arange(C, dtype=torch.float32).view([1, C] + [1] * len(tail))
    return torch.randn(batch, C, *tail) * scale + offset + shift


def make_bn(kind: str, momentum: Optional[float] = 0.1, affine: bool = True,
            track_running_stats: bool = True) -> _BatchNorm:
    cls, _ = KINDS[kind]
    bn = cls(C, momentum=momentum, affine=affine, track_running_stats=track_running_stats)
    if affine:
        # Non-trivial affine parameters, so that their use is checked too.
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1.0, 1.0)
    return bn


def convert(bn: nn.Module, chunks: int) -> nn.Module:
    """Converts a deep copy, so that ``bn`` stays an untouched reference."""
    return DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(bn), chunks)


def assert_same_stats(actual: _BatchNorm, expected: _BatchNorm) -> None:
    assert actual.running_mean is not None and expected.running_mean is not None
    assert actual.running_var is not None and expected.running_var is not None
    torch.testing.assert_close(actual.running_mean, expected.running_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(actual.running_var, expected.running_var, rtol=1e-6, atol=1e-6)
    assert torch.equal(actual.num_batches_tracked, expected.num_batches_tracked)


def is_accumulator(name: str) -> bool:
    """Whether a state dict key is one of the two accumulators
    DeferredBatchNorm adds to a BatchNorm layer's state, as torchgpipe 0.0.7 did."""
    return name.rsplit('.', 1)[-1] in ('sum', 'sum_squares')


def assert_same_state(actual: nn.Module, expected: nn.Module) -> None:
    """Parameters equal and buffers equal within float32 rounding; the
    deferred layers' accumulators are zeros between mini-batches."""
    expected_state = expected.state_dict()
    actual_state = actual.state_dict()
    assert [k for k in actual_state if not is_accumulator(k)] == list(expected_state)
    for name, value in actual_state.items():
        if is_accumulator(name):
            assert not value.any(), name
    for name, value in expected_state.items():
        torch.testing.assert_close(actual_state[name], value, rtol=1e-6, atol=1e-6, msg=name)


def batchnorm_output(bn: _BatchNorm, input: Tensor) -> Tensor:
    """What nn.BatchNorm in training mode returns for ``input``, without touching ``bn``."""
    return copy.deepcopy(bn).train()(input)


def feed(deferred: nn.Module, input: Tensor, chunks: int) -> List[Tensor]:
    return [deferred(micro_batch) for micro_batch in torch.chunk(input, chunks)]


# -- the property, per layer kind ----------------------------------------------------


@pytest.mark.parametrize('affine', [True, False])
@pytest.mark.parametrize('momentum', MOMENTA)
@pytest.mark.parametrize('kind', list(KINDS))
def test_micro_batch_outputs_equal_batchnorm(kind: str, momentum: Optional[float],
                                             affine: bool) -> None:
    bn = make_bn(kind, momentum, affine)
    chunks = 4
    deferred = convert(bn, chunks)
    x = make_input(kind, 16)

    for micro_batch in torch.chunk(x, chunks):
        # Training-mode normalization uses only the micro-batch's own
        # statistics, so bitwise equality is expected.
        assert torch.equal(deferred(micro_batch), batchnorm_output(bn, micro_batch))


@pytest.mark.parametrize('affine', [True, False])
@pytest.mark.parametrize('momentum', MOMENTA)
@pytest.mark.parametrize('kind', list(KINDS))
def test_running_stats_equal_full_batch(kind: str, momentum: Optional[float],
                                        affine: bool) -> None:
    bn = make_bn(kind, momentum, affine)
    chunks = 4
    deferred = convert(bn, chunks)
    assert isinstance(deferred, DeferredBatchNorm)
    initial = copy.deepcopy(bn.state_dict())
    x = make_input(kind, 16)

    micro_batches = torch.chunk(x, chunks)
    for i, micro_batch in enumerate(micro_batches):
        deferred(micro_batch)
        if i < chunks - 1:
            # Nothing is committed before the last micro-batch.
            state = deferred.state_dict()
            for name, value in initial.items():
                assert torch.equal(state[name], value), (i, name)

    bn(x)
    assert_same_stats(deferred, bn)


@pytest.mark.parametrize('momentum', MOMENTA)
@pytest.mark.parametrize('kind', list(KINDS))
def test_consecutive_mini_batches(kind: str, momentum: Optional[float]) -> None:
    bn = make_bn(kind, momentum)
    chunks = 3
    deferred = convert(bn, chunks)

    for step in range(3):
        # Different scales and offsets per step, so that the moving average
        # (or the cumulative one, for momentum=None) is really exercised.
        x = make_input(kind, 12, scale=1.0 + step, offset=-2.0 * step)
        feed(deferred, x, chunks)
        bn(x)
        assert_same_stats(deferred, bn)


@pytest.mark.parametrize('momentum', MOMENTA)
@pytest.mark.parametrize('kind', list(KINDS))
def test_eval_uses_committed_stats(kind: str, momentum: Optional[float]) -> None:
    bn = make_bn(kind, momentum)
    chunks = 4
    deferred = convert(bn, chunks)

    for _ in range(2):
        x = make_input(kind, 16)
        feed(deferred, x, chunks)
        bn(x)

    bn.eval()
    deferred.eval()
    state = copy.deepcopy(deferred.state_dict())
    x = make_input(kind, 8, offset=-3.0)
    torch.testing.assert_close(deferred(x), bn(x), rtol=1e-5, atol=1e-5)

    # Eval mode neither accumulates nor commits, whatever the number of calls.
    for _ in range(chunks):
        deferred(x)
    for name, value in deferred.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert deferred.counter == 0


def test_gradients_equal_batchnorm() -> None:
    bn = make_bn('2d')
    deferred = convert(bn, 2)
    x = make_input('2d', 8)

    for micro_batch in torch.chunk(x, 2):
        reference = copy.deepcopy(bn)
        x1 = micro_batch.clone().requires_grad_()
        x2 = micro_batch.clone().requires_grad_()
        (reference(x1) ** 3).sum().backward()
        deferred.zero_grad()
        (deferred(x2) ** 3).sum().backward()

        torch.testing.assert_close(x2.grad, x1.grad)
        for name, p in reference.named_parameters():
            torch.testing.assert_close(dict(deferred.named_parameters())[name].grad, p.grad)


def test_statistics_do_not_require_grad() -> None:
    deferred = convert(make_bn('2d'), 2)
    x = make_input('2d', 8).requires_grad_()
    feed(deferred, x, 2)
    assert not deferred.running_mean.requires_grad
    assert not deferred.running_var.requires_grad


def test_large_mean_small_spread() -> None:
    # Rounding the micro-batch means to float32 would dominate the variance
    # between micro-batches here; the committed variance must still match.
    bn = make_bn('2d', momentum=1.0)
    chunks = 8
    deferred = convert(bn, chunks)
    x = make_input('2d', 64, scale=0.01, offset=1000.0)
    feed(deferred, x, chunks)
    bn(x)
    assert_same_stats(deferred, bn)


# -- recomputation ------------------------------------------------------------------


@pytest.mark.parametrize('kind', list(KINDS))
def test_recomputation_does_not_accumulate(kind: str) -> None:
    bn = make_bn(kind, momentum=None)
    chunks = 4
    deferred = convert(bn, chunks)
    x = make_input(kind, 16)
    micro_batches = torch.chunk(x, chunks)

    for step in range(2):
        # The order GPipe produces with checkpoint='except_last': every
        # forward first, then the recomputations in reverse, each of which
        # must normalize like the first pass but count for nothing.
        outputs = [deferred(micro_batch) for micro_batch in micro_batches]
        state = copy.deepcopy(deferred.state_dict())
        with enable_recomputing():
            for i in reversed(range(chunks - 1)):
                assert torch.equal(deferred(micro_batches[i]), outputs[i])
                for name, value in deferred.state_dict().items():
                    assert torch.equal(value, state[name]), name
        bn(x)
        assert_same_stats(deferred, bn)


def test_recomputation_between_forwards_does_not_accumulate() -> None:
    # A recomputation of the previous step may interleave with the forwards
    # of the next one; it must not shift the commit point.
    bn = make_bn('2d')
    chunks = 3
    deferred = convert(bn, chunks)
    x = make_input('2d', 12)
    micro_batches = torch.chunk(x, chunks)

    deferred(micro_batches[0])
    with enable_recomputing():
        deferred(micro_batches[0])
        deferred(micro_batches[0])
    deferred(micro_batches[1])
    with enable_recomputing():
        deferred(micro_batches[1])
    assert deferred.num_batches_tracked.item() == 0
    deferred(micro_batches[2])

    bn(x)
    assert_same_stats(deferred, bn)


def test_real_checkpoint_recomputation() -> None:
    bn = make_bn('2d')
    chunks = 2
    deferred = convert(bn, chunks)
    x = make_input('2d', 8)

    for micro_batch in torch.chunk(x, chunks):
        output = checkpoint(deferred, micro_batch.clone().requires_grad_())
        assert isinstance(output, Tensor)
        # The backward recomputes the forward under is_recomputing().
        output.sum().backward()

    bn(x)
    assert_same_stats(deferred, bn)


# -- other modes ----------------------------------------------------------------------


@pytest.mark.parametrize('kind', list(KINDS))
def test_without_running_stats_behaves_like_batchnorm(kind: str) -> None:
    bn = make_bn(kind, track_running_stats=False)
    deferred = DeferredBatchNorm(C, track_running_stats=False)
    deferred.load_state_dict(bn.state_dict())
    assert deferred.running_mean is None and deferred.running_var is None

    for mode in (True, False):
        bn.train(mode)
        deferred.train(mode)
        for micro_batch in torch.chunk(make_input(kind, 8), 2):
            assert torch.equal(deferred(micro_batch), bn(micro_batch))
    assert deferred.counter == 0


def test_eval_before_training_equals_batchnorm() -> None:
    bn = make_bn('2d').eval()
    deferred = convert(bn, 2)
    x = make_input('2d', 4)
    assert torch.equal(deferred(x), bn(x))


def test_one_value_per_channel_fails_like_batchnorm() -> None:
    bn = make_bn('1d-2D')
    deferred = convert(bn, 2)
    with pytest.raises(ValueError):
        bn(torch.randn(1, C))
    with pytest.raises(ValueError):
        deferred(torch.randn(1, C))
    # A failed call is not counted.
    assert deferred.counter == 0

    x = make_input('1d-2D', 8)
    feed(deferred, x, 2)
    bn = make_bn('1d-2D')
    bn(x)
    assert_same_stats(deferred, bn)


def test_empty_batch_like_batchnorm() -> None:
    bn = make_bn('2d')
    deferred = convert(bn, 1)
    x = make_input('2d', 0)
    assert torch.equal(deferred(x), bn(x))
    assert_same_stats(deferred, bn)


@pytest.mark.parametrize('dim', [1, 6])
def test_input_dim_is_checked(dim: int) -> None:
    deferred = DeferredBatchNorm(C)
    with pytest.raises(ValueError, match='input'):
        deferred(torch.randn([2, C, 2, 2, 2, 2][:dim]))


@pytest.mark.parametrize('chunks, error', [
    (0, ValueError), (-1, ValueError), (1.5, ValueError), (True, TypeError), ('2', TypeError),
])
def test_chunks_must_be_positive_int(chunks: object, error: type) -> None:
    # The same policy as GPipe's chunks: a wrong type is a TypeError.
    with pytest.raises(error, match=re.escape(f'(chunks: {chunks!r}); ')):
        DeferredBatchNorm(C, chunks=chunks)
    with pytest.raises(error, match=re.escape(f'(chunks: {chunks!r}); ')):
        DeferredBatchNorm.convert_deferred_batch_norm(nn.BatchNorm1d(C),
                                                      chunks)


def test_constructor() -> None:
    deferred = DeferredBatchNorm(C, 1e-3, None, False, 4, track_running_stats=True)
    assert (deferred.num_features, deferred.eps, deferred.momentum, deferred.affine,
            deferred.chunks, deferred.track_running_stats) == (C, 1e-3, None, False, 4, True)
    assert 'chunks=4' in repr(deferred)

    # torchgpipe 0.0.7's keys: a BatchNorm layer's and its two accumulators.
    bn = nn.BatchNorm2d(C)
    assert list(DeferredBatchNorm(C).state_dict()) == list(bn.state_dict()) + ['sum',
                                                                                 'sum_squares']


# -- conversion -------------------------------------------------------------------------


class Block(nn.Module):
    """A custom module holding a BatchNorm, to test the recursion."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, C, 1)
        self.inner = nn.Sequential(nn.ReLU(), nn.BatchNorm2d(C, momentum=None))

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(self.conv(x))


def nested_model() -> nn.Sequential:
    """BatchNorm layers at several depths, for the structural checks."""
    return nn.Sequential(nn.BatchNorm2d(C), Block(), nn.Conv2d(C, C, 1), nn.BatchNorm2d(C))


def batchnorms(module: nn.Module) -> Dict[str, _BatchNorm]:
    return {name: m for name, m in module.named_modules() if isinstance(m, _BatchNorm)}


def test_nested_module() -> None:
    # One BatchNorm on the path, inside a custom module inside a Sequential:
    # a second one downstream would see micro-batches normalized by their own
    # statistics, so its full-batch reference would not be the unwrapped
    # model's by design.
    model = nn.Sequential(nn.Conv2d(C, C, 1), Block(), nn.ReLU())
    chunks = 4
    converted = convert(model, chunks)
    assert isinstance(converted[1].inner[1], DeferredBatchNorm)
    assert converted[1].inner[1].chunks == chunks

    for step in range(2):
        x = make_input('2d', 16, scale=1.0 + step)
        expected = torch.cat([copy.deepcopy(model)(micro_batch)
                              for micro_batch in torch.chunk(x, chunks)])
        actual = torch.cat(feed(converted, x, chunks))
        torch.testing.assert_close(actual, expected, rtol=0, atol=0)
        model(x)
        assert_same_state(converted, model)

    model.eval()
    converted.eval()
    x = make_input('2d', 4)
    torch.testing.assert_close(converted(x), model(x), rtol=1e-5, atol=1e-5)


def test_convert_finds_every_batchnorm() -> None:
    converted = convert(nested_model(), 4)
    assert set(batchnorms(converted)) == {'0', '1.inner.1', '3'}
    for layer in batchnorms(converted).values():
        assert isinstance(layer, DeferredBatchNorm)
        assert layer.chunks == 4


@pytest.mark.parametrize('kind', list(KINDS))
@pytest.mark.parametrize('momentum', MOMENTA)
@pytest.mark.parametrize('affine', [True, False])
@pytest.mark.parametrize('track_running_stats', [True, False])
def test_convert_keeps_everything(kind: str, momentum: Optional[float], affine: bool,
                                  track_running_stats: bool) -> None:
    bn = make_bn(kind, momentum, affine, track_running_stats)
    bn.eps = 1e-3
    if not track_running_stats:
        # Nothing to defer: left as it is, as torchgpipe 0.0.7 does.
        assert DeferredBatchNorm.convert_deferred_batch_norm(bn, 3) is bn
        assert type(bn) is KINDS[kind][0]
        return
    bn(make_input(kind, 8))
    bn.eval()
    params = dict(bn.named_parameters())
    buffers = dict(bn.named_buffers())
    state = copy.deepcopy(bn.state_dict())

    deferred = DeferredBatchNorm.convert_deferred_batch_norm(bn, 3)

    # The root itself is a BatchNorm: a new module comes back.
    assert isinstance(deferred, DeferredBatchNorm)
    assert deferred is not bn
    assert deferred.chunks == 3
    assert (deferred.num_features, deferred.eps, deferred.momentum, deferred.affine,
            deferred.track_running_stats, deferred.training) == \
        (C, 1e-3, momentum, affine, True, False)

    # Same Parameter and buffer objects: an optimizer made earlier still works.
    assert dict(deferred.named_parameters()).keys() == params.keys()
    for name, p in deferred.named_parameters():
        assert p is params[name], name
    assert dict(deferred.named_buffers()).keys() == buffers.keys()
    for name, b in deferred.named_buffers():
        assert b is buffers[name], name
    for name, value in state.items():
        assert torch.equal(deferred.state_dict()[name], value), name


def test_convert_in_place_and_returns_module() -> None:
    model = nested_model()
    params = list(model.parameters())
    buffers = list(model.buffers())

    converted = DeferredBatchNorm.convert_deferred_batch_norm(model, 2)

    assert converted is model
    assert isinstance(model[0], DeferredBatchNorm)
    assert isinstance(model[1].inner[1], DeferredBatchNorm)
    assert model[1].inner[1].momentum is None
    assert [id(p) for p in model.parameters()] == [id(p) for p in params]
    assert [id(b) for b in model.buffers()] == [id(b) for b in buffers]


def test_convert_replaces_deferred_layers_of_other_chunks_only() -> None:
    # As torchgpipe 0.0.7 does: a deferred layer is kept only if it already
    # commits after the number of micro-batches asked for.
    same, other = DeferredBatchNorm(C, chunks=2), DeferredBatchNorm(C, chunks=5)
    model = nn.Sequential(nn.Linear(C, C), same, other, nn.LayerNorm(C))
    before = list(model)
    DeferredBatchNorm.convert_deferred_batch_norm(model, 2)
    assert [model[0], model[1], model[3]] == [before[0], same, before[3]]
    assert isinstance(model[2], DeferredBatchNorm) and model[2] is not other
    assert model[2].chunks == 2
    # Shared, not copied, as in the conversion of a plain BatchNorm layer.
    for name, value in [*other.named_parameters(), *other.named_buffers()]:
        assert getattr(model[2], name) is value, name


def test_reconversion_to_other_chunks_commits_once_per_new_mini_batch() -> None:
    bn = make_bn('2d')
    deferred = convert(bn, 2)
    chunks = 3
    reconverted = DeferredBatchNorm.convert_deferred_batch_norm(deferred, chunks)
    for step in range(2):
        x = make_input('2d', 12, offset=float(step))
        for micro_batch in torch.chunk(x, chunks):
            assert torch.equal(reconverted(micro_batch), batchnorm_output(bn, micro_batch))
        bn(x)
        assert_same_stats(reconverted, bn)
    assert reconverted is not deferred and deferred.chunks == 2


def test_reconverted_layer_is_restored_to_the_original_class() -> None:
    model = nn.Sequential(nn.BatchNorm1d(C))
    DeferredBatchNorm.convert_deferred_batch_norm(model, 2)
    DeferredBatchNorm.convert_deferred_batch_norm(model, 4)
    assert model[0].chunks == 4
    restore_batch_norm(model)
    assert type(model[0]) is nn.BatchNorm1d


def test_convert_shared_batchnorm_once() -> None:
    shared = nn.BatchNorm1d(C)
    model = nn.Sequential(nn.Sequential(shared), nn.Sequential(shared))
    DeferredBatchNorm.convert_deferred_batch_norm(model, 2)
    assert isinstance(model[0][0], DeferredBatchNorm)
    assert model[0][0] is model[1][0]


def test_convert_batchnorm_without_bias() -> None:
    try:
        bn = nn.BatchNorm2d(C, bias=False)
    except TypeError:
        pytest.skip('this PyTorch has no BatchNorm(bias=False)')
    deferred = convert(bn, 2)
    assert deferred.bias is None
    x = make_input('2d', 8)
    for micro_batch in torch.chunk(x, 2):
        assert torch.equal(deferred(micro_batch), batchnorm_output(bn, micro_batch))
    bn(x)
    assert_same_stats(deferred, bn)

    assert DeferredBatchNorm(C, bias=False).bias is None


def test_convert_uninitialized_lazy_batchnorm_fails() -> None:
    with pytest.raises(ValueError, match=re.escape('(module: LazyBatchNorm2d); ')):
        DeferredBatchNorm.convert_deferred_batch_norm(nn.LazyBatchNorm2d(), 2)


def test_failed_conversion_leaves_the_module_untouched() -> None:
    # The lazy layer comes last: every BatchNorm before it is checked first.
    model = nn.Sequential(make_bn('2d'), nn.Sequential(nn.ReLU(), make_bn('2d')),
                          nn.LazyBatchNorm2d())
    layers = [(name, type(m), id(m)) for name, m in model.named_modules()]
    with pytest.raises(ValueError, match=re.escape('(module.2: LazyBatchNorm2d); ')):
        DeferredBatchNorm.convert_deferred_batch_norm(model, 2)
    assert [(name, type(m), id(m)) for name, m in model.named_modules()] == layers


def test_convert_initialized_lazy_batchnorm() -> None:
    bn = nn.LazyBatchNorm2d()
    bn(make_input('2d', 4))
    deferred = convert(bn, 2)
    assert isinstance(deferred, DeferredBatchNorm)
    x = make_input('2d', 8)
    feed(deferred, x, 2)
    bn(x)
    assert_same_stats(deferred, bn)


def test_convert_keeps_dtype() -> None:
    bn = make_bn('2d').double()
    deferred = convert(bn, 2)
    assert deferred.weight.dtype == torch.float64
    assert deferred.running_mean.dtype == torch.float64
    x = make_input('2d', 8).double()
    feed(deferred, x, 2)
    bn(x)
    assert_same_stats(deferred, bn)


# -- sweep ------------------------------------------------------------------------------


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(list(KINDS)),
       batch=st.integers(1, 17),
       chunks=st.integers(1, 6),
       momentum=st.sampled_from([0.1, 0.5, None]),
       affine=st.booleans(),
       steps=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_sweep(kind: str, batch: int, chunks: int, momentum: Optional[float], affine: bool,
               steps: int, seed: int) -> None:
    torch.manual_seed(seed)
    bn = make_bn(kind, momentum, affine)
    x0 = make_input(kind, batch)
    # torch.chunk may return fewer micro-batches than asked; the layer must
    # be told how many calls make a mini-batch.
    chunks = len(torch.chunk(x0, chunks))
    # nn.BatchNorm refuses one value per channel in training.
    assume(all(m[:, 0].numel() > 1 for m in torch.chunk(x0, chunks)))
    deferred = convert(bn, chunks)
    assert isinstance(deferred, DeferredBatchNorm)

    for step in range(steps):
        x = x0 if step == 0 else make_input(kind, batch, offset=float(step))
        with torch.no_grad():
            for micro_batch in torch.chunk(x, chunks):
                assert torch.equal(deferred(micro_batch), batchnorm_output(bn, micro_batch))
            bn(x)
        assert_same_stats(deferred, bn)

"""GPipe.train_step: the gradients of the unwrapped model, by any schedule, on either path.

Every built-in schedule (test_schedules.py checks them as data) and schedules
of one's own: every parameter's gradient and the loss equal the unwrapped
model's, the order each worker ran its actions in is the schedule's (from the
timeline), and a failure anywhere ends the step cleanly.
"""
import copy
import gc
import random
import re
import weakref
from typing import Any, Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from helpers import (CHECKPOINT_MODES, OnBackward, PopAdd, Stash, cpu_devices, mlp,
                     random_order, schedule_devices)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import torchgpipe
from torchgpipe import GPipe
from torchgpipe.engine.generators import SCHEDULES, named, resolve
from torchgpipe.runtime.batchnorm import DeferredBatchNorm
from torchgpipe.skip import Namespace

# -- gradients ----------------------------------------------------------------------


def named_grads(module: nn.Module) -> Dict[str, Tensor]:
    """Gradients by the unwrapped model's names ('partitions.<j>.' dropped)."""
    grads = {name: p.grad for name, p in module.named_parameters() if p.grad is not None}
    if isinstance(module, GPipe):
        grads = {name.split('.', 2)[2]: grad for name, grad in grads.items()}
    return grads


def assert_train_step_as_unwrapped(model: nn.Sequential, input: Any, target: Tensor,
                                   loss_fn: Callable[[Any, Tensor], Tensor],
                                   reduction: str = 'mean', **options: Any) -> GPipe:
    reference = copy.deepcopy(model)
    expected = loss_fn(reference(input), target)
    expected.backward()
    schedule = options.pop('schedule', '1f1b')
    gpipe = GPipe(model, **options)
    loss = gpipe.train_step(input, target, loss_fn, schedule=schedule, reduction=reduction)
    assert loss.grad_fn is None
    assert loss.device == torch.empty(0, device=gpipe.devices[-1]).device
    torch.testing.assert_close(loss.cpu(), expected.detach().cpu())
    expected_grads = named_grads(reference)
    actual_grads = named_grads(gpipe)
    assert actual_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        torch.testing.assert_close(actual_grads[name].cpu(), grad.cpu(), msg=name)
    return gpipe


@pytest.mark.parametrize('chunks', [2, 4, 5])
@pytest.mark.parametrize('schedule', SCHEDULES)
def test_gradients_of_the_unwrapped_model(schedule: str, chunks: int, checkpoint: str,
                                          threaded: bool) -> None:
    torch.manual_seed(0)
    model = mlp(4, 8, 8, 8, 3)
    # 10 samples in 2, 4 or 5 chunks on 4 partitions: m < p, m not a multiple
    # of p (3, 3, 3 and 1, weighted so), m = p.
    assert_train_step_as_unwrapped(model, torch.randn(10, 4), torch.randn(10, 3), F.mse_loss,
                                   balance=[2, 2, 2, 2], devices=schedule_devices(schedule, 4,
                                                                                threaded),
                                   chunks=chunks, checkpoint=checkpoint, schedule=schedule)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_gradients_for_any_model_balance_and_chunks(data: st.DataObject) -> None:
    widths = data.draw(st.lists(st.integers(1, 6), min_size=2, max_size=6), label='widths')
    model = mlp(*widths)
    n = data.draw(st.integers(1, min(4, len(model))), label='partitions')
    cuts = sorted(data.draw(st.sets(st.integers(1, len(model) - 1), min_size=n - 1,
                                    max_size=n - 1), label='cuts')) if n > 1 else []
    bounds = [0, *cuts, len(model)]
    balance = [b - a for a, b in zip(bounds, bounds[1:])]
    batch = data.draw(st.integers(1, 9), label='batch')
    threaded = data.draw(st.booleans(), label='threaded')
    schedule = data.draw(st.sampled_from([s for s in SCHEDULES if s != 'zbv' or n % 2 == 0]),
                         label='schedule')
    torch.manual_seed(data.draw(st.integers(0, 2**16), label='seed'))
    assert_train_step_as_unwrapped(
        model, torch.randn(batch, widths[0]), torch.randn(batch, widths[-1]), F.mse_loss,
        balance=balance, devices=schedule_devices(schedule, n, threaded),
        chunks=data.draw(st.integers(1, 5), label='chunks'),
        checkpoint=data.draw(st.sampled_from(CHECKPOINT_MODES),
                             label='checkpoint'),
        schedule=schedule)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_schedule_of_ones_own_any_valid_order(data: st.DataObject) -> None:
    # Random valid orders: any action of any worker once what it waits for
    # ran, backward passes whole or split, partitions placed anywhere;
    # skips from partition 0 to 3 and within 2, a checkpoint mode, a path.
    m = data.draw(st.integers(1, 5), label='m')
    p = data.draw(st.integers(1, 3), label='workers')
    placement = [data.draw(st.integers(0, p - 1), label=f'worker of {j}') for j in range(4)]
    placement = [sorted(set(placement)).index(w) for w in placement]
    split = [data.draw(st.booleans(), label=f'split {j}') for j in range(4)]
    schedule = random_order(m, 4, placement, split,
                            random.Random(data.draw(st.integers(0, 2**16), label='seed')))
    threaded = data.draw(st.booleans(), label='threaded')
    devices = [f'cpu:{w}' if threaded else 'cpu' for w in placement]
    far, near = Namespace(), Namespace()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Stash().isolate(far), nn.Linear(4, 4), nn.Tanh(),
                          Stash().isolate(near), nn.Linear(4, 4), PopAdd().isolate(near),
                          nn.Linear(4, 4), PopAdd().isolate(far), nn.Linear(4, 2))
    assert_train_step_as_unwrapped(
        model, torch.randn(2 * m, 4), torch.randn(2 * m, 2), F.mse_loss,
        balance=[2, 2, 3, 3], devices=devices, chunks=m,
        checkpoint=data.draw(st.sampled_from(CHECKPOINT_MODES), label='checkpoint'),
        schedule=str(schedule) if data.draw(st.booleans(), label='as text') else schedule)


class HalvingMul(torch.autograd.Function):
    """x * w, whose backward halves its incoming gradient in place (and doubles back):
    right in one backward pass, wrong if run twice on the same gradient."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, w: Tensor) -> Tensor:
        ctx.save_for_backward(x, w)
        return x * w

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, Tensor]:
        x, w = ctx.saved_tensors
        grad.mul_(0.5)
        return grad * w * 2, (grad * x * 2).sum(0)


class Stop(torch.autograd.Function):
    """Lets no gradient through: the Function before it gets none, and makes it zeros."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> None:
        return None


class Custom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4))
        self.v = nn.Parameter(torch.randn(4))
        self.linear = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        stopped = Stop.apply(HalvingMul.apply(x, self.v))
        return self.linear(HalvingMul.apply(torch.tanh(x), self.w)) + stopped


class Reentrant(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return torch.utils.checkpoint.checkpoint(super().forward, x, use_reentrant=True)


class Retained(nn.Linear):
    """Its output retains its gradient, which a split backward pass must not add twice."""

    outputs: List[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        if y.requires_grad:
            y.retain_grad()
            Retained.outputs.append(y)
        return y


# The first pass of a checkpointed micro-batch runs without grad, which the
# reentrant checkpoint warns about, as it does in the forward path.
@pytest.mark.filterwarnings('ignore:None of the inputs have requires_grad')
@pytest.mark.parametrize('schedule', ['zb_h1', 'zbv'])
def test_split_backward_of_what_must_run_once(schedule: str, checkpoint: str,
                                              threaded: bool) -> None:
    # A custom Function's backward runs once, given no gradient as a whole
    # pass gives it (zeros, not None); a reentrant checkpoint inside a
    # partition; an output that retains its gradient.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Custom(), Reentrant(4, 4), Retained(4, 4))
    gpipe = assert_train_step_as_unwrapped(
        model, torch.randn(6, 4), torch.randn(6, 4), F.mse_loss, balance=[1, 1, 1, 1],
        devices=schedule_devices(schedule, 4, threaded), chunks=3, checkpoint=checkpoint,
        schedule=schedule)
    assert torch.equal(gpipe.partitions[1][0].v.grad, torch.zeros(4))
    Retained.outputs.clear()
    gpipe.zero_grad()
    plain = copy.deepcopy(gpipe)
    input, target = torch.randn(6, 4), torch.randn(6, 4)
    plain.train_step(input, target, F.mse_loss, schedule='1f1b')
    expected = [y.grad for y in Retained.outputs]
    Retained.outputs.clear()
    gpipe.train_step(input, target, F.mse_loss, schedule=schedule)
    assert len(Retained.outputs) == len(expected) > 0
    for y, grad in zip(Retained.outputs, expected):
        torch.testing.assert_close(y.grad, grad)
    Retained.outputs.clear()


def test_summed_loss(threaded: bool) -> None:
    torch.manual_seed(0)
    assert_train_step_as_unwrapped(
        mlp(3, 5, 2), torch.randn(7, 3), torch.randn(7, 2),
        lambda output, target: F.mse_loss(output, target, reduction='sum'), reduction='sum',
        balance=[2, 2], devices=cpu_devices(2, threaded), chunks=3)


def test_the_loss_reads_the_users_target_in_place(threaded: bool) -> None:
    """On CPU devices, each micro-batch's target is a view of the user's tensor, as the
    unwrapped model's loss reads it: no copy of it per micro-batch ('cpu:1' is in the
    memory of 'cpu' too)."""
    target = torch.randn(8, 2)
    seen: List[int] = []

    def loss_fn(output: Tensor, micro_target: Tensor) -> Tensor:
        seen.append(micro_target.untyped_storage().data_ptr())
        return F.mse_loss(output, micro_target)

    pipe = GPipe(mlp(3, 5, 2), balance=[2, 2], devices=cpu_devices(2, threaded), chunks=4)
    pipe.train_step(torch.randn(8, 3), target, loss_fn)
    assert len(seen) >= 4 and set(seen) == {target.untyped_storage().data_ptr()}


def test_cross_entropy_and_tuples(threaded: bool) -> None:
    class Pair(nn.Module):
        def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
            return x.tanh(), x.sigmoid()

    class Join(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(8, 5)

        def forward(self, pair: Tuple[Tensor, Tensor]) -> Tensor:
            return self.linear(pair[0] * pair[1])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), Pair(), Join())
    assert_train_step_as_unwrapped(model, torch.randn(9, 6), torch.randint(5, (9,)),
                                   F.cross_entropy, balance=[2, 1],
                                   devices=cpu_devices(2, threaded), chunks=4)


@pytest.mark.parametrize('schedule', SCHEDULES)
@pytest.mark.parametrize('checkpoint', ['always', 'never'])
def test_skips_across_and_within_partitions(schedule: str, checkpoint: str,
                                            threaded: bool) -> None:
    far, near = Namespace(), Namespace()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Stash().isolate(far), nn.Linear(4, 4), nn.Tanh(),
                          Stash().isolate(near), nn.Linear(4, 4), PopAdd().isolate(near),
                          nn.Linear(4, 4), PopAdd().isolate(far), nn.Linear(4, 2))
    # far: from partition 0 to 3; near: within partition 2.
    assert_train_step_as_unwrapped(model, torch.randn(8, 4), torch.randn(8, 2), F.mse_loss,
                                   balance=[2, 2, 3, 3],
                                   devices=schedule_devices(schedule, 4, threaded),
                                   chunks=4, checkpoint=checkpoint, schedule=schedule)


@pytest.mark.parametrize('schedule', SCHEDULES)
@pytest.mark.parametrize('checkpoint', ['always', 'never'])
def test_tied_weights_across_partitions(schedule: str, checkpoint: str, threaded: bool) -> None:
    # Each shared parameter's gradient counted once, by every schedule (ZBV
    # puts the embedding and the head on one worker, as two partitions).
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 6)
    head = nn.Linear(6, 10)
    head.weight = embedding.weight
    model = nn.Sequential(embedding, nn.Linear(6, 6), nn.Tanh(), head)
    tokens = torch.randint(10, (8,))
    assert_train_step_as_unwrapped(model, tokens, torch.randint(10, (8,)), F.cross_entropy,
                                   balance=[1, 1, 1, 1],
                                   devices=schedule_devices(schedule, 4, threaded), chunks=4,
                                   checkpoint=checkpoint, schedule=schedule)


class Twice(nn.Module):
    """One weight used before and after a layer that depends on the input."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.other = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        y = self.other(torch.tanh(self.linear(x)))
        return self.linear(y) + self.other.bias.sum()


class Hooked(nn.Linear):
    """A hook on its output, whose node also computes the weight's gradient: a split
    backward pass starts W there again, and must not apply the hook twice."""

    def forward(self, x: Tensor) -> Tensor:
        y = super().forward(x)
        if y.requires_grad:  # not in a checkpointed first pass
            y.register_hook(lambda grad: grad * 2)
        return y


@pytest.mark.parametrize('schedule', ['zb_h1', 'zbv'])
def test_split_backward_of_shared_weights_and_hooks(schedule: str, checkpoint: str,
                                                    threaded: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(Hooked(4, 4), Twice(), Hooked(4, 4), Twice())
    assert_train_step_as_unwrapped(model, torch.randn(6, 4), torch.randn(6, 4), F.mse_loss,
                                   balance=[1, 1, 1, 1],
                                   devices=schedule_devices(schedule, 4, threaded), chunks=3,
                                   checkpoint=checkpoint, schedule=schedule)


def test_a_model_flattened_by_to_sequential(threaded: bool) -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(5, 5)
            self.b = nn.Linear(5, 5)
            self.out = nn.Linear(5, 2)

        def forward(self, x: Tensor) -> Tensor:
            h = torch.relu(self.a(x))
            return self.out(h + self.b(h).tanh())

    torch.manual_seed(0)
    flat = torchgpipe.to_sequential(Residual())
    assert_train_step_as_unwrapped(flat, torch.randn(6, 5), torch.randn(6, 2), F.mse_loss,
                                   balance=[2, len(flat) - 2], devices=cpu_devices(2, threaded),
                                   chunks=3)


def test_in_place_first_layers(threaded: bool) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4),
                          nn.ReLU(inplace=True), nn.Linear(4, 4))
    for _ in range(2):  # the first step learns, the second relies on it
        assert_train_step_as_unwrapped(model, torch.randn(6, 4), torch.randn(6, 4), F.mse_loss,
                                       balance=[1, 2, 2], devices=cpu_devices(3, threaded),
                                       chunks=3, checkpoint='always')
        model.zero_grad()


def forward_path_step(gpipe: GPipe, input: Tensor, target: Tensor,
                      loss_fn: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    loss = loss_fn(gpipe(input), target)
    loss.backward()
    return loss.detach()


@pytest.mark.parametrize('schedule', SCHEDULES)
def test_deferred_batch_norm_as_the_forward_path(schedule: str, threaded: bool) -> None:
    # Batch norm in training normalizes each micro-batch: the reference is
    # GPipe's own forward path, which the other tests hold to the unwrapped model.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 6),
                          nn.BatchNorm1d(6), nn.Linear(6, 2))
    options = dict(balance=[2, 1, 2, 1], devices=schedule_devices(schedule, 4, threaded),
                   chunks=4, deferred_batch_norm=True)
    stepped = GPipe(copy.deepcopy(model), **options)
    forwarded = GPipe(copy.deepcopy(model), **options)
    input, target = torch.randn(16, 4), torch.randn(16, 2)
    for _ in range(2):
        loss = stepped.train_step(input, target, F.mse_loss, schedule=schedule)
        expected = forward_path_step(forwarded, input, target, F.mse_loss)
        torch.testing.assert_close(loss, expected)
    assert any(isinstance(m, DeferredBatchNorm) for m in stepped.modules())
    for (name, a), b in zip(stepped.state_dict().items(), forwarded.state_dict().values()):
        torch.testing.assert_close(a, b, msg=name)
    for (name, a), b in zip(stepped.named_parameters(), forwarded.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


def dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.3),
                         nn.Linear(8, 2))


def noisy_mse(output: Tensor, target: Tensor) -> Tensor:
    """A loss that draws random numbers: the target, jittered."""
    return F.mse_loss(output, target + 0.01 * torch.randn_like(target))


def dropout_mse(output: Tensor, target: Tensor) -> Tensor:
    """A loss with dropout in it."""
    return F.mse_loss(F.dropout(output, 0.5), target)


def plain_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(),
                         nn.Linear(8, 2))


@pytest.mark.parametrize('schedule', SCHEDULES)
@pytest.mark.parametrize('model, loss_fn', [
    (dropout_model, F.mse_loss),
    (plain_model, noisy_mse),
    (plain_model, dropout_mse),
    (dropout_model, noisy_mse),
], ids=['dropout-in-model', 'randn-in-loss', 'dropout-in-loss', 'both'])
@pytest.mark.slow
def test_random_draws_are_the_same_on_both_paths(
        schedule: str, checkpoint: str, model: Callable[[], nn.Sequential],
        loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
    # The loss is part of the last partition's work: its draws take turns
    # with the partitions' on threads, as on one thread. What the forward
    # path learned about the partitions, without a loss, must not mislead.
    input, target = torch.randn(8, 4), torch.randn(8, 2)
    # The same schedule on both paths (interleaved 1F1B's depends on the devices).
    plan = resolve(schedule, 4, 4, schedule_devices(schedule, 4, True))
    results = []
    for threaded in (False, True):
        gpipe = GPipe(model(), balance=[2, 1, 1, 1],
                      devices=schedule_devices(schedule, 4, threaded), chunks=4,
                      checkpoint=checkpoint)
        torch.manual_seed(1)
        forward_path_step(gpipe, input, target, F.mse_loss)
        losses = [gpipe.train_step(input, target, loss_fn, schedule=plan) for _ in range(3)]
        results.append((losses, named_grads(gpipe), torch.get_rng_state()))
    (losses1, grads1, state1), (losses2, grads2, state2) = results
    assert all(torch.equal(a, b) for a, b in zip(losses1, losses2))
    assert grads1.keys() == grads2.keys()
    assert all(torch.equal(grads1[k], grads2[k]) for k in grads1)
    assert torch.equal(state1, state2)


def test_fill_drain_draws_what_the_forward_path_draws(checkpoint: str, threaded: bool) -> None:
    # Both issue forward passes in GPipe's clock cycles.
    input, target = torch.randn(8, 4), torch.randn(8, 2)
    options = dict(balance=[2, 2, 1], devices=cpu_devices(3, threaded), chunks=4,
                   checkpoint=checkpoint)
    stepped = GPipe(dropout_model(), **options)
    forwarded = GPipe(dropout_model(), **options)
    torch.manual_seed(1)
    loss = stepped.train_step(input, target, F.mse_loss, schedule='fill_drain')
    torch.manual_seed(1)
    expected = forward_path_step(forwarded, input, target, F.mse_loss)
    torch.testing.assert_close(loss, expected)
    for (name, a), b in zip(stepped.named_parameters(), forwarded.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)


# -- order, from the timeline ------------------------------------------------------


KINDS = {'forward': 'F', 'backward': 'B', 'input': 'I', 'weight': 'W'}


@pytest.mark.parametrize('schedule', SCHEDULES)
@pytest.mark.parametrize('checkpoint', ['always', 'never'])
def test_each_worker_runs_its_actions_in_schedule_order(schedule: str, checkpoint: str,
                                                        threaded: bool) -> None:
    m, n = 6, 4
    devices = schedule_devices(schedule, n, threaded)
    gpipe = GPipe(mlp(4, 4, 4, 4, 4), balance=[2, 2, 2, 2], devices=devices, chunks=m,
                  checkpoint=checkpoint)
    with torchgpipe.trace(gpipe) as timeline:
        gpipe.train_step(torch.randn(12, 4), torch.randn(12, 4), F.mse_loss, schedule=schedule)
    events = timeline.events
    by_action = {(KINDS.get(e.kind), e.micro_batch, e.partition): e for e in events}
    plan = named(schedule, m, n, len(set(devices)))
    for actions in plan.workers:
        mine = {a.j for a in actions}
        ran = sorted((e for e in events if e.partition in mine and e.kind in KINDS),
                     key=lambda e: e.start)
        assert [f'{e.partition}{KINDS[e.kind]}{e.micro_batch}' for e in ran] == \
            [str(a) for a in actions]
        # An action's event is its work, not its wait for another worker: it
        # begins once what it needs has come.
        for e in ran:
            i, j, kind = e.micro_batch, e.partition, KINDS[e.kind]
            if kind == 'F' and j > 0:
                assert e.start >= by_action[('F', i, j - 1)].end
            if kind in 'BI' and j < n - 1:
                sender = by_action.get(('B', i, j + 1)) or by_action[('I', i, j + 1)]
                assert e.start >= sender.end
            if kind == 'W':
                assert e.start >= by_action[('I', i, j)].end
    # Recomputed once per checkpointed micro-batch, before its B or I.
    for j in range(n):
        recompute = [e for e in events if e.partition == j and e.kind == 'recompute']
        if checkpoint == 'always':
            assert sorted(e.micro_batch for e in recompute) == list(range(m))
            for e in recompute:
                backward = by_action.get(('B', e.micro_batch, j)) or \
                    by_action[('I', e.micro_batch, j)]
                assert e.end <= backward.start
        else:
            assert recompute == []


# -- failures --------------------------------------------------------------------


class Fail(nn.Module):
    """Raises in the forward or the backward pass of its ``at``-th call, once."""

    def __init__(self, at: int, where: str) -> None:
        super().__init__()
        self.at: Optional[int] = at
        self.where = where
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls - 1 != self.at:
            return x
        self.at = None
        if self.where == 'forward':
            raise ValueError('planned failure')
        return OnBackward.apply(x, fail_backward)


def fail_backward() -> None:
    raise KeyError('planned failure in backward')


@pytest.mark.parametrize('where', ['forward', 'backward'])
@pytest.mark.parametrize('j', [0, 1, 3])
@pytest.mark.parametrize('schedule', SCHEDULES)
def test_a_failure_reaches_the_caller_and_the_next_step_works(where: str, j: int, schedule: str,
                                                              threaded: bool) -> None:
    layers: List[nn.Module] = [nn.Linear(4, 4) for _ in range(4)]
    layers.insert(j + 1, Fail(at=2, where=where))
    gpipe = GPipe(nn.Sequential(*layers), balance=[2 if k == j else 1 for k in range(4)],
                  devices=schedule_devices(schedule, 4, threaded), chunks=4, checkpoint='never')
    input, target = torch.randn(8, 4), torch.randn(8, 4)
    error = ValueError if where == 'forward' else KeyError
    with pytest.raises(error, match='planned failure'):
        gpipe.train_step(input, target, F.mse_loss, schedule=schedule)
    gpipe.zero_grad()
    reference = copy.deepcopy(gpipe).unwrap()
    loss = gpipe.train_step(input, target, F.mse_loss, schedule=schedule)
    expected = F.mse_loss(reference(input), target)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())


# -- usage ---------------------------------------------------------------------


def small() -> GPipe:
    return GPipe(mlp(2, 2, 2), balance=[2, 2], devices=['cpu:0', 'cpu:1'], chunks=2)


@pytest.mark.parametrize('call, error, message', [
    (lambda g: g.train_step(torch.ones(4, 2), torch.ones(4, 2), F.mse_loss, schedule='chimera'),
     ValueError, "schedule must be one of 'fill_drain', '1f1b', 'interleaved_1f1b', 'zb_h1', "
     "'zbv', or a schedule of its actions (text such as '0F0 0B0', or a list of action "
     "lists) (schedule: 'chimera'); use schedule='1f1b'"),
    (lambda g: g.train_step(torch.ones(4, 2), torch.ones(4, 2), F.mse_loss, reduction='none'),
     ValueError, "reduction must be 'mean' or 'sum'"),
    (lambda g: g.train_step(torch.ones(4, 2), torch.ones(4, 2), 'mse'),
     TypeError, 'loss_fn must be callable'),
    (lambda g: g.train_step(torch.ones(4, 2), torch.ones(3, 2), F.mse_loss),
     ValueError, 'target must split into the micro-batches the input does'),
    (lambda g: g.train_step(torch.ones(4, 2), torch.ones(4, 2),
                            lambda o, t: F.mse_loss(o, t, reduction='none')),
     TypeError, 'loss_fn must return a tensor of one element (a reduced loss) (loss_fn '
     'returned Tensor of shape (2, 2)); reduce the loss inside loss_fn'),
    (lambda g: g.train_step(torch.ones(4, 2), torch.ones(4, 2), F.mse_loss,
                            schedule=['1f1b']),
     TypeError, "or a list of action lists) (schedule: ['1f1b'])"),
    (lambda g: g.train_step(torch.ones(4, 2), torch.ones(4, 2), F.mse_loss,
                            schedule='0F0 0B0 0F1 0B1\n1F1 1F0 1B0 1B1'),
     ValueError, 'the schedule cannot go on: 0B0 can never run, for it waits for 1B0'),
    (lambda g: g.train_step(torch.ones(4, 2), torch.ones(4, 2), F.mse_loss,
                            schedule='0F0 0F1 0B0 0B1 1F0 1F1 1B0 1B1 1X1'),
     ValueError, "schedule action '1X1' is not of the form"),
    (lambda g: g.train_step(torch.ones(4, 2), torch.ones(4, 2), F.mse_loss, schedule='zbv'),
     ValueError, "schedule 'zbv' runs partitions [0, 1] on one worker, but they are on "
     "['cpu:0', 'cpu:1']; give them one device, e.g. devices=['cpu:0', 'cpu:0']"),
    (lambda g: g.train_step(torch.ones(4, 2), torch.ones(4, 2), F.mse_loss,
                            reduction=['mean']),
     TypeError, "reduction must be 'mean' or 'sum' (reduction: ['mean'])"),
    (lambda g: g.train_step(torch.ones(0, 2), torch.ones(0, 2), F.mse_loss),
     ValueError, 'train_step needs at least one sample (input: a mini-batch of 0 rows)'),
    (lambda g: g.train_step(torch.ones(4, 2), torch.tensor(1.0), F.mse_loss),
     ValueError, 'target tensors must have a batch dimension (dimension 0) to be split into '
     'micro-batches (target: a 0-dimensional tensor)'),
    (lambda g: g.train_step(torch.ones(10, 2), (torch.ones(10, 2), torch.ones(7, 2)),
                            lambda o, t: F.mse_loss(o, t[0])),
     ValueError, 'tensors of the target tuple must have the same size in dimension 0 '
     '(target: sizes [10, 7] in dimension 0)'),
    (lambda g: g.train_step(torch.ones(4, 2), None, F.mse_loss),
     TypeError, 'target must be a tensor or a tuple of tensors (target: NoneType)'),
], ids=['schedule', 'reduction', 'loss_fn', 'target-rows', 'unreduced-loss',
        'schedule-type', 'schedule-stuck', 'schedule-text', 'schedule-placement',
        'reduction-type', 'empty-batch', '0-dim-target', 'target-tuple', 'no-target'])
def test_bad_use_gets_clear_errors(call: Callable[[GPipe], Any], error: type,
                                   message: str) -> None:
    gpipe = small()
    with pytest.raises(error, match=re.escape(message)):
        call(gpipe)
    assert all(p.grad is None for p in gpipe.parameters())


def test_an_empty_gpipe_refuses_train_step_whatever_the_input() -> None:
    # Its forward returns any input, even one that cannot be split: the
    # error is about the missing layers, not about the input.
    gpipe = GPipe(nn.Sequential(), [], devices=[])
    for input in (torch.ones(4, 2), torch.tensor(1.0)):
        with pytest.raises(ValueError, match='train_step needs at least one layer'):
            gpipe.train_step(input, input, F.mse_loss)


def test_no_grad_is_refused() -> None:
    with torch.no_grad(), pytest.raises(RuntimeError, match='gradients are disabled'):
        small().train_step(torch.ones(4, 2), torch.ones(4, 2), F.mse_loss)


def test_distributed_jobs_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    # DistributedDataParallel's hooks would not see the backward passes
    # train_step runs: in a job of several processes it refuses to run.
    monkeypatch.setattr(torch.distributed, 'is_initialized', lambda: True)
    monkeypatch.setattr(torch.distributed, 'get_world_size', lambda *args: 2)
    gpipe = small()
    with pytest.raises(RuntimeError, match='does not all-reduce gradients across processes'):
        gpipe.train_step(torch.ones(4, 2), torch.ones(4, 2), F.mse_loss)
    monkeypatch.setattr(torch.distributed, 'get_world_size', lambda *args: 1)
    gpipe.train_step(torch.ones(4, 2), torch.ones(4, 2), F.mse_loss)


def test_unsplit_inputs_reach_every_micro_batch(threaded: bool) -> None:
    class Scale(nn.Module):
        def forward(self, pair: Tuple[Tensor, Tensor]) -> Tensor:
            x, scale = pair
            return x * scale

    torch.manual_seed(0)
    model = nn.Sequential(Scale(), nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1))
    input, scale, target = torch.randn(6, 3), torch.randn(3), torch.randn(6, 1)
    reference = copy.deepcopy(model)
    F.mse_loss(reference((input, scale)), target).backward()
    gpipe = GPipe(model, balance=[2, 2], devices=cpu_devices(2, threaded), chunks=3)
    gpipe.train_step((input, torchgpipe.NoChunk(scale)), target, F.mse_loss)
    expected = named_grads(reference)
    for name, grad in named_grads(gpipe).items():
        torch.testing.assert_close(grad, expected[name], msg=name)


def test_unsplit_targets_reach_loss_fn_unwrapped(threaded: bool) -> None:
    # A NoChunk tensor of the target tuple reaches every micro-batch's loss
    # whole and unwrapped, as a NoChunk input reaches the layers.
    torch.manual_seed(0)
    model = mlp(3, 4, 2)
    input, target, weight = torch.randn(6, 3), torch.randn(6, 2), torch.rand(2)
    seen: List[type] = []

    def weighted_mse(output: Tensor, target: Tuple[Tensor, Tensor]) -> Tensor:
        seen.append(type(target[1]))
        return ((output - target[0]).pow(2) * target[1]).mean()

    reference = copy.deepcopy(model)
    expected = weighted_mse(reference(input), (target, weight))
    expected.backward()
    seen.clear()
    gpipe = GPipe(model, balance=[2, 2], devices=cpu_devices(2, threaded), chunks=3)
    loss = gpipe.train_step(input, (target, torchgpipe.NoChunk(weight)), weighted_mse)
    assert seen and set(seen) == {Tensor}
    torch.testing.assert_close(loss, expected.detach())
    expected_grads = named_grads(reference)
    for name, grad in named_grads(gpipe).items():
        torch.testing.assert_close(grad, expected_grads[name], msg=name)


@pytest.mark.cuda
def test_gradients_on_cuda() -> None:
    torch.manual_seed(0)
    count = torch.cuda.device_count()
    devices = ['cuda:0', 'cuda:1'] if count > 1 else ['cuda:0', 'cuda:0']
    model = mlp(4, 8, 8, 2).to('cuda:0')
    input = torch.randn(8, 4, device='cuda:0')
    target = torch.randn(8, 2, device='cuda:0')  # train_step moves it to the last device
    for schedule in SCHEDULES:
        assert_train_step_as_unwrapped(copy.deepcopy(model), input, target, F.mse_loss,
                                       balance=[2, 2], devices=devices, chunks=4,
                                       schedule=schedule)


class Keep(nn.Module):
    """Remembers a weak reference to every output, to see whether any outlives a step."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: List[Any] = []

    def forward(self, x: Tensor) -> Tensor:
        y = x * 2
        self.outputs.append(weakref.ref(y))
        return y


@pytest.mark.slow
@pytest.mark.parametrize('schedule', SCHEDULES)
def test_a_step_leaves_no_activation_behind(schedule: str, threaded: bool) -> None:
    # Failed or not: what an I keeps for its W goes with the step. The three
    # steps share one garbage collection, which takes most of a second in a
    # worker that has run many tests.
    keeps = []
    for where in ('forward', 'backward', None):
        keep = Keep()
        model = nn.Sequential(nn.Linear(4, 4), keep, nn.Linear(4, 4),
                              Fail(at=2 if where else -1, where=where or 'forward'),
                              nn.Linear(4, 4))
        gpipe = GPipe(model, balance=[2, 3], devices=schedule_devices(schedule, 2, threaded),
                      chunks=4, checkpoint='never')
        if where is None:
            gpipe.train_step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss,
                             schedule=schedule)
        else:
            with pytest.raises((ValueError, KeyError)):
                gpipe.train_step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss,
                                 schedule=schedule)
        keeps.append((where, keep))
        del model, gpipe, keep
    gc.collect()
    for where, keep in keeps:
        assert keep.outputs and all(ref() is None for ref in keep.outputs), where

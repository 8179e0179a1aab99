"""Tied weights: a parameter shared by layers of different partitions trains
as in the unwrapped model, is listed once, and lives with its first partition."""
import copy
import io
import sys
from typing import Dict, List, Sequence, Tuple

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

from helpers import (assert_same_training_step, cpu_devices, run_in_clock_order,
                     schedule_devices)
from torchgpipe import GPipe
from torchgpipe.schedules import Schedule, build

VOCAB, DIM, BATCH = 11, 4, 6
HEAD = 5  # the index of the layer tied to the embedding (layer 0)

#: Where the tie falls: across one boundary, across two, within a partition.
BALANCES = {'one-boundary': [3, 4], 'two-boundaries': [2, 2, 3], 'one-partition': [6, 1]}


def tied_model() -> nn.Sequential:
    """An embedding, an MLP and an output projection tied to the embedding."""
    embedding = nn.Embedding(VOCAB, DIM)
    head = nn.Linear(DIM, VOCAB)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM),
                         nn.Tanh(), head, nn.LogSoftmax(dim=1))


def tokens() -> Tensor:
    return torch.randint(VOCAB, (BATCH,))


def loss_fn(output: Tensor) -> Tensor:
    return -output[:, 0].mean()


def gpipe_parameters(gpipe: nn.Module) -> Dict[str, Tensor]:
    """GPipe's parameters by the unwrapped model's names."""
    return {name.split('.', 2)[2]: p for name, p in gpipe.named_parameters()}


def assert_same_parameters(gpipe: nn.Module, reference: nn.Module, grads: bool = True) -> None:
    actual = gpipe_parameters(gpipe)
    expected = dict(reference.named_parameters())
    assert actual.keys() == expected.keys()
    for name, p in expected.items():
        torch.testing.assert_close(actual[name], p, msg=name)
        if grads:
            torch.testing.assert_close(actual[name].grad, p.grad, msg=name)


@pytest.mark.parametrize('balance', BALANCES.values(), ids=BALANCES.keys())
def test_training_steps_as_unwrapped(balance: List[int], checkpoint: str,
                                     threaded: bool) -> None:
    model = tied_model()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, balance, devices=cpu_devices(len(balance), threaded), chunks=3,
                  checkpoint=checkpoint)
    # Momentum: a stale copy, or a second entry, would show in the state too.
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
                  for m in (gpipe, reference)]

    for _ in range(3):
        x = tokens()
        for optimizer in optimizers:
            optimizer.zero_grad()
        expected = reference(x)
        expected_loss = loss_fn(expected)
        expected_loss.backward()
        actual = gpipe(x)
        actual_loss = loss_fn(actual)
        actual_loss.backward()

        torch.testing.assert_close(actual, expected)
        torch.testing.assert_close(actual_loss, expected_loss)
        assert_same_parameters(gpipe, reference)
        for optimizer in optimizers:
            optimizer.step()
        assert_same_parameters(gpipe, reference, grads=False)
        assert gpipe[HEAD].weight is gpipe[0].weight


@pytest.mark.parametrize('balance', BALANCES.values(), ids=BALANCES.keys())
def test_same_training_step(balance: List[int], checkpoint: str, threaded: bool) -> None:
    devices = cpu_devices(len(balance), threaded)
    assert_same_training_step(
        tied_model(), lambda m: GPipe(m, balance, devices=devices, chunks=3,
                                      checkpoint=checkpoint),
        tokens(), loss_fn)


@pytest.mark.parametrize('balance', BALANCES.values(), ids=BALANCES.keys())
def test_gradient_flows_to_the_master_through_autograd(balance: List[int], checkpoint: str,
                                                       threaded: bool) -> None:
    """The gradient of every use reaches the master through the autograd graph,
    as a checkpoint's gradient of one of its parameters: then
    torch.autograd.grad returns the whole of it, .grad is left alone, and
    hooks on gradient accumulation (DistributedDataParallel's) see it once."""
    model = tied_model()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, balance, devices=cpu_devices(len(balance), threaded), chunks=3,
                  checkpoint=checkpoint)
    x = tokens()
    expected = torch.autograd.grad(loss_fn(reference(x)), list(reference.parameters()))
    actual = torch.autograd.grad(loss_fn(gpipe(x)), list(gpipe.parameters()))
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e)
    assert all(p.grad is None for p in gpipe.parameters())


@settings(max_examples=15, deadline=None)
@given(st.lists(st.booleans(), min_size=6, max_size=6), st.integers(1, 4), st.booleans())
def test_any_balance_trains_as_unwrapped(cuts: List[bool], chunks: int, threaded: bool) -> None:
    """Wherever the boundaries fall, the gradients are the unwrapped model's."""
    balance = [1]
    for cut in cuts:
        if cut:
            balance.append(1)
        else:
            balance[-1] += 1
    devices = cpu_devices(len(balance), threaded)
    torch.manual_seed(0)
    assert_same_training_step(
        tied_model(), lambda m: GPipe(m, balance, devices=devices, chunks=chunks,
                                      checkpoint='always'),
        tokens(), loss_fn)


@pytest.mark.parametrize('balance', BALANCES.values(), ids=BALANCES.keys())
def test_listed_once_and_the_users_layers_left_as_they_were(balance: List[int]) -> None:
    model = tied_model()
    count = len(list(model.parameters()))
    registered = list(model.named_parameters(remove_duplicate=False))
    keys = list(model.state_dict())
    gpipe = GPipe(model, balance, devices=['cpu'] * len(balance))
    assert len(list(gpipe.parameters())) == count
    # The layers are the user's: the head keeps the tied weight registered.
    assert list(model.named_parameters(remove_duplicate=False)) == registered
    assert list(model.state_dict()) == keys
    assert gpipe[HEAD].weight is gpipe[0].weight
    loss_fn(gpipe(tokens())).backward()
    assert list(model.named_parameters(remove_duplicate=False)) == registered


@pytest.mark.parametrize('devices', [['cpu', 'meta', 'meta'], ['meta', 'cpu', 'cpu']])
def test_master_on_the_first_partition_device(devices: List[str]) -> None:
    """Moving a later partition leaves the master where its first partition is."""
    gpipe = GPipe(tied_model(), [2, 2, 3], devices=devices)
    master = gpipe[0].weight
    assert master.device == torch.device(devices[0])
    assert gpipe[HEAD].weight is master
    # The rest of the head's partition moved.
    assert gpipe[HEAD].bias.device == torch.device(devices[2])


def test_state_dict_round_trips(threaded: bool) -> None:
    model = tied_model()
    balance = [2, 2, 3]
    devices = cpu_devices(3, threaded)
    gpipe = GPipe(copy.deepcopy(model), balance, devices=devices, chunks=2)
    optimizer = torch.optim.SGD(gpipe.parameters(), lr=0.5)
    loss_fn(gpipe(tokens())).backward()
    optimizer.step()

    state = gpipe.state_dict()
    # The keys of the unwrapped model, the tied weight under both.
    plain_keys = list(model.state_dict())
    assert sorted(k.split('.', 2)[2] for k in state) == sorted(plain_keys)
    assert f'{HEAD}.weight' in plain_keys
    head_key = f'partitions.2.{HEAD}.weight'
    torch.testing.assert_close(state[head_key], state['partitions.0.0.weight'])
    assert gpipe.state_dict(keep_vars=True)[head_key] is gpipe[0].weight

    # Both key styles load into a fresh GPipe, and the tie holds.
    plain = gpipe.unwrap()
    for source in (state, plain.state_dict()):
        fresh = GPipe(tied_model(), balance, devices=devices)
        assert str(fresh.load_state_dict(source)) == '<All keys matched successfully>'
        assert fresh[HEAD].weight is fresh[0].weight
        assert_same_parameters(fresh, plain, grads=False)

    # Through a file, as a checkpoint is saved.
    saved = io.BytesIO()
    torch.save(state, saved)
    saved.seek(0)
    fresh = GPipe(tied_model(), balance, devices=devices)
    fresh.load_state_dict(torch.load(saved))
    x = tokens()
    torch.testing.assert_close(fresh(x), gpipe(x))

    # A later use's key is required, in the style given.
    for source, missing in ((state, head_key), (plain.state_dict(), f'{HEAD}.weight')):
        partial = {k: v for k, v in source.items() if k != missing}
        fresh = GPipe(tied_model(), balance, devices=devices)
        with pytest.raises(RuntimeError, match=f'Missing key.*"{missing}"'):
            fresh.load_state_dict(partial)
        result = fresh.load_state_dict(partial, strict=False)
        assert result.missing_keys == [missing] and result.unexpected_keys == []


def test_unwrap_restores_the_tie() -> None:
    gpipe = GPipe(tied_model(), [3, 4], devices=['cpu', 'cpu'])
    plain = gpipe.unwrap()
    assert plain[HEAD].weight is plain[0].weight
    assert plain[0].weight is not gpipe[0].weight
    assert list(plain.state_dict()) == list(tied_model().state_dict())
    assert len(list(plain.parameters())) == len(list(gpipe.parameters()))
    x = tokens()
    torch.testing.assert_close(plain(x), gpipe(x))
    # Nothing of GPipe stays on the layers: the plain model trains alone.
    loss_fn(plain(x)).backward()
    assert gpipe[0].weight.grad is None and plain[0].weight.grad is not None


def test_deepcopy_keeps_the_tie(threaded: bool) -> None:
    model = tied_model()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [2, 2, 3], devices=cpu_devices(3, threaded), chunks=2)
    clone = copy.deepcopy(gpipe)
    assert clone[HEAD].weight is clone[0].weight
    assert clone[0].weight is not gpipe[0].weight
    assert len(list(clone.parameters())) == len(list(reference.parameters()))

    x = tokens()
    loss_fn(clone(x)).backward()
    loss_fn(reference(x)).backward()
    assert_same_parameters(clone, reference)
    # The copy's gradients reach the copy's master only.
    assert all(p.grad is None for p in gpipe.parameters())


def test_uses_hold_the_master_after_a_failure() -> None:
    class Fail(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise RuntimeError('fail')

    model = tied_model()
    model.append(Fail())
    gpipe = GPipe(model, [2, 6], devices=['cpu', 'cpu'])
    with pytest.raises(RuntimeError, match='fail'):
        gpipe(tokens())
    assert gpipe[HEAD].weight is gpipe[0].weight


SHARED_MESSAGE = 'a buffer, or a layer with parameters or buffers, cannot be in two partitions'


def shared_buffer() -> nn.Sequential:
    a, b = nn.BatchNorm1d(DIM), nn.BatchNorm1d(DIM)
    b.running_mean = a.running_mean
    return nn.Sequential(a, nn.Linear(DIM, DIM), b)


def shared_layer() -> nn.Sequential:
    layer = nn.Linear(DIM, DIM)
    return nn.Sequential(nn.Sequential(layer, nn.Tanh()), nn.Tanh(), nn.Sequential(layer))


@pytest.mark.parametrize('make_model, received', [
    (shared_buffer, "('0.running_mean' of partition 0 is '2.running_mean' of partition 1)"),
    (shared_layer, "('0.0' of partition 0 is '2.0' of partition 1)"),
])
def test_shared_buffers_and_layers_across_partitions_refused(make_model: type,
                                                              received: str) -> None:
    model = make_model()
    before = {name: t.device for name, t in model.state_dict().items()}
    with pytest.raises(ValueError) as info:
        GPipe(model, [2, 1], devices=['cpu', 'meta'])
    message = str(info.value)
    assert message.startswith(SHARED_MESSAGE + ' ' + received + '; change the balance'), message
    # Refused before anything moved.
    assert {name: t.device for name, t in model.state_dict().items()} == before
    # Within one partition, sharing is PyTorch's business.
    gpipe = GPipe(make_model(), [3], devices=['cpu'])
    gpipe(torch.randn(BATCH, DIM))


def test_shared_layer_without_tensors_across_partitions() -> None:
    activation = nn.Tanh()
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Sequential(activation), nn.Linear(DIM, DIM),
                          nn.Sequential(activation))
    assert_same_training_step(model, lambda m: GPipe(m, [2, 2], devices=['cpu', 'cpu']),
                              torch.randn(BATCH, DIM))


def test_two_later_uses_of_one_master(checkpoint: str, threaded: bool) -> None:
    """Two layers of a later partition tied to one master: one copy serves both."""
    first, second, third = (nn.Linear(DIM, DIM) for _ in range(3))
    second.weight = third.weight = first.weight
    model = nn.Sequential(first, nn.Tanh(), second, nn.Tanh(), third)
    assert_same_training_step(
        model, lambda m: GPipe(m, [2, 3], devices=cpu_devices(2, threaded), chunks=3,
                               checkpoint=checkpoint),
        torch.randn(BATCH, DIM))



def tied_step(devices: List[str], dtype: torch.dtype, checkpoint: str,
              how: str) -> List[Tensor]:
    """The output, then every gradient, of one step of a model whose
    embedding and head are tied across four partitions.

    ``how``: ``'backward'`` (the drop-in path and the caller's backward pass)
    or a schedule of ``train_step``.
    """
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, DIM)
    head = nn.Linear(DIM, VOCAB)
    head.weight = embedding.weight
    model = nn.Sequential(embedding, nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM),
                          nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh(), head).to(dtype)
    gpipe = GPipe(model, [2, 2, 2, 2], devices=devices, chunks=4, checkpoint=checkpoint)
    x = torch.randint(VOCAB, (4 * BATCH,))
    if how == 'backward':
        output = gpipe(x)
        output.logsumexp(1).mean().backward()
    else:
        output = gpipe.train_step(x, x, nn.functional.cross_entropy, schedule=how)
    assert gpipe[7].weight is gpipe[0].weight
    return [output.detach(), *(p.grad for p in gpipe.parameters())]


#: The workers of the four partitions with threads, for each schedule: one a
#: partition, or two partitions each, in a loop or in a V.
WORKERS = {'fill_drain': [0, 1, 2, 3], '1f1b': [0, 1, 2, 3], 'zb_h1': [0, 1, 2, 3],
           'interleaved_1f1b': [0, 1, 0, 1], 'zbv': [0, 1, 1, 0]}


@pytest.mark.parametrize('schedule', list(WORKERS))
@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['float64', 'float32'])
def test_train_step_gives_the_tied_gradient_bit_for_bit_on_both_paths(
        dtype: torch.dtype, checkpoint: str, schedule: str) -> None:
    """The tied master's gradient adds its terms (two partitions' uses, four
    micro-batches each) in one order on one thread and on a worker thread
    per device, which finish their backward passes in any order: each
    partition adds into its share, and the step sums the shares in the order
    of the partitions (torchgpipe.foundation.tied.shares_apart). Everything else is
    bit for bit too."""
    inline = tied_step(['cpu'] * 4, dtype, checkpoint, schedule)
    threads = tied_step([f'cpu:{w}' for w in WORKERS[schedule]], dtype, checkpoint, schedule)
    assert len(inline) == len(threads) == 1 + 8
    for a, b in zip(inline, threads):
        assert torch.equal(a, b)


@pytest.mark.parametrize('dtype', [torch.float64, torch.float32], ids=['float64', 'float32'])
def test_the_drop_in_path_bit_for_bit_but_the_tied_gradient(dtype: torch.dtype,
                                                            checkpoint: str) -> None:
    """After ``gpipe(x)`` and the caller's ``backward()``, the output and
    every gradient are the same bits with one thread and with a worker thread
    per device, but the tied parameter's: the same terms, added by the
    autograd engine in the order its nodes run, which differs between
    threads (docs/guide.rst, "Random numbers and determinism"). The tied
    master is used as itself on every CPU device, never through a copy."""
    inline = tied_step(cpu_devices(4, threaded=False), dtype, checkpoint, 'backward')
    threads = tied_step(cpu_devices(4, threaded=True), dtype, checkpoint, 'backward')
    assert len(inline) == len(threads) == 1 + 8
    assert torch.equal(inline[0], threads[0])
    # The master is parameters()[0]; it may differ in its last bits.
    scale = inline[1].abs().max().item()
    torch.testing.assert_close(inline[1], threads[1], rtol=0,
                               atol=8 * torch.finfo(dtype).eps * scale)
    for a, b in zip(inline[2:], threads[2:]):
        assert torch.equal(a, b)


class Busy(nn.Module):
    """Its input, after as much work as :attr:`rounds` asks: it moves the
    workers' timing, never a number."""

    def __init__(self) -> None:
        super().__init__()
        self.rounds = 0

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(self.rounds):
            torch.ones(256).cumsum(0)
        return x


def tied_dropout_model(partitions: int, dropout_everywhere: bool = True
                       ) -> Tuple[nn.Sequential, List[int]]:
    """An embedding tied to its head, with dropout, in float64, and a balance
    of ``partitions``, each starting with a :class:`Busy` layer.

    Dropout follows the embedding, and each hidden layer if ``dropout_everywhere``.
    """
    torch.manual_seed(0)
    embedding = nn.Embedding(VOCAB, DIM)
    head = nn.Linear(DIM, VOCAB)
    head.weight = embedding.weight

    def dropout() -> nn.Module:
        return nn.Dropout(0.1) if dropout_everywhere else nn.Identity()
    layers: List[nn.Module] = [Busy(), embedding, nn.Dropout(0.1)]
    for _ in range(partitions - 1):
        layers += [Busy(), nn.Linear(DIM, DIM), nn.Tanh(), dropout()]
    layers.append(head)
    return nn.Sequential(*layers).double(), [3] + [4] * (partitions - 2) + [5]


#: The partitions of each schedule: in a loop or a V over two workers, four.
PARTITIONS = {'fill_drain': 3, '1f1b': 3, 'zb_h1': 3, 'interleaved_1f1b': 4, 'zbv': 4}
CHUNKS = 4
TOKENS = torch.randint(VOCAB, (4 * CHUNKS,), generator=torch.Generator().manual_seed(1))
TARGETS = torch.randint(VOCAB, (4 * CHUNKS,), generator=torch.Generator().manual_seed(2))


def plan(schedule: str, partitions: int) -> Schedule:
    """``schedule``, interleaved 1F1B's over two workers on any path (by its
    name, it loops over the devices given: one with ``['cpu'] * n``)."""
    return build(schedule, micro_batches=CHUNKS, partitions=partitions, workers=2)


def dropout_gpipe(devices: Sequence[str], checkpoint: str, rounds: Sequence[int] = ()) -> GPipe:
    """:func:`tied_dropout_model` on ``devices``; the Busy layer of partition
    ``j`` does ``rounds[j]``."""
    model, balance = tied_dropout_model(len(devices))
    for busy, count in zip([m for m in model if isinstance(m, Busy)], rounds):
        busy.rounds = count
    return GPipe(model, balance, devices=list(devices), chunks=CHUNKS, checkpoint=checkpoint)


def dropout_step(pipe: nn.Module, schedule: str) -> List[Tensor]:
    """The loss, then every gradient, of a train_step of a GPipe or a
    DistributedGPipe after ``torch.manual_seed(42)``."""
    torch.manual_seed(42)
    loss = pipe.train_step(TOKENS, TARGETS, nn.functional.cross_entropy,
                           schedule=plan(schedule, len(pipe.balance)))
    return [loss, *(p.grad for p in pipe.parameters())]


@pytest.mark.slow
@pytest.mark.parametrize('schedule', list(PARTITIONS))
def test_tied_gradient_bit_for_bit_with_dropout_whatever_the_timing(schedule: str,
                                                                     checkpoint: str) -> None:
    """The worker threads give the tied gradient of one thread, bit for bit,
    with dropout, under 20 timings: the workers' shares of each partition
    are summed in the order of the partitions whichever finished first
    (``torchgpipe.foundation.tied.shares_apart``)."""
    n = PARTITIONS[schedule]
    inline = dropout_step(dropout_gpipe(['cpu'] * n, checkpoint), schedule)
    # The unwrapped model draws the same masks run on the micro-batches in
    # the order of the step's forward actions; it sums their terms otherwise.
    model, balance = tied_dropout_model(n)
    torch.manual_seed(42)
    output = run_in_clock_order(model, balance, TOKENS, CHUNKS, plan(schedule, n))
    loss = nn.functional.cross_entropy(output, TARGETS)
    loss.backward()
    for actual, expected in zip(inline, [loss, *(p.grad for p in model.parameters())],
                                strict=True):
        torch.testing.assert_close(actual, expected)

    interval = sys.getswitchinterval()
    try:
        for k in range(20):
            # Threads switch every microsecond to every 10 ms, and the
            # partitions take turns being the slowest.
            sys.setswitchinterval(10.0 ** -(2 + k % 5))
            rounds = [25 * ((k + j) % n) for j in range(n)]
            devices = schedule_devices(schedule, n, threaded=True)
            threads = dropout_step(dropout_gpipe(devices, checkpoint, rounds), schedule)
            assert all(torch.equal(a, b) for a, b in zip(inline, threads, strict=True)), k
    finally:
        sys.setswitchinterval(interval)


@pytest.mark.parametrize('schedule', ['fill_drain', 'zb_h1'])
def test_layers_wrapped_before_keep_their_tie(schedule: str, threaded: bool) -> None:
    """A pipeline of layers that an earlier one made borrow their tied
    parameter (a model wrapped twice) sees the tie: its gradient is the one
    of a pipeline of fresh layers, bit for bit."""
    fresh = dropout_step(dropout_gpipe(['cpu'] * 3, 'except_last'), schedule)
    first = dropout_gpipe(['cpu'] * 3, 'except_last')
    again = GPipe(nn.Sequential(*first), first.balance, devices=cpu_devices(3, threaded),
                  chunks=CHUNKS)
    assert again[-1].weight is again[1].weight
    assert all(torch.equal(a, b) for a, b in zip(fresh, dropout_step(again, schedule),
                                                 strict=True))

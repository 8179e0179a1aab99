"""Values that are not batches at partition boundaries: None, numbers, strings, NoChunk tensors."""
import copy
import re
from typing import Any, Generator, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import cpu_devices
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from torchgpipe import GPipe, NoChunk
from torchgpipe.distributed import DistributedGPipe, PeerFailed
from torchgpipe.skip import pop, skippable, stash

FEATURES = 4
# (balance, chunks): one, two and three partitions.
BALANCES = [[3], [2, 1], [1, 1, 1]]


def plain(value: Any) -> Any:
    """The tensor of a NoChunk, or the value: the unwrapped model meets wrappers too."""
    return value.tensor if isinstance(value, NoChunk) else value


class Mix(nn.Module):
    """Takes and returns (x, bias, mask, scale, name, flag, nothing).

    It returns the bias as a NoChunk, so it stays unsplit to the end. With
    ``first_of_partition``, it asserts that GPipe unwraps NoChunk tensors
    for it.
    """

    def __init__(self, first_of_partition: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)
        self.first_of_partition = first_of_partition

    def forward(self, input: Tuple[Any, ...]) -> Tuple[Any, ...]:
        x, bias, mask, scale, name, flag, nothing = input
        if self.first_of_partition:
            assert isinstance(bias, Tensor) and isinstance(mask, Tensor)
        bias, mask = plain(bias), plain(mask)
        assert (scale, name, flag, nothing) == (3, 'tag', True, None)
        assert bias.shape == mask.shape == (FEATURES,)
        y = (self.linear(x) * scale + bias).masked_fill(~mask, 0.0).tanh()
        return y, NoChunk(bias * 2), NoChunk(mask), scale, name, flag, nothing


def make_input(batch_size: int) -> Tuple[Tensor, Tensor, Tensor]:
    x = torch.randn(batch_size, FEATURES)
    bias = torch.randn(FEATURES)
    mask = torch.tensor([True, False, True, True])
    return x, bias, mask


def compare(model: nn.Sequential, gpipe_factory: Any, batch_size: int) -> None:
    """One training step of GPipe and of the unwrapped model, on the same tuple."""
    reference = copy.deepcopy(model)
    gpipe = gpipe_factory(model)
    x, bias, mask = make_input(batch_size)
    grads: List[List[Tensor]] = []
    outputs = []
    for module, wrap in [(reference, False), (gpipe, True)]:
        xi = x.clone().requires_grad_()
        bi = bias.clone().requires_grad_()
        nochunk = (NoChunk(bi), NoChunk(mask)) if wrap else (bi, mask)
        output = module((xi, *nochunk, 3, 'tag', True, None))
        y, out_bias, out_mask, *rest = output
        assert rest == [3, 'tag', True, None]
        # GPipe unwraps NoChunk tensors of its output; the reference does not.
        out_bias, out_mask = (out_bias, out_mask) if wrap else (plain(out_bias), plain(out_mask))
        assert isinstance(out_bias, Tensor) and torch.equal(out_mask, mask)
        (y.pow(2).sum() + out_bias.sum()).backward()
        outputs.append((y, out_bias))
        grads.append([xi.grad, bi.grad, *(p.grad for p in module.parameters())])
    torch.testing.assert_close(outputs[1], outputs[0])
    assert len(grads[0]) == len(grads[1])
    for expected, actual in zip(*grads):
        torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize('chunks', [1, 3])
@pytest.mark.parametrize('balance', BALANCES, ids=['1', '2', '3'])
def test_non_batch_values_cross_partitions_as_without_gpipe(
        balance: List[int], chunks: int, checkpoint: str, threaded: bool) -> None:
    model = nn.Sequential(Mix(), Mix(), Mix())

    def factory(module: nn.Sequential) -> GPipe:
        # Only inside GPipe: the unwrapped model passes wrappers between layers.
        for j in range(len(balance)):
            module[sum(balance[:j])].first_of_partition = True
        return GPipe(module, balance, devices=cpu_devices(len(balance), threaded),
                     chunks=chunks, checkpoint=checkpoint)
    compare(model, factory, batch_size=7)


def test_every_micro_batch_gets_the_nochunk_tensor_itself(threaded: bool) -> None:
    bias = torch.randn(FEATURES)
    seen: List[Tensor] = []

    class Record(nn.Module):
        def forward(self, input: Tuple[Tensor, Tensor]) -> Tensor:
            seen.append(input[1])
            return input[0] + input[1]

    # Not checkpointed: a checkpointed partition runs on copies of its input
    # until it is known not to modify it in place.
    gpipe = GPipe(nn.Sequential(Record(), nn.Identity()), [1, 1],
                  devices=cpu_devices(2, threaded), chunks=4, checkpoint='never')
    output = gpipe((torch.zeros(8, FEATURES), NoChunk(bias)))
    # On the threaded path, 'cpu' is moved to 'cpu:0', once for all.
    assert len(seen) == 4 and all(t is seen[0] for t in seen)
    assert threaded or seen[0] is bias
    torch.testing.assert_close(output, bias.expand(8, FEATURES))


def test_a_tensor_returned_without_nochunk_is_split_and_concatenated(threaded: bool) -> None:
    # Each of the 4 micro-batches returns the whole bias as a batch: 4 copies.
    class Pass(nn.Module):
        def forward(self, input: Tuple[Tensor, Tensor]) -> Tuple[Tensor, Tensor]:
            return input[0], input[1]

    bias = torch.randn(FEATURES)
    gpipe = GPipe(nn.Sequential(Pass(), nn.Identity()), [1, 1],
                  devices=cpu_devices(2, threaded), chunks=4)
    _, out = gpipe((torch.zeros(8, 1), NoChunk(bias)))
    torch.testing.assert_close(out, bias.repeat(4))


@skippable(stash=['bias'])
class StashBias(nn.Module):
    def forward(self, input: Tuple[Any, ...]) -> Generator[Any, None, Tuple[Any, ...]]:
        x, bias, name = input
        yield stash('bias', bias)
        return x * 2, None, name


@skippable(pop=['bias'])
class PopBias(nn.Module):
    def forward(self, input: Tuple[Any, ...]) -> Generator[Any, None, Tuple[Any, ...]]:
        x, nothing, name = input
        bias = yield pop('bias')
        assert nothing is None and name == 'tag'
        return x + bias, NoChunk(bias), name


@pytest.mark.parametrize('checkpoint', ['always', 'never'])
def test_skip_connections_across_tuples_with_other_values(checkpoint: str,
                                                          threaded: bool) -> None:
    model = nn.Sequential(StashBias(), nn.Identity(), PopBias())
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [1, 1, 1], devices=cpu_devices(3, threaded), chunks=3,
                  checkpoint=checkpoint)
    x, bias, _ = make_input(6)
    results = []
    for module, wrap in [(reference, plain), (gpipe, NoChunk)]:
        xi, bi = x.clone().requires_grad_(), bias.clone().requires_grad_()
        y, out_bias, name = module((xi, wrap(bi), 'tag'))
        assert name == 'tag'
        (y.pow(2).sum() + plain(out_bias).sum()).backward()
        results.append((y, plain(out_bias), xi.grad, bi.grad))
    torch.testing.assert_close(results[1], results[0])


class Constant(nn.Module):
    def __init__(self, output: Any) -> None:
        super().__init__()
        self.output = output

    def forward(self, input: Any) -> Any:
        return self.output


@pytest.mark.parametrize('input, error, message', [
    ((NoChunk(torch.zeros(8, 1)), None), ValueError,
     'input must hold at least one tensor to be split into micro-batches '
     '(input: a tuple of NoChunk, NoneType); '),
    ((None, 1), TypeError, 'input must hold at least one tensor (input: a tuple of NoneType, int)'),
    ((torch.zeros(8, 1), [1.0]), TypeError, '(input: a tuple holding list at index 1); '),
    ((torch.zeros(8, 1), {'a': 1}), TypeError, '(input: a tuple holding dict at index 1); '),
    (NoChunk(torch.zeros(8, 1)), TypeError,
     'input must be a tensor or a tuple of tensors (input: NoChunk); '),
    ((torch.zeros(8, 1), NoChunk(torch.zeros(3)), torch.tensor(1.0)), ValueError,
     '(input[2]: a 0-dimensional tensor)'),
])
def test_unsplittable_inputs_are_refused(input: Any, error: type, message: str,
                                         threaded: bool) -> None:
    gpipe = GPipe(nn.Sequential(nn.Identity(), nn.Identity()), [1, 1],
                  devices=cpu_devices(2, threaded), chunks=2)
    with pytest.raises(error, match=re.escape(message)):
        gpipe(input)


class Named(nn.Module):
    """Returns a dict, as a layer written for keyword access might."""

    def forward(self, x: Tensor) -> Any:
        return {'x': x}


#: What a dict at a boundary gets, on every path, with the fix.
DICT_REFUSED = ('output of partition 0 must be a tensor or a tuple of tensors (output of '
                'partition 0: dict); use a tuple of its values instead, such as '
                'tuple(d.values()), and take them by position where they are used')


def dict_at_boundary() -> nn.Sequential:
    return nn.Sequential(nn.Linear(FEATURES, FEATURES), Named(), nn.Identity())


def test_a_dict_at_a_boundary_is_refused_with_the_fix(threaded: bool) -> None:
    gpipe = GPipe(dict_at_boundary(), [2, 1], devices=cpu_devices(2, threaded), chunks=2)
    batch = torch.zeros(4, FEATURES)
    for step in [lambda: gpipe(batch), lambda: gpipe.train_step(batch, batch, F.mse_loss)]:
        with pytest.raises(TypeError) as caught:
            step()
        assert str(caught.value) == DICT_REFUSED


def dict_across_ranks(rank: int, world_size: int) -> str:
    pipe = DistributedGPipe(dict_at_boundary(), [2, 1], chunks=2)
    batch = torch.zeros(4, FEATURES)
    try:
        pipe.train_step(batch, batch, F.mse_loss)
    except (TypeError, PeerFailed) as exc:
        return f'{type(exc).__name__}: {exc}'
    return 'trained'


def test_a_dict_at_a_boundary_is_refused_alike_across_processes() -> None:
    """One rule for both faces: the rank whose partition returns it raises the same error."""
    first, second = run_distributed(dict_across_ranks, timeout=60)
    assert first == f'TypeError: {DICT_REFUSED}'
    assert second == f'PeerFailed: rank 0 (partition 0) failed: TypeError: {DICT_REFUSED}'


def test_a_partition_output_without_tensor_is_refused(threaded: bool) -> None:
    gpipe = GPipe(nn.Sequential(Constant((None, 1)), nn.Identity()), [1, 1],
                  devices=cpu_devices(2, threaded), chunks=2)
    with pytest.raises(TypeError, match=re.escape(
            'output of partition 0 must hold at least one tensor '
            '(output of partition 0: a tuple of NoneType, int); ')):
        gpipe(torch.zeros(4, 1))


def test_nochunk_wraps_tensors_only() -> None:
    with pytest.raises(TypeError, match=re.escape('NoChunk must wrap a tensor (tensor: int); ')):
        NoChunk(1)  # type: ignore[arg-type]

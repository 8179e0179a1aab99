"""CUDA paths: streams, copies between devices, input placement.

Every test here needs a GPU and is skipped, naming the reason, without one.
"""
import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchgpipe.foundation.copy
from helpers import assert_same_training_step
from test_train_step import assert_train_step_as_unwrapped
from torchgpipe import GPipe
from torchgpipe.foundation.copy import Copy, Ready, Wait
from torchgpipe.foundation.stream import (current_stream, default_stream, get_device, is_cuda,
                                          new_stream, use_stream, wait_stream)

pytestmark = pytest.mark.cuda


def devices(n: int) -> list:
    count = torch.cuda.device_count()
    return [torch.device('cuda', j % count) for j in range(n)]


def test_cuda_streams() -> None:
    device = torch.device('cuda')
    stream = new_stream(device)
    assert is_cuda(stream) and stream != default_stream(device)
    assert get_device(stream).type == 'cuda'
    with use_stream(stream):
        assert current_stream(device) == stream
    wait_stream(default_stream(device), stream)


def test_copy_runs_on_copy_streams_and_gradients_come_back() -> None:
    source, target = devices(2)
    prev_stream, next_stream = new_stream(source), new_stream(target)
    x = torch.randn(64, device=source, requires_grad=True)
    wait_stream(prev_stream, current_stream(source))
    y, = Copy.apply(prev_stream, next_stream, x)
    y, = Wait.apply(next_stream, current_stream(target), y)
    assert y.device == target
    (y * 2).sum().backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


def test_transparency_on_cuda(checkpoint: str) -> None:
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh()).double()
    input = torch.randn(12, 8, dtype=torch.double, device=devices(1)[0])
    assert_same_training_step(
        model.to(input.device),
        lambda m: GPipe(m, [1, 1, 1, 1], devices=devices(4), chunks=4, checkpoint=checkpoint),
        input)


def test_copy_streams_are_one_per_device_per_micro_batch() -> None:
    gpipe = GPipe(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), [1, 1], devices=devices(2),
                  chunks=3)
    gpipe(torch.randn(6, 2, device=devices(1)[0]))
    streams = gpipe.core.state.copy_streams
    assert [len(s) for s in streams] == [3, 3]
    flat = [s for per_device in streams for s in per_device]
    assert len(set(flat)) == 6
    assert all(s != default_stream(get_device(s)) for s in flat)


def test_input_on_another_device_is_moved_to_the_first_partition() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [2, 1], devices=devices(2), chunks=2)
    x = torch.randn(4, 4, requires_grad=True)  # on CPU
    output = gpipe(x)
    assert output.device == gpipe.devices[-1]
    output.sum().backward()
    x_ref = x.detach().clone().requires_grad_()
    reference(x_ref).sum().backward()
    torch.testing.assert_close(output.cpu(), reference(x_ref).detach())
    torch.testing.assert_close(x.grad, x_ref.grad)


def test_moving_to_a_cuda_device_is_denied() -> None:
    gpipe = GPipe(nn.Sequential(nn.Linear(2, 2)), [1], devices=devices(1))
    with pytest.raises(TypeError):
        gpipe.cuda()
    with pytest.raises(TypeError):
        gpipe.to('cuda')


def test_integer_devices_mean_cuda_indices() -> None:
    gpipe = GPipe(nn.Sequential(nn.Linear(2, 2)), [1], devices=[0])
    assert gpipe.devices == [torch.device('cuda', 0)]
    assert next(gpipe.parameters()).device == torch.device('cuda', 0)


def test_default_devices_are_every_cuda_device() -> None:
    n = torch.cuda.device_count()
    gpipe = GPipe(nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)]), [1] * n)
    assert gpipe.devices == [torch.device('cuda', j) for j in range(n)]


def test_placement_moves_every_tensor_in_place() -> None:
    """Moving to CUDA keeps every parameter, gradient and buffer object: a
    module outside the pipeline that holds one sees it moved, and a state
    dict loaded into it reaches the pipeline."""
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.ReLU(), nn.Linear(4, 4))
    model(torch.randn(3, 4)).sum().backward()
    outer = nn.Module()
    outer.register_buffer('mean', model[1].running_mean)
    before = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers()]

    gpipe = GPipe(model, [2, 2], devices=devices(2))

    after = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers()]
    assert all(a is b for a, b in zip(after, before))
    for partition, device in zip(gpipe.partitions, gpipe.devices):
        for t in [*partition.parameters(), *partition.buffers()]:
            assert t.device == device and (t.grad is None or t.grad.device == device)
    assert outer.mean is gpipe[1].running_mean and outer.mean.is_cuda
    outer.load_state_dict({'mean': torch.full((4,), 3.0)})
    assert gpipe[1].running_mean.eq(3.0).all()


def test_bare_cuda_is_the_current_device_and_nothing_is_copied() -> None:
    from torchgpipe.foundation.placement import same_memory
    current = torch.device('cuda', torch.cuda.current_device())
    assert same_memory(torch.device('cuda'), current)
    assert not same_memory(torch.device('cpu'), current)
    model = nn.Sequential(nn.Linear(2, 2)).to(current)
    pointers = [p.data_ptr() for p in model.parameters()]
    GPipe(model, [1], devices=['cuda'])
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_tied_weights_across_cuda_devices() -> None:
    """A later partition on another GPU computes with a copy of the master
    (on one GPU, with the master): the gradients are the unwrapped model's."""
    embedding = nn.Embedding(10, 4)
    head = nn.Linear(4, 10)
    head.weight = embedding.weight
    model = nn.Sequential(embedding, nn.Linear(4, 4), nn.Tanh(), head).double()
    reference = copy.deepcopy(model)
    gpipe = GPipe(model, [2, 2], devices=devices(2), chunks=3)
    assert gpipe[3].weight is gpipe[0].weight and gpipe[0].weight.is_cuda
    x = torch.randint(10, (6,))
    reference(x).logsumexp(1).mean().backward()
    gpipe(x).logsumexp(1).mean().backward()
    for (name, p), q in zip(reference.named_parameters(), gpipe.parameters()):
        torch.testing.assert_close(q.grad.cpu(), p.grad, msg=name)


def test_a_copy_to_the_cpu_is_done_when_it_returns() -> None:
    """The CPU reads a copy at once: unlike a copy to a stream's device, it must not be async."""
    source = devices(1)[0]
    x = torch.randn(1 << 22, device=source)
    expected = x.sum().item()
    y, = Copy.apply(current_stream(source), current_stream(torch.device('cpu')), x)
    assert y.device.type == 'cpu' and y.sum().item() == pytest.approx(expected, rel=1e-5)
    z = Ready(source).receive(x * 2, torch.device('cpu'))
    assert z.sum().item() == pytest.approx(2 * expected, rel=1e-5)


@pytest.mark.parametrize('schedule', ['1f1b', 'zb_h1'])
def test_train_step_copies_between_devices_on_copy_streams(schedule: str,
                                                           monkeypatch: pytest.MonkeyPatch
                                                           ) -> None:
    moved = []
    copy_tensors = torchgpipe.foundation.copy.copy_tensors

    def recorded(source: Any, target: Any, tensors: Any) -> Any:
        moved.append((source, target))
        return copy_tensors(source, target, tensors)
    monkeypatch.setattr(torchgpipe.foundation.copy, 'copy_tensors', recorded)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh()).double()
    device = devices(1)[0]
    gpipe = assert_train_step_as_unwrapped(
        model.to(device), torch.randn(12, 8, dtype=torch.double, device=device),
        torch.randn(12, 8, dtype=torch.double, device=devices(4)[-1]), F.mse_loss,
        balance=[1, 1, 1, 1], devices=devices(4), chunks=4, schedule=schedule)
    streams = [s for row in gpipe.core.state.copy_streams for s in row]
    assert moved and all(a in streams and b in streams for a, b in moved)

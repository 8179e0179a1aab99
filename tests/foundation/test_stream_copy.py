"""The CPU stand-in for streams, Copy/Wait on CPU, and the copy streams of train_step."""
from collections import Counter
from typing import Any, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgpipe.foundation.copy
import torchgpipe.runtime.traits
from helpers import PopAdd, Stash, cpu_devices
from torchgpipe import GPipe
from torchgpipe.foundation.copy import Copy, Ready, Wait
from torchgpipe.foundation.stream import (CPUStream, as_cuda, current_stream, default_stream,
                                          get_device, is_cuda, new_stream, record_stream,
                                          use_device, use_stream, wait_stream)

CPU = torch.device('cpu')


def test_cpu_streams_are_no_ops() -> None:
    for stream in (new_stream(CPU), current_stream(CPU), default_stream(CPU)):
        assert stream is CPUStream and not is_cuda(stream)
        assert get_device(stream) == CPU
    with use_device(CPU), use_stream(CPUStream):
        x = torch.zeros(1)
        record_stream(x, CPUStream)
        wait_stream(CPUStream, CPUStream)
    assert repr(CPUStream) == 'CPUStream'
    assert as_cuda(CPUStream) is CPUStream


def test_copy_and_wait_on_cpu_pass_values_and_gradients() -> None:
    x = torch.randn(3, requires_grad=True)
    index = torch.arange(3)
    y, j = Copy.apply(CPUStream, CPUStream, x, index)
    z, k = Wait.apply(CPUStream, CPUStream, y * 2, j)
    assert torch.equal(k, index) and not k.requires_grad
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_ready_hands_a_message_over_without_history_and_without_copying_on_cpu() -> None:
    """What a training step's worker receives: the sender's tensor, cut from its graph."""
    x = torch.randn(3, requires_grad=True) * 2
    for device in (CPU, torch.device('cpu', 1)):
        y = Ready(device).receive(x, device)
        assert y.grad_fn is None and not y.requires_grad
        assert y.data_ptr() == x.data_ptr(), 'all CPU devices are one memory: nothing is copied'


class FakeStream:
    """A stand-in CUDA stream that logs what waits for what."""

    def __init__(self, name: str, log: List[Tuple[str, ...]]) -> None:
        self.name = name
        self.log = log

    def wait_event(self, event: str) -> None:
        self.log.append((self.name, 'waits for', event))


def fake_cuda(monkeypatch: pytest.MonkeyPatch, log: List[Tuple[str, ...]]) -> FakeStream:
    """Makes torchgpipe.foundation.copy see fake CUDA streams; returns the receiver's
    compute stream."""
    compute = FakeStream('receiver compute', log)
    monkeypatch.setattr(torchgpipe.foundation.copy, 'current_stream', lambda device: compute)
    monkeypatch.setattr(torchgpipe.foundation.copy, 'is_cuda', lambda s: isinstance(s, FakeStream))
    monkeypatch.setattr(torchgpipe.foundation.copy, 'as_cuda', lambda s: s)

    def copy_tensors(source: FakeStream, target: FakeStream, tensors: Any) -> Any:
        log.append(('copy', source.name, target.name))
        return tensors
    monkeypatch.setattr(torchgpipe.foundation.copy, 'copy_tensors', copy_tensors)
    monkeypatch.setattr(torchgpipe.foundation.copy, 'wait_stream',
                        lambda a, b: log.append((a.name, 'waits for', b.name)))
    return compute


def test_a_message_moves_on_copy_streams_then_the_compute_stream_waits() -> None:
    """The order of a train_step's transfer on CUDA, as far as the CPU can show it."""
    log: List[Tuple[str, ...]] = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        fake_cuda(monkeypatch, log)
        ready = Ready(CPU, FakeStream('sender copy', log))
        ready.event = 'computed'  # as recorded on the sender's compute stream
        ready.receive(torch.ones(2), CPU, FakeStream('receiver copy', log))
    # Both copy streams wait for the sender's computation, the copy runs on
    # them, and only then may the receiver's compute stream use the result.
    assert set(log[:2]) == {('sender copy', 'waits for', 'computed'),
                            ('receiver copy', 'waits for', 'computed')}
    assert log[2:] == [('copy', 'sender copy', 'receiver copy'),
                       ('receiver compute', 'waits for', 'receiver copy')]


def test_without_copy_streams_a_message_moves_on_the_current_streams() -> None:
    log: List[Tuple[str, ...]] = []
    with pytest.MonkeyPatch.context() as monkeypatch:
        fake_cuda(monkeypatch, log)
        ready = Ready(CPU)
        ready.event = 'computed'
        ready.receive(torch.ones(2), CPU)
    assert log == [('receiver compute', 'waits for', 'computed'),
                   ('copy', 'receiver compute', 'receiver compute')]


@pytest.mark.parametrize('threaded', [False, True], ids=['inline', 'threads'])
@pytest.mark.parametrize('schedule', ['1f1b', 'zb_h1', 'fill_drain'])
def test_train_step_moves_each_message_from_the_senders_copy_stream_to_the_receivers(
        schedule: str, threaded: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every activation, gradient and skip of micro-batch i goes from the copy stream
    of i on its sender's partition to that of i on its receiver's: the streams the
    forward path's Copy uses."""
    # Copy streams told apart, as CUDA streams are (on CPU all are CPUStream).
    monkeypatch.setattr(torchgpipe.runtime.traits, 'new_stream', lambda device: object())
    moves: List[Tuple[Any, Any]] = []
    receive = Ready.receive

    def recorded(self: Ready, x: Tensor, device: torch.device, stream: Any = None) -> Tensor:
        moves.append((self.stream, stream))
        return receive(self, x, device, stream)
    monkeypatch.setattr(Ready, 'receive', recorded)

    # A skip from partition 0 to 2, over partition 1.
    model = nn.Sequential(nn.Linear(4, 4), Stash(), nn.Linear(4, 4), nn.Tanh(), PopAdd(),
                          nn.Linear(4, 4))
    chunks = 4
    gpipe = GPipe(model, [2, 2, 2], devices=cpu_devices(3, threaded), chunks=chunks)
    gpipe.train_step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss, schedule=schedule)
    streams = gpipe.core.state.copy_streams
    where = {id(s): (j, i) for j, row in enumerate(streams) for i, s in enumerate(row)}
    assert len(where) == 3 * chunks, 'a copy stream per partition per micro-batch'
    # Per micro-batch: activations 0→1, 1→2, the skip 0→2, and the three gradients back.
    assert len(moves) == 6 * chunks
    found = Counter()
    for source, target in moves:
        (a, i), (b, k) = where[id(source)], where[id(target)]
        assert i == k and a != b
        found[a, b] += 1
    assert found == {(0, 1): chunks, (1, 2): chunks, (0, 2): chunks,
                     (2, 1): chunks, (1, 0): chunks, (2, 0): chunks}

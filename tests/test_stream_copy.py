"""The CPU stand-in for streams, and Copy/Wait on CPU."""
import torch

from torchgpipe.copy import Copy, Ready, Wait
from torchgpipe.stream import (CPUStream, as_cuda, current_stream, default_stream, get_device,
                               is_cuda, new_stream, record_stream, use_device, use_stream,
                               wait_stream)

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

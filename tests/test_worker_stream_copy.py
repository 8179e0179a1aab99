"""Workers, the CPU stand-in for streams, and Copy/Wait on CPU."""
import threading
from typing import List

import pytest
import torch

from helpers import cpu_devices
from torchgpipe.copy import Copy, Wait
from torchgpipe.microbatch import Batch
from torchgpipe.stream import (CPUStream, as_cuda, current_stream, default_stream, get_device,
                               is_cuda, new_stream, record_stream, use_device, use_stream,
                               wait_stream)
from torchgpipe.worker import Task, spawn_workers

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


def run(tasks: List[Task], devices: List[torch.device]) -> list:
    results = []
    with spawn_workers(devices) as (in_queues, out_queues):
        for j, task in enumerate(tasks):
            in_queues[j].put(task)
        for j in range(len(tasks)):
            results.append(out_queues[j].get())
    return results


def thread_names(devices: List[torch.device]) -> List[str]:
    """The name of the thread that computed each partition's task."""
    names = [''] * len(devices)

    def task(j: int) -> Task:
        def compute() -> Batch:
            names[j] = threading.current_thread().name
            return Batch(torch.zeros(1))
        return Task(CPUStream, compute=compute, finalize=None)

    results = run([task(j) for j in range(len(devices))], devices)
    assert all(ok for ok, _ in results)
    return names


def test_one_worker_thread_per_distinct_device_and_clean_shutdown() -> None:
    """Threaded path only: distinct devices, one worker thread each."""
    cpu0, cpu1 = torch.device('cpu', 0), torch.device('cpu', 1)
    names = thread_names([cpu0, cpu1, cpu0])
    assert names[0] == names[2] != names[1]
    assert all(name.startswith('torchgpipe worker') for name in names)
    # (conftest checks after every test that no worker thread is left.)


def test_a_single_device_computes_in_the_calling_thread() -> None:
    """Single-thread path only: one shared device starts no thread."""
    assert thread_names([CPU] * 3) == [threading.current_thread().name] * 3


THREADED = [torch.device('cpu', 0), torch.device('cpu', 1)]


@pytest.mark.parametrize('grad_mode', [True, False])
def test_workers_inherit_grad_mode_and_autocast(grad_mode: bool) -> None:
    """Threaded path only: inline tasks share the caller's thread and so its state.

    At the GPipe level, both paths are checked by the autocast and no_grad
    tests of test_transparency.py.
    """
    seen = []

    def compute() -> Batch:
        seen.append((threading.current_thread().name, torch.is_grad_enabled(),
                     torch.is_autocast_enabled('cpu'), torch.get_autocast_dtype('cpu'),
                     torch.is_autocast_cache_enabled()))
        return Batch(torch.zeros(1))

    tasks = [Task(CPUStream, compute=compute, finalize=None) for _ in THREADED]
    with torch.set_grad_enabled(grad_mode), \
            torch.autocast('cpu', dtype=torch.bfloat16, cache_enabled=False):
        run(tasks, THREADED)
    assert all(name.startswith('torchgpipe worker') for name, *_ in seen)
    assert [state for _, *state in seen] == [[grad_mode, True, torch.bfloat16, False]] * 2


def test_worker_reports_exceptions_and_keeps_working(threaded: bool) -> None:
    devices = [torch.device(name) for name in cpu_devices(2, threaded)]
    error = RuntimeError('inside')

    def fail() -> Batch:
        raise error

    ok_task = Task(CPUStream, compute=lambda: Batch(torch.ones(1)), finalize=None)
    with spawn_workers(devices) as (in_queues, out_queues):
        in_queues[0].put(Task(CPUStream, compute=fail, finalize=None))
        in_queues[0].put(ok_task)
        ok, payload = out_queues[0].get()
        assert not ok and payload[1] is error
        ok, payload = out_queues[0].get()
        assert ok and payload[0] is ok_task


def test_task_finalize() -> None:
    finalized = []
    task = Task(CPUStream, compute=lambda: Batch(torch.ones(1)), finalize=finalized.append)
    batch = task.compute()
    task.finalize(batch)
    assert finalized == [batch]
    Task(CPUStream, compute=lambda: batch, finalize=None).finalize(batch)

"""Workers: one thread per distinct device, the turns their tasks take, and how they end.

Both engines run their tasks on these workers: the forward path a clock
cycle at a time, a training step every action at once.
"""
import multiprocessing
import os
import sys
import threading
from typing import List

import pytest
import torch

from conftest import worker_threads
from helpers import cpu_devices
from torchgpipe.foundation.microbatch import Batch
from torchgpipe.foundation.stream import CPUStream
from torchgpipe.runtime.worker import IDLE_WORKERS, IssueOrder, Stopped, Task, spawn_workers

CPU = torch.device('cpu')


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


def test_turns_run_in_the_order_they_were_taken() -> None:
    issue_order = IssueOrder()
    order: List[int] = []
    tasks = [issue_order.wrap(lambda k=k: order.append(k)) for k in range(6)]
    # Started last first, each still waits for the one taken before it.
    threads = [threading.Thread(target=task) for task in reversed(tasks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert order == list(range(6))


def test_a_failed_turn_hands_over_to_the_next() -> None:
    issue_order = IssueOrder()

    def fail() -> None:
        raise ValueError('boom')

    first, second = issue_order.wrap(fail), issue_order.wrap(lambda: 'ran')
    with pytest.raises(ValueError):
        first()
    assert second() == 'ran'


def test_a_stopped_turn_ends_every_wait_for_it() -> None:
    """A task skipped after Ctrl-C never ends its turn: those after it must not wait for ever."""
    issue_order = IssueOrder()
    skipped, waiting = issue_order.wrap(lambda: None), issue_order.wrap(lambda: 'ran')
    del skipped  # never runs
    outcome: List[object] = []

    def run() -> None:
        try:
            outcome.append(waiting())
        except Stopped as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    issue_order.stop()
    thread.join(timeout=10)
    assert not thread.is_alive() and isinstance(outcome[0], Stopped)
    with pytest.raises(Stopped):
        issue_order.wrap(lambda: None)()


def test_join_running_workers(threaded: bool) -> None:
    """A normal exit lets every task already queued finish, as in torchgpipe 0.0.7."""
    devices = [torch.device(name) for name in cpu_devices(2, threaded)]
    done: List[int] = []
    # On worker threads, every task is still queued or running as the block ends (inline,
    # each runs as it is put).
    release = threading.Event()
    if not threaded:
        release.set()

    def task(k: int) -> Task:
        def compute() -> Batch:
            assert release.wait(10)
            done.append(k)
            return Batch(torch.zeros(1))
        return Task(CPUStream, compute=compute, finalize=None)

    with spawn_workers(devices) as (in_queues, _):
        for k in range(4):
            in_queues[k % 2].put(task(k))
        assert done == [] or not threaded
        release.set()
    assert sorted(done) == [0, 1, 2, 3]


def test_an_exception_skips_the_queued_tasks() -> None:
    """After a failure or Ctrl-C, each worker finishes at most the task it is running."""
    devices = [torch.device('cpu', 0), torch.device('cpu', 1)]
    started, stopping = threading.Event(), threading.Event()
    done: List[int] = []

    def task(k: int) -> Task:
        def compute() -> Batch:
            started.set()
            # Runs until the workers are told to stop (``wake`` comes after
            # the flag), however late the caller gets there: a sleep of
            # 0.2 s let a loaded machine finish it first, and start task 1.
            assert stopping.wait(10)
            done.append(k)
            return Batch(torch.zeros(1))
        return Task(CPUStream, compute=compute, finalize=None)

    with pytest.raises(KeyboardInterrupt):
        with spawn_workers(devices, wake=stopping.set) as (in_queues, _):
            for k in range(4):
                in_queues[0].put(task(k))
            started.wait(10)
            raise KeyboardInterrupt
    assert done == [0]


@pytest.mark.timeout(60)
def test_an_exception_wakes_a_task_waiting_for_a_skipped_turn() -> None:
    """The one Ctrl-C handshake: the turn of a task skipped in its queue never comes, so
    spawn_workers wakes every wait (its ``wake``) before it waits for the workers."""
    devices = [torch.device('cpu', 0), torch.device('cpu', 1)]
    issue_order = IssueOrder()
    skipped = issue_order.wrap(lambda: Batch(torch.zeros(1)))
    waiting = issue_order.wrap(lambda: Batch(torch.ones(1)))
    waits, stopping = threading.Event(), threading.Event()

    def wait_for_turn() -> Batch:
        waits.set()
        return waiting()

    def until_stopped() -> Batch:
        # Ends only once the workers are told to stop (``wake`` comes after
        # the flag): a sleep of 0.2 s let a loaded machine end it before the
        # interrupt, and run the skipped task.
        assert stopping.wait(10)
        return Batch(torch.zeros(1))

    def wake() -> None:
        stopping.set()
        issue_order.stop()

    with pytest.raises(KeyboardInterrupt):
        with spawn_workers(devices, wake=wake) as (in_queues, out_queues):
            in_queues[1].put(Task(CPUStream, compute=wait_for_turn, finalize=None))
            waits.wait(10)
            # Queued behind a task that never ends before the interrupt: skipped.
            in_queues[0].put(Task(CPUStream, compute=until_stopped, finalize=None))
            in_queues[0].put(Task(CPUStream, compute=skipped, finalize=None))
            raise KeyboardInterrupt
    ok, payload = out_queues[1].get()
    assert not ok and isinstance(payload[1], Stopped)


def computing_threads(devices: List[torch.device]) -> List[threading.Thread]:
    """The thread that computed each partition's task."""
    threads: List[threading.Thread] = [threading.current_thread()] * len(devices)

    def task(j: int) -> Task:
        def compute() -> Batch:
            threads[j] = threading.current_thread()
            return Batch(torch.zeros(1))
        return Task(CPUStream, compute=compute, finalize=None)

    assert all(ok for ok, _ in run([task(j) for j in range(len(devices))], devices))
    return threads


def test_workers_park_between_calls_and_serve_the_next() -> None:
    """A thread's first operators are slow: the next call runs on the same threads."""
    first = computing_threads(THREADED)
    assert set(first) <= set(IDLE_WORKERS.threads())
    assert all(thread.is_alive() for thread in first)
    assert computing_threads(THREADED) == first
    # A call inside a task of another (a GPipe inside a partition) gets threads of its
    # own: the outer call's are busy until it ends.
    inner: List[threading.Thread] = []
    outer: List[threading.Thread] = []

    def nested() -> Batch:
        outer.append(threading.current_thread())
        inner.extend(computing_threads(THREADED))
        return Batch(torch.zeros(1))

    idle = Task(CPUStream, compute=lambda: Batch(torch.zeros(1)), finalize=None)
    assert all(ok for ok, _ in run([Task(CPUStream, compute=nested, finalize=None), idle],
                                   THREADED))
    assert outer == first[:1] and len(inner) == 2 and not set(inner) & set(first)
    assert set(inner + first) <= set(IDLE_WORKERS.threads())


def test_the_workers_of_a_failed_call_exit_and_the_next_call_starts_others() -> None:
    parked = computing_threads(THREADED)
    with pytest.raises(KeyboardInterrupt):
        with spawn_workers(THREADED) as (in_queues, out_queues):
            for in_queue in in_queues:
                in_queue.put(Task(CPUStream, compute=lambda: Batch(torch.zeros(1)),
                                  finalize=None))
            for out_queue in out_queues:
                out_queue.get()
            raise KeyboardInterrupt
    assert not any(thread.is_alive() for thread in parked)
    assert not set(parked) & set(IDLE_WORKERS.threads())
    fresh = computing_threads(THREADED)
    assert all(thread.is_alive() for thread in fresh) and not set(fresh) & set(parked)


def test_parked_workers_take_the_callers_number_of_intra_op_threads() -> None:
    """PyTorch sets a thread's intra-op threads at its first operator: a parked worker
    that started before a change would keep the old number."""
    threads = torch.get_num_threads()
    seen: List[int] = []
    task = Task(CPUStream, compute=lambda: seen.append(torch.get_num_threads()) or
                Batch(torch.zeros(1)), finalize=None)
    try:
        for number in [2, 1, 2]:
            torch.set_num_threads(number)
            run([task], THREADED[:1] + THREADED[1:])
    finally:
        torch.set_num_threads(threads)
    assert seen == [2, 1, 2]


def _step_in_a_forked_child() -> None:
    # The child has none of the parent's parked threads: it must start its own.
    torch.set_num_threads(1)
    results = run([Task(CPUStream, compute=lambda: Batch(torch.ones(1)), finalize=None)
                   for _ in THREADED], THREADED)
    sys.exit(0 if all(ok for ok, _ in results) else 1)


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, 'fork'), reason='os.fork is POSIX only')
# Python 3.12 and later warn of any fork of a process with threads: the one forked
# here has the parked ones, which is the point.
@pytest.mark.filterwarnings('ignore:This process .* is multi-threaded:DeprecationWarning')
def test_a_forked_child_does_not_wait_for_the_parents_parked_workers() -> None:
    computing_threads(THREADED)
    assert IDLE_WORKERS.threads()
    child = multiprocessing.get_context('fork').Process(target=_step_in_a_forked_child)
    child.start()
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0


def test_a_call_that_fails_before_its_workers_wake_still_waits_for_them_to_exit() -> None:
    """A parked thread wakes up to its job in its own time: a call that fails at once
    (before any job began) returns only once its threads have exited all the same."""
    for _ in range(50):
        parked = computing_threads(THREADED)
        with pytest.raises(ValueError):
            with spawn_workers(THREADED):
                raise ValueError('at once')
        assert worker_threads() == [] and not any(t.is_alive() for t in parked)

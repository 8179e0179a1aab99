"""Shared fixtures: both execution paths, the three checkpoint modes, no thread left behind."""
import threading
from typing import Iterator

import pytest
import torch
from helpers import CHECKPOINT_MODES


def worker_threads() -> list:
    return [t for t in threading.enumerate() if t.name.startswith('torchgpipe worker')]


@pytest.fixture(autouse=True)
def no_worker_thread_left() -> Iterator[None]:
    yield
    assert worker_threads() == [], 'a GPipe worker thread outlived the call'


@pytest.fixture(params=[False, True], ids=['inline', 'threads'])
def threaded(request: pytest.FixtureRequest) -> bool:
    """Runs the test on both execution paths; pass it to helpers.cpu_devices.

    False: every partition in the calling thread (one shared CPU device).
    True: one worker thread per device (distinct CPU indices).
    """
    return bool(request.param)


@pytest.fixture(params=CHECKPOINT_MODES)
def checkpoint(request: pytest.FixtureRequest) -> str:
    """Runs the test in each of GPipe's checkpoint modes: 'always', 'except_last', 'never'.

    A test for some modes only parametrizes ``checkpoint`` itself, which
    overrides this fixture.
    """
    return str(request.param)


@pytest.fixture(autouse=True, scope='session')
def one_intra_op_thread() -> Iterator[None]:
    # The tests' tensors are tiny: with several intra-op threads, OpenMP
    # start-up and spinning cost milliseconds per operator on a busy machine,
    # the more so with a worker thread per device competing for the cores.
    # No test here is about intra-op parallelism.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def deterministic_seed() -> None:
    torch.manual_seed(0)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker('cuda') and not torch.cuda.is_available():
        pytest.skip('needs a CUDA device; none is visible')

"""Shared fixtures: both execution paths, the three checkpoint modes, both backends, no thread
left behind.

Also: the coverage threshold of setup.cfg holds for the whole suite only, and
tests marked ``unmeasured`` run without coverage.py's tracing.
"""
import sys
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterable, Iterator, List, Optional, Set, cast

import coverage
import pytest
import torch
from helpers import CHECKPOINT_MODES

from torchgpipe.runtime.worker import IDLE_WORKERS

# The repository's root: tests import the benchmarks package too.
ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def worker_threads() -> list:
    """GPipe's worker threads alive and not parked (idle between calls)."""
    parked = set(IDLE_WORKERS.threads())
    return [t for t in threading.enumerate()
            if t.name.startswith('torchgpipe worker') and t not in parked]


@pytest.fixture(autouse=True)
def no_worker_thread_left() -> Iterator[None]:
    yield
    assert worker_threads() == [], 'a GPipe worker thread outlived the call unparked'


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


@pytest.fixture(scope='module', params=['gloo', pytest.param('nccl', marks=[
    pytest.mark.cuda, pytest.mark.skipif(torch.cuda.device_count() < 2,
                                         reason='needs 2 CUDA devices, for NCCL')])])
def backend(request: pytest.FixtureRequest) -> str:
    """Runs a cross-process test on gloo, and on NCCL with a GPU per rank; pass it to
    process_group.run_distributed, whose ranks then use process_group.rank_device."""
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


# -- the longest files first ---------------------------------------------------------
# pytest-xdist (-n 2 --dist loadfile) hands the test files to its workers one
# at a time, each to the first worker free: a long file handed out last keeps
# one worker busy while the other has nothing left, minutes at the end of the
# run. Handed out first, the long files run beside the rest and the short ones
# fill the end. By default xdist hands out the files with the most tests
# first, which put the distributed files (few tests, long ones) last:
# pytest_configure turns that off, and the order is the collection's, below.
# The longest in a run's --junitxml, longest first; the distributed ones partly wait
# (for deadlines, for ranks to start), so they overlap well with files that
# compute. The others follow in their order.
LONGEST_FIRST = [
    'test_distributed_hangs.py', 'test_typing_and_lint.py', 'test_distributed_pipe.py',
    'test_examples.py', 'test_models.py', 'test_benchmarks_smoke.py', 'test_docs.py',
    'test_distributed_tied.py', 'test_flatten.py', 'test_train_step.py',
    'test_capture_effects.py', 'test_rng.py', 'test_capture.py', 'test_suite_config.py',
    'test_capture_modes.py', 'test_distributed.py', 'test_distributed_step.py', 'test_skip.py',
    'test_generation.py', 'test_packaging.py', 'test_compat.py', 'test_clipping.py',
    'test_balance_solver.py', 'test_distributed_trace.py', 'test_rng_pipelines.py',
    'test_grad_scaler.py',
]


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    order = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: in-file order


@contextmanager
def unmeasured() -> Iterator[None]:
    """Coverage.py traces nothing within: neither this process nor the ones it starts."""
    # An xdist worker has two: the one coverage.py starts in every process
    # it measures (the worker is one), under pytest-cov's. Stopping the one
    # on top resumes the one below, so all are stopped, then resumed in order.
    # Imported here: a project that copies this file (test_suite_config)
    # has no benchmarks package, and no test marked unmeasured.
    from benchmarks import untraced

    stopped: List[coverage.Coverage] = []
    while (measuring := coverage.Coverage.current()) is not None:
        measuring.stop()
        stopped.append(measuring)
    try:
        with untraced():
            yield
    finally:
        for measuring in reversed(stopped):
            measuring.start()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Runs a test marked ``unmeasured`` untraced: its setup (module fixtures too), call and
    teardown.

    Coverage.py's tracing about doubles the time of code that calls many
    Python functions; the lines such a test runs are measured by others.
    """
    with unmeasured() if item.get_closest_marker('unmeasured') else nullcontext():
        yield


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker('cuda') and not torch.cuda.is_available():
        pytest.skip('needs a CUDA device; none is visible')


# -- the coverage threshold ------------------------------------------------------------
# setup.cfg's addopts carry --cov-fail-under=95, a bar for the whole suite:
# part of it (a file, a test, -k or -m) covers less, and must not fail for that.
# The threshold is lifted at the end of the collection unless the run is the
# whole suite, so `python -m pytest` keeps it and `python -m pytest
# tests/modules/test_gpipe.py` passes when its tests do; with pytest-xdist (-n), in
# the controller, once a worker has collected.

TESTS = Path(__file__).resolve().parent
MODULES = pytest.StashKey[Set[Path]]()
DESELECTED = pytest.StashKey[bool]()
LIFTED = pytest.StashKey[float]()


def is_whole_suite(args: Iterable[str], modules: Set[Path], deselected: bool) -> bool:
    """Whether a run is the whole test suite: every test of every test file.

    Args:
        args: the command line's paths and node ids (``config.args``)
        modules: the test files collected (resolved paths)
        deselected: whether the collection deselected any test (-k, -m,
            --deselect, --lf)
    """
    if deselected or any('::' in arg for arg in args):
        return False
    return {path.resolve() for path in TESTS.rglob('test_*.py')} <= modules


def pytest_configure(config: pytest.Config) -> None:
    if getattr(config.option, 'loadscopereorder', None):  # see LONGEST_FIRST
        config.option.loadscopereorder = False
    config.stash[MODULES] = set()
    config.stash[DESELECTED] = False


def pytest_collectstart(collector: pytest.Collector) -> None:
    if isinstance(collector, pytest.Module):
        collector.config.stash[MODULES].add(collector.path.resolve())


def pytest_deselected(items: Iterable[pytest.Item]) -> None:
    for item in items:
        item.config.stash[DESELECTED] = True
        break


def pytest_collection_finish(session: pytest.Session) -> None:
    config = session.config
    if not is_whole_suite(config.args, config.stash[MODULES], config.stash[DESELECTED]):
        lift_threshold(config)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: object, ids: List[str]) -> None:
    # With pytest-xdist (-n), the workers collect and the controller checks
    # coverage: it learns what runs from the node ids a worker collected,
    # whether anything was deselected from its options.
    config = cast(pytest.Config, getattr(node, 'config'))
    modules = {(config.rootpath / id.split('::', 1)[0]).resolve() for id in ids}
    option = config.option
    deselected = bool(option.keyword or option.markexpr or option.deselect
                      or getattr(option, 'lf', False))
    if not is_whole_suite(config.args, modules, deselected):
        lift_threshold(config)


def lift_threshold(config: pytest.Config) -> None:
    """Keeps pytest-cov from failing a part of the suite for its coverage."""
    # pytest-cov reads the threshold from its options after the tests have run.
    options = getattr(config.pluginmanager.getplugin('_cov'), 'options', None)
    threshold: Optional[float] = getattr(options, 'cov_fail_under', None)
    if threshold and not getattr(options, 'no_cov', False):
        options.cov_fail_under = None
        config.stash[LIFTED] = threshold


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter,
                            config: pytest.Config) -> None:
    threshold = config.stash.get(LIFTED, None)
    if threshold is not None:
        terminalreporter.write_line(
            f'coverage: the {threshold:g}% threshold holds for the whole suite only; '
            'not checked for this part of it')

"""Running a function in every process of a gloo group, for the tests of torch.distributed jobs.

:func:`run_distributed` starts ``world_size`` processes that join a gloo
process group on 127.0.0.1 and run a module-level function. They are forked
from a server process (multiprocessing's ``forkserver``) that imported torch
and torchgpipe once: a spawned process spends seconds of CPU importing them,
over a hundred times in the suite. The server is a fresh, single-threaded
Python process, started with the first run of an xdist worker, so a fork of
it is safe where a fork of pytest's own process (threads, coverage.py's
state) would not be.

Children send their results to the parent as plain Python data over a pipe
(tensors through multiprocessing queues need file-descriptor sharing, which
fails here). The parent never waits longer than a deadline, and
whenever it stops waiting (success, a child's error, a timeout or a pytest
timeout) it terminates and reaps every child, so no process outlives its
test (the fixture :func:`no_child_left` checks it). Having reported, a child
ends as the example does (``end_job``), and the parent checks that every
child exited with status 0. Several threads may run groups at once.
"""
import glob
import multiprocessing
import os
import socket
import sys
import threading
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

import stress_ddp_exit

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import COVERAGE_VARIABLE, untraced  # noqa: E402

WORLD_SIZE = 2
# Collectives (and the rendezvous) give up after this long; a failing rank
# must end its test well before it (starting the two processes alone takes up
# to 15 s on two cores).
GLOO_TIMEOUT = 60.0
# The parent's deadline for all children to report.
SPAWN_TIMEOUT = 90.0
#: How long a rank that reported is given to end on its own, when its run
#: stops early (another rank failed), before it is terminated: enough to save
#: its coverage data, short enough for a rank stuck in its exit.
EXIT_GRACE = 3.0
# What the server imports once for every rank it forks.
PRELOAD = ['torch', 'torch.distributed', 'torchgpipe', 'torchgpipe.distributed',
           'process_group']
# Held while a run reads whether it is measured and starts its ranks: untraced()
# takes coverage.py's variable out of os.environ meanwhile, and a run started
# from another thread at that moment would read it as unmeasured.
STARTING = threading.Lock()


class WorkerFailed(RuntimeError):
    """A child process raised, died or timed out.

    Attributes:
        rank: the rank that failed first
        type_name: the name of the exception's type in the child
        error: the exception itself when it could be pickled, also set as ``__cause__``
    """

    def __init__(self, message: str, rank: int, type_name: str = '',
                 error: Optional[BaseException] = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.type_name = type_name
        self.error = error


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(('127.0.0.1', 0))
        port: int = sock.getsockname()[1]
        return port


def _child(rank: int, world_size: int, port: int, fn: Callable[..., Any],
           args: Tuple[Any, ...], conn: Connection, alone: bool, backend: str,
           coverage_config: Optional[str]) -> None:
    """Entry point of a child: joins the process group, runs ``fn``, reports to the parent.

    The report is ``('ok', result)`` or ``('error', time, type name, message,
    traceback, exception or None)``. The time lets the parent tell the first
    failure from the ones it caused on other ranks.

    After an ``'ok'``, the child ends as the example does (``end_job``):
    Python's usual exit aborts or hangs in a few runs out of a hundred.
    ``alone``: other ranks may be dead, so it ends without the barrier.
    ``coverage_config``: coverage.py's configuration when the run is measured.
    The server runs untraced; a measured rank starts measuring itself, as
    ``patch = subprocess`` would have a spawned one do, and saves its data
    when it ends (``patch = _exit``).
    """
    if coverage_config is not None:
        import coverage
        os.environ[COVERAGE_VARIABLE] = coverage_config
        coverage.process_startup()
    try:
        torch.set_num_threads(1)
        if backend == 'nccl':  # the device of NCCL's collectives (the library's, DCP's)
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f'tcp://127.0.0.1:{port}', rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=GLOO_TIMEOUT))
        conn.send(('ok', fn(rank, world_size, *args)))
    except BaseException as exc:  # everything must reach the parent
        when = time.time()
        try:
            conn.send(('error', when, type(exc).__name__, str(exc), traceback.format_exc(), exc))
        except Exception:  # the exception does not pickle: send it as text only
            conn.send(('error', when, type(exc).__name__, str(exc), traceback.format_exc(),
                       None))
        return  # the parent terminates the other ranks, maybe stuck in a collective
    finally:
        conn.close()
    if alone:
        os._exit(0)
    stress_ddp_exit.end_job(0)


def rank_device() -> torch.device:
    """This rank's device: its own GPU on NCCL, which moves CUDA tensors only; else the CPU
    (in the parent too)."""
    on_nccl = dist.is_initialized() and dist.get_backend() == 'nccl'
    return torch.device('cuda', dist.get_rank()) if on_nccl else torch.device('cpu')


def _stop(processes: List[multiprocessing.process.BaseProcess],
          reported: Collection[int] = ()) -> None:
    """Terminates (then kills, if need be) and reaps every process still alive.

    The ranks in ``reported`` sent their report and are ending: each gets a
    moment to end on its own first. A rank that raised ends as Python does,
    saving its coverage data as it goes, and one stopped halfway through
    that leaves a data file that is not one, which spoils the run's
    combined report (a warning, which fails CI's stage). The data files of
    the ranks stopped all the same are removed: what they hold is partial.
    """
    for rank in reported:
        processes[rank].join(EXIT_GRACE)
    stopped = [process.pid for process in processes if process.is_alive()]
    for process in processes:
        if process.is_alive():
            process.terminate()
    for process in processes:
        process.join(5)
        if process.is_alive():
            process.kill()
            process.join()
    base = os.environ.get('COVERAGE_FILE') or os.path.join(os.getcwd(), '.coverage')
    for pid in stopped:
        for path in glob.glob(f'{glob.escape(base)}.*pid{pid}.*'):
            os.remove(path)


def take_reports(pending: Dict[Connection, int],
                 processes: List[multiprocessing.process.BaseProcess], dies: Collection[int],
                 timeout: float, results: List[Any], errors: List[Tuple[Any, ...]],
                 known: str = '') -> None:
    """Reads the reports that come within ``timeout``: each rank's result into
    ``results``, its error as ``(time, rank, type name, message, traceback,
    exception)`` into ``errors``.

    Raises:
        WorkerFailed: a rank not in ``dies`` ended without a report
            (``known``: what else went wrong, for the message)
    """
    for conn in wait(list(pending), timeout=timeout):
        assert isinstance(conn, Connection)
        rank = pending.pop(conn)
        try:
            report = conn.recv()
        except EOFError:
            processes[rank].join(5)
            if rank in dies:
                continue
            raise WorkerFailed(f'rank {rank} exited (code {processes[rank].exitcode}) '
                               f'without reporting{known}', rank) from None
        finally:
            conn.close()
        if report[0] == 'ok':
            results[rank] = report[1]
        else:
            errors.append((report[1], rank) + tuple(report[2:]))


def run_distributed(fn: Callable[..., Any], *args: Any, world_size: int = WORLD_SIZE,
                    timeout: float = SPAWN_TIMEOUT, dies: Collection[int] = (),
                    backend: str = 'gloo', measured: bool = True) -> List[Any]:
    """Runs ``fn(rank, world_size, *args)`` in ``world_size`` processes of a ``backend`` group.

    On ``backend='nccl'``, rank ``r`` uses ``cuda:r`` (:func:`rank_device`): skipped
    without a GPU per rank.

    ``fn`` and ``args`` must be picklable (``fn`` a module-level function).
    The ranks in ``dies`` are expected to die without reporting (their
    result is ``None``), and to end killed by a signal. With ``measured``
    false (or inside a test marked ``unmeasured``), coverage.py does not trace the ranks:
    for runs of large models through code that other runs measure.

    Returns:
        the value ``fn`` returned on each rank, in rank order

    Raises:
        WorkerFailed: a rank raised (the earliest error is reported and chained),
            exited without reporting, or the deadline passed; the other ranks are
            terminated at once rather than left to time out
    """
    if backend == 'nccl' and torch.cuda.device_count() < world_size:
        pytest.skip(f'needs {world_size} CUDA devices, for NCCL')
    ctx = multiprocessing.get_context('forkserver')
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts
    processes: List[multiprocessing.process.BaseProcess] = []
    pending: Dict[Connection, int] = {}
    try:
        with STARTING:
            coverage_config = os.environ.get(COVERAGE_VARIABLE) if measured else None
            port = free_port()
            for rank in range(world_size):
                receiver, sender = ctx.Pipe(duplex=False)
                process = ctx.Process(target=_child, name=f'torchgpipe-test-rank-{rank}',
                                      args=(rank, world_size, port, fn, args, sender,
                                            bool(dies), backend, coverage_config),
                                      daemon=True)
                # The server, started by the first rank of the worker's first
                # run, must not measure itself: its ranks do, when measured.
                with untraced():
                    process.start()
                sender.close()  # the child holds the only write end: EOF means it died
                processes.append(process)
                pending[receiver] = rank

        results: List[Any] = [None] * world_size
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                ranks = sorted(pending.values())
                raise WorkerFailed(f'ranks {ranks} did not finish within {timeout} s', ranks[0])
            errors: List[Tuple[Any, ...]] = []
            take_reports(pending, processes, dies, remaining, results, errors)
            if errors:
                # Another rank's failure may be a consequence (a closed connection):
                # collect what arrives within a grace and report the earliest, or a
                # rank that died without a word, the likeliest cause of the others.
                grace = time.monotonic() + 0.5
                while pending and (remaining := grace - time.monotonic()) > 0:
                    take_reports(pending, processes, dies, remaining, results, errors,
                                 f', and rank {errors[0][1]} raised {errors[0][2]}')
                errors.sort(key=lambda e: e[0])
                _, rank, type_name, message, child_traceback, error = errors[0]
                others = ''.join(f'\n(then rank {e[1]} raised {e[2]}: {e[3]})' for e in errors[1:])
                raise WorkerFailed(f'rank {rank} raised {type_name}: {message}{others}\n\n'
                                   f'traceback in rank {rank}:\n{child_traceback}',
                                   rank, type_name, error) from error
        # Having reported, every rank must still end cleanly: no SIGABRT, no hang.
        for rank, process in enumerate(processes):
            process.join(max(deadline - time.monotonic(), 0))
            if rank in dies:
                if process.exitcode is None or process.exitcode >= 0:
                    raise WorkerFailed(f'rank {rank} was to die of a signal, but ended with '
                                       f'exit code {process.exitcode} (None: still running)',
                                       rank)
            elif process.exitcode != 0:
                raise WorkerFailed(f'rank {rank} reported, then ended with exit code '
                                   f'{process.exitcode} (None: still running)', rank)
        return results
    finally:
        _stop(processes, [rank for rank in range(len(processes))
                          if rank not in pending.values()])
        for conn in pending:
            conn.close()


@pytest.fixture(autouse=True)
def no_child_left() -> Iterator[None]:
    yield
    assert multiprocessing.active_children() == [], 'a child process outlived its test'

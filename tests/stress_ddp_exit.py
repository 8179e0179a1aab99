"""Stress test of the end of a DDP job: many two-process gloo runs, counting the ranks that fail.

Each run starts two Python processes with the variables ``torchrun --nproc_per_node 2``
sets (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``):
fresh interpreters, as torchrun starts them (``--launcher spawn``, 6 to 12 s a run on
two cores), or forks of this process, which has imported torch already (``--launcher
fork``, about 2 s a run; the ranks still end with Python's usual exit). Each rank
trains :class:`~torch.nn.parallel.DistributedDataParallel` over a small model for
three steps, then ends. A rank fails if it exits with a non-zero status, dies of a
signal (SIGABRT after "terminate called without an active exception") or is still
running after ``--timeout`` seconds (a hang: it is killed). Runs stop after
``--runs`` runs of each job or once ``--budget`` seconds have passed, whichever
comes first::

    python tests/stress_ddp_exit.py --job gpipe --ending bare --runs 100
    python tests/stress_ddp_exit.py --job gpipe --ending end_job --runs 100
    python tests/stress_ddp_exit.py --job example --runs 100
    python tests/stress_ddp_exit.py --job gpipe-threaded --ending bare --launcher fork
    python tests/stress_ddp_exit.py --job sequential gpipe --checkpoint always never \\
        --ending bare --runs 100

Several jobs (and, for the GPipe jobs, several ``--checkpoint`` modes) are run in
turn, one run of each after the other, up to ``--runs`` runs each: they share the
machine's load, so their failure rates can be compared. A line per job reports them.

Jobs:

* ``sequential``: DDP over the ``nn.Sequential`` itself, without GPipe;
* ``gpipe``: DDP over GPipe on ``devices=['cpu', 'cpu']`` (no worker thread);
* ``gpipe-threaded``: DDP over GPipe on ``devices=['cpu:0', 'cpu:1']`` (a worker
  thread per partition);
* the two GPipe jobs checkpoint in the mode ``--checkpoint`` (by default GPipe's
  ``except_last``);
* ``example``: ``examples/ddp_pipeline.py --steps 3``, which ends its own way.

Endings: ``bare`` is the usual one, ``destroy_process_group()`` and a return from
``main`` (the DDP model still referenced until then), as in the example before it
had ``end_job``; ``end_job`` is :func:`end_job` of ``examples/ddp_pipeline.py``.

``--hazard`` makes the failure certain instead of rare: at the end of training, a
gloo thread of rank 0 starts a Python callback that, for two seconds, lets the GIL
go and takes it back every 10 ms, while the job ends. That is what happens, once
and briefly, when a gloo thread frees the last all-reduce of a backward pass.

The exit status is 1 if any rank failed, 0 otherwise.
"""
import argparse
import collections
import importlib.util
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from types import ModuleType
from typing import IO, Any, Counter, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# This repository's torchgpipe, even when run as a script (sys.path[0] is tests/).
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
EXAMPLE = os.path.join(ROOT, 'examples', 'ddp_pipeline.py')
JOBS = ['sequential', 'gpipe', 'gpipe-threaded', 'example']
ENDINGS = ['bare', 'end_job']
CHECKPOINTS = ['always', 'except_last', 'never']
WORLD_SIZE = 2
STEPS = 3
FEATURES = 8
HAZARD_SECONDS = 2.0


def load_example() -> ModuleType:
    """``examples/ddp_pipeline.py`` as a module (``examples`` is not a package)."""
    spec = importlib.util.spec_from_file_location('ddp_pipeline', EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


end_job = load_example().end_job


# --- one rank -----------------------------------------------------------------------------


def build(job: str, checkpoint: str, group: Optional[dist.ProcessGroup]
          ) -> Tuple[nn.Module, torch.optim.Optimizer]:
    """DDP over the job's model (in ``group``, the default group if None), and its optimizer."""
    from torchgpipe import GPipe  # once ROOT is on sys.path

    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(FEATURES, 16), nn.ReLU(),
                                     nn.Linear(16, FEATURES))
    if job == 'gpipe':
        model = GPipe(model, [2, 1], devices=['cpu', 'cpu'], chunks=4, checkpoint=checkpoint)
    elif job == 'gpipe-threaded':
        model = GPipe(model, [2, 1], devices=['cpu:0', 'cpu:1'], chunks=4,
                      checkpoint=checkpoint)
    ddp = DistributedDataParallel(model, process_group=group)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)


def step(ddp: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    optimizer.zero_grad()
    F.mse_loss(ddp(torch.randn(16, FEATURES)), torch.randn(16, FEATURES)).backward()
    optimizer.step()


def slow_callback(future: torch.futures.Future) -> Any:
    # Runs in the gloo thread that completed the all-reduce: every time.sleep lets
    # the GIL go, and needs it back after.
    end = time.monotonic() + HAZARD_SECONDS
    while time.monotonic() < end:
        time.sleep(0.01)
    return future.value()


def keep_a_gloo_thread_busy(group: dist.ProcessGroup) -> None:
    """Makes a gloo thread of rank 0 need the GIL again and again from now on.

    Rank 0 hangs :func:`slow_callback` on an all-reduce of ``group`` that rank 1
    joins late, so the callback runs in the gloo thread that completes it, not
    here. ``group`` is not the default group: a barrier on the default group does
    not wait for its collectives.
    """
    tensor = torch.zeros(1)
    if dist.get_rank() == 0:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        assert work is not None
        work.get_future().then(slow_callback)
    else:
        time.sleep(0.2)
        dist.all_reduce(tensor, group=group)


def rank_main(job: str, checkpoint: str, ending: str, hazard: bool) -> int:
    """One rank of a run, in the process group torchrun-style variables describe.

    The steps and the ending share one frame, as in a short training script: the
    ending comes right after the last all-reduce, with the DDP model alive. With
    ``hazard``, DDP works in a second group of the same ranks, and the busy gloo
    thread is one of that group's: the DDP model holds the last reference to it.
    """
    torch.set_num_threads(1)
    dist.init_process_group('gloo')
    try:
        group = dist.new_group(backend='gloo') if hazard else None
        ddp, optimizer = build(job, checkpoint, group)
        for _ in range(STEPS):
            step(ddp, optimizer)
        if group is not None:
            keep_a_gloo_thread_busy(group)
            del group  # only the DDP model holds it now, as the default group in the usual job
    except BaseException:
        dist.destroy_process_group()
        raise
    if ending == 'end_job':
        end_job(0)
    dist.destroy_process_group()
    return 0  # frees the DDP model, and with it the process group


# --- runs ---------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(('127.0.0.1', 0))
        port: int = sock.getsockname()[1]
        return port


class Rank(NamedTuple):
    """A started rank: its process id, the file of its stderr, its Popen when spawned."""

    pid: int
    stderr: IO[bytes]
    process: Optional['subprocess.Popen[bytes]']


def outcome(returncode: Optional[int]) -> str:
    """How a rank ended: ``ok``, ``exit N``, the signal's name, or ``hang``."""
    if returncode is None:
        return 'hang'
    if returncode == 0:
        return 'ok'
    if returncode < 0:
        return signal.Signals(-returncode).name
    return f'exit {returncode}'


class Job(NamedTuple):
    """One job of a stress run: what the ranks train, and GPipe's checkpoint mode."""

    name: str
    checkpoint: str

    def __str__(self) -> str:
        if self.name in ('gpipe', 'gpipe-threaded'):
            return f'{self.name} (checkpoint {self.checkpoint})'
        return self.name


def start_rank(rank: int, port: int, job: Job, args: argparse.Namespace) -> Rank:
    """Starts one rank of a run, in a fresh interpreter (spawn) or a fork of this one."""
    env = {'RANK': str(rank), 'LOCAL_RANK': str(rank), 'WORLD_SIZE': str(WORLD_SIZE),
           'LOCAL_WORLD_SIZE': str(WORLD_SIZE), 'MASTER_ADDR': '127.0.0.1',
           'MASTER_PORT': str(port)}
    if job.name == 'example':
        argv = [EXAMPLE, '--steps', str(STEPS)]
    else:
        argv = [os.path.abspath(__file__), '--as-rank', '--job', job.name,
                '--checkpoint', job.checkpoint, '--ending', args.ending
                ] + (['--hazard'] if args.hazard else [])
    stderr = tempfile.TemporaryFile()
    if args.launcher == 'spawn':
        path = os.pathsep.join(p for p in [ROOT, os.environ.get('PYTHONPATH')] if p)
        process = subprocess.Popen([sys.executable] + argv,
                                   env=dict(os.environ, PYTHONPATH=path, **env),
                                   cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
        return Rank(process.pid, stderr, process)
    sys.stdout.flush()
    pid = os.fork()
    if pid:
        return Rank(pid, stderr, None)
    # The child: the rank itself, ending with Python's usual exit (sys.exit).
    os.environ.update(env)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(stderr.fileno(), 2)
    sys.argv = argv
    if job.name == 'example':
        runpy.run_path(EXAMPLE, run_name='__main__')
        sys.exit(0)
    sys.exit(main(argv[1:]))


def wait_rank(rank: Rank, deadline: float) -> Tuple[str, str]:
    """Waits for a rank until ``deadline``, killing it then; returns (outcome, end of stderr)."""
    while True:  # polls at least once: the rank may have ended while we waited for another
        returncode: Optional[int] = None
        if rank.process is not None:
            returncode = rank.process.poll()
        else:
            pid, status = os.waitpid(rank.pid, os.WNOHANG)
            if pid:
                returncode = os.waitstatus_to_exitcode(status)
        if returncode is not None or time.monotonic() >= deadline:
            break
        time.sleep(0.02)
    if returncode is None:
        os.kill(rank.pid, signal.SIGKILL)
        if rank.process is not None:
            rank.process.wait()
        else:
            os.waitpid(rank.pid, 0)
    rank.stderr.seek(0)
    stderr = rank.stderr.read().decode(errors='replace')
    rank.stderr.close()
    return outcome(returncode), stderr[-2000:]


def run_once(job: Job, args: argparse.Namespace) -> List[Tuple[str, str]]:
    """Runs the two-process job once; returns ``(outcome, end of stderr)`` per rank."""
    port = free_port()
    ranks = [start_rank(rank, port, job, args) for rank in range(WORLD_SIZE)]
    deadline = time.monotonic() + args.timeout
    return [wait_rank(rank, deadline) for rank in ranks]


class Tally:
    """The runs of one job: how many, how many failed, how its ranks ended."""

    def __init__(self) -> None:
        self.done = 0
        self.failed = 0
        self.counts: Counter[str] = collections.Counter()
        #: A description of the first few failed ranks.
        self.failures: List[str] = []

    def add(self, results: List[Tuple[str, str]]) -> None:
        self.counts.update(result for result, _ in results)
        if any(result != 'ok' for result, _ in results):
            self.failed += 1
            if len(self.failures) < 3:
                self.failures.extend(f'run {self.done}, rank {rank}: {result}\n'
                                     f'{stderr.strip()}'
                                     for rank, (result, stderr) in enumerate(results)
                                     if result != 'ok')
        self.done += 1


def stress(jobs: Sequence[Job], args: argparse.Namespace) -> Dict[Job, Tally]:
    """Runs every job up to ``--runs`` times, in turn, starting no run after ``--budget`` s.

    One run of each job, then one more of each, and so on: the jobs see the same
    load of the machine, whatever else runs on it meanwhile.
    """
    start = time.monotonic()
    tallies = {job: Tally() for job in jobs}
    for _ in range(args.runs):
        for job in jobs:
            if time.monotonic() - start >= args.budget:
                return tallies
            results = run_once(job, args)
            tallies[job].add(results)
            if args.verbose and any(result != 'ok' for result, _ in results):
                print(f'{job}, run {tallies[job].done - 1}: '
                      f'{[result for result, _ in results]}', flush=True)
    return tallies


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description='Runs a two-process gloo DDP job many times and counts the ranks that '
                    'do not end cleanly.')
    parser.add_argument('--job', choices=JOBS, nargs='+', default=['gpipe'],
                        help='what each rank trains; several jobs run in turn '
                             '(default: gpipe)')
    parser.add_argument('--checkpoint', choices=CHECKPOINTS, nargs='+',
                        default=['except_last'],
                        help="GPipe's checkpoint mode in the gpipe jobs; several modes "
                             'run in turn (default: except_last)')
    parser.add_argument('--ending', choices=ENDINGS, default='end_job',
                        help='how each rank ends; ignored by --job example '
                             '(default: end_job)')
    parser.add_argument('--hazard', action='store_true',
                        help='make a gloo thread need the GIL while the job ends')
    parser.add_argument('--launcher', choices=['spawn', 'fork'], default='spawn',
                        help='start each rank as a fresh interpreter, as torchrun does, '
                             'or fork it from this process once torch is imported: ten '
                             'times faster, same exit (default: spawn)')
    parser.add_argument('--runs', type=int, default=100,
                        help='at most this many runs of each job (default: 100)')
    parser.add_argument('--budget', type=float, default=900.0,
                        help='start no run after this many seconds (default: 900)')
    parser.add_argument('--timeout', type=float, default=40.0,
                        help='a rank still running this many seconds into a run hangs '
                             '(default: 40)')
    parser.add_argument('--verbose', action='store_true',
                        help='print every failed run as it happens')
    parser.add_argument('--as-rank', action='store_true', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.as_rank and len(args.job) + len(args.checkpoint) != 2:
        parser.error('a rank runs one job in one checkpoint mode')
    if args.hazard and 'example' in args.job:
        parser.error('--hazard needs a job of this script, not --job example')
    return args


def jobs_of(args: argparse.Namespace) -> List[Job]:
    """The jobs to run: every GPipe job in every checkpoint mode, the others once."""
    jobs: List[Job] = []
    for name in args.job:
        if name in ('gpipe', 'gpipe-threaded'):
            jobs.extend(Job(name, checkpoint) for checkpoint in args.checkpoint)
        else:
            jobs.append(Job(name, args.checkpoint[0]))
    return list(dict.fromkeys(jobs))  # each once, in order


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.as_rank:
        return rank_main(args.job[0], args.checkpoint[0], args.ending, args.hazard)
    if args.launcher == 'fork':
        # DDP imports it when first built: once here, rather than in every fork.
        import torch._dynamo  # noqa: F401
    tallies = stress(jobs_of(args), args)
    for job, tally in tallies.items():
        ending = 'its own' if job.name == 'example' else args.ending
        rate = tally.failed / tally.done if tally.done else 0.0
        print(f'job {job}, ending {ending}{", hazard" if args.hazard else ""}, '
              f'{args.launcher}: {tally.failed}/{tally.done} runs failed ({rate:.1%}); '
              f'rank outcomes {dict(tally.counts)}', flush=True)
    for job, tally in tallies.items():
        for failure in tally.failures:
            print(f'{job}: {failure}')
    return 1 if any(tally.failed for tally in tallies.values()) else 0


if __name__ == '__main__':
    sys.exit(main())

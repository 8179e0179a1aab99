"""What a benchmark's numbers depend on: versions, machine, threads, devices, commit, duration.

:func:`environment` is the record every result file carries; :func:`threads`
runs a measurement with a given number of intra-op threads.
"""
import contextlib
import os
import platform
import subprocess
import time
from typing import Any, Dict, Iterable, Iterator, List, Optional

import torch

import torchgpipe
from benchmarks import REPO_ROOT, memory

__all__ = ['environment', 'threads', 'cpu_model', 'git']


def git(*command: str) -> Optional[str]:
    """The output of ``git <command>`` in the repository, or None without git or a repository."""
    try:
        out = subprocess.run(['git', *command], cwd=REPO_ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


def cpu_model() -> str:
    """The CPU's model name: from /proc/cpuinfo on Linux, else what :mod:`platform` knows."""
    try:
        with open('/proc/cpuinfo') as cpuinfo:
            for line in cpuinfo:
                key, _, value = line.partition(':')
                if key.strip() in ('model name', 'Model', 'cpu model') and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or 'unknown'


def environment(devices: Iterable[Any], duration: float) -> Dict[str, Any]:
    """The record of a run that took ``duration`` seconds on ``devices``.

    ``git_dirty`` is true when the working tree had uncommitted changes, so
    that the commit alone does not say which code ran.
    """
    commit = git('rev-parse', 'HEAD')
    status = git('status', '--porcelain')
    cuda: List[str] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        'torch': torch.__version__,
        'torchgpipe': torchgpipe.__version__,
        'python': platform.python_version(),
        'platform': platform.platform(),
        'machine': platform.machine(),
        'cpu_model': cpu_model(),
        'cpu_count': os.cpu_count(),
        'torch_threads': torch.get_num_threads(),
        'omp_num_threads': os.environ.get('OMP_NUM_THREADS'),
        'malloc_tuned': memory.malloc_tuned(),
        'cuda': torch.version.cuda,
        'cuda_devices': cuda,
        'devices': [str(d) for d in devices],
        'git_commit': commit.strip() if commit else None,
        'git_dirty': bool(status.strip()) if status is not None else None,
        'time': time.strftime('%Y-%m-%dT%H:%M:%S%z'),
        'duration_seconds': round(duration, 3),
    }


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Runs with ``n`` intra-op threads, restoring the previous number afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

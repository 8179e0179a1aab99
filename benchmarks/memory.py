"""Memory: the peak one training step adds, measured in a fresh process per setting.

On CUDA it is the allocator's peak of allocated bytes on each device. On CPU
all partitions share the host's memory, so it is one figure: large
allocations are forced to ``mmap`` (glibc's ``mallopt``, :func:`fix_malloc`)
so that freed tensors leave the resident set at once, the kernel's
high-water mark is reset right before the measured step
(``/proc/self/clear_refs``), and the step's peak is the high-water mark minus
the resident size before the step. Each setting runs in its own process
(:func:`run_measure_subprocesses`), started as
``python -m benchmarks.<experiment> --measure <json>``; a smoke run's
settings share one.

The allocator matters to timings too: :func:`tune_malloc` makes glibc keep
freed memory for reuse, as a caching allocator does, so that page faults do
not penalize large batches.
"""
import gc
import json
import math
import os
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import torch
from torch import nn

from benchmarks import REPO_ROOT, untraced_environ
from benchmarks.devices import synchronize
from torchgpipe.timeline.recording import peak_rss, proc_status, reset_peak_rss

__all__ = ['GiB', 'MiB', 'parameter_count', 'peak_ratio', 'fix_malloc', 'trim_malloc',
           'tune_malloc',
           'malloc_tuned', 'step_peak_memory', 'run_measure_subprocesses']

GiB = 1024 ** 3
MiB = 1024 ** 2

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

_malloc_tuned = False


def parameter_count(model: nn.Module) -> int:
    """How many numbers the model's parameters hold."""
    return sum(p.numel() for p in model.parameters())


def _mallopt(*options: Tuple[int, int]) -> bool:
    try:
        import ctypes
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return all([bool(mallopt(option, value)) for option, value in options])


def fix_malloc(threshold: int = 64 * 1024) -> bool:
    """For memory measurements: allocations of ``threshold`` bytes or more by ``mmap`` (glibc).

    Freed tensors then leave the resident set at once, instead of staying in
    the heap for reuse, so the resident set follows the live bytes. Called
    after the imports: serving the interpreter's start-up this way is slow.
    """
    return _mallopt((M_MMAP_THRESHOLD, threshold), (M_TRIM_THRESHOLD, 0))


def trim_malloc() -> bool:
    """Returns the heap's free memory to the system (glibc): the resident set, the live bytes."""
    try:
        import ctypes
        return bool(ctypes.CDLL(None).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def tune_malloc() -> bool:
    """For timings on CPU: keep freed memory for reuse instead of returning it (glibc).

    By default glibc serves large blocks by ``mmap`` and returns freed heap
    to the system, so a step allocating tensors of tens of MiB page-faults
    on fresh zeroed pages again and again, which penalizes large batches
    (the unwrapped model's) far more than micro-batches. With the largest
    ``mmap`` threshold glibc allows and no trimming, every setting reuses its
    memory, as it would with a caching allocator. Process-wide; harmless
    apart from keeping the process's peak memory.
    """
    global _malloc_tuned
    _malloc_tuned = _mallopt((M_MMAP_THRESHOLD, 32 * MiB), (M_TRIM_THRESHOLD, 1 << 30))
    return _malloc_tuned


def malloc_tuned() -> bool:
    """Whether :func:`tune_malloc` has tuned this process's allocator."""
    return _malloc_tuned


def _rss() -> int:
    rss = proc_status('VmRSS')
    return rss if rss is not None else peak_rss()


def step_peak_memory(step: Callable[[], None], devices: Sequence[torch.device],
                     ) -> Dict[str, Any]:
    """The peak memory one call of ``step`` adds, per CUDA device or for the host.

    On CUDA, the allocator's peak of allocated bytes on each device. On CPU,
    the resident set's high-water mark minus the resident size before the
    step; meant for a fresh process (see :func:`run_measure_subprocesses`).
    """
    gc.collect()
    cuda = [d for d in dict.fromkeys(devices) if d.type == 'cuda']
    if cuda:
        before = {}
        for d in cuda:
            torch.cuda.synchronize(d)
            torch.cuda.reset_peak_memory_stats(d)
            before[str(d)] = torch.cuda.memory_allocated(d)
        step()
        synchronize(cuda)
        peaks = {str(d): torch.cuda.max_memory_allocated(d) for d in cuda}
        return {'method': 'cuda max_memory_allocated', 'per_device': peaks,
                'before': before, 'peak': sum(peaks.values()),
                'step_peak': sum(peaks[k] - before[k] for k in peaks)}

    reset = reset_peak_rss()
    resident = _rss()
    step()
    added = peak_rss() - resident
    method = 'rss high-water mark (clear_refs)' if reset else 'ru_maxrss'
    return {'method': method, 'per_device': {'host': added}, 'before': resident,
            'peak': added, 'step_peak': added}


def peak_ratio(measured: float, against: float) -> float:
    """``measured / against``, or NaN when ``against`` grew nothing.

    A smoke run's steps are so small that a step may not grow the resident
    set by a single page; its figures mean nothing, but must not crash.
    """
    return measured / against if against else math.nan


def run_measure_subprocesses(module: str, settings: Sequence[Mapping[str, Any]], *,
                             parallel: int = 1, one_process: bool = False,
                             timeout: float = 3600) -> List[Dict[str, Any]]:
    """Runs ``python -m <module> --measure <json>`` per setting in fresh processes.

    The children run with one OpenMP thread; a child measuring CPU memory
    calls :func:`fix_malloc` first. At most ``parallel`` of them run at a
    time (each measures its own resident set, so CPU measurements may
    overlap). With ``one_process``, a single fresh process measures every
    setting one after the other (``--measure`` given a JSON list): for smoke
    runs, whose figures mean nothing, as it saves a process's start-up (some
    seconds of imports) per setting.

    Returns:
        the JSON document each child printed last, in the order of ``settings``
    """
    if one_process:
        measured: List[Dict[str, Any]] = _run_children(
            module, [[dict(s) for s in settings]], 1, timeout)[0]
        return measured
    return _run_children(module, [dict(s) for s in settings], parallel, timeout)


def _run_children(module: str, payloads: Sequence[Any], parallel: int,
                  timeout: float) -> List[Any]:
    """Runs ``python -m <module> --measure <payload as JSON>`` per payload; their last lines."""
    # Measured without coverage.py's tracing (see benchmarks.untraced).
    env = untraced_environ()
    env.update(OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get('PYTHONPATH')) if p))
    pending = list(enumerate(payloads))
    running: List[Tuple[int, subprocess.Popen]] = []  # type: ignore[type-arg]
    outputs: Dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while pending or running:
            while pending and len(running) < max(1, parallel):
                index, payload = pending.pop(0)
                command = [sys.executable, '-m', module, '--measure', json.dumps(payload)]
                running.append((index, subprocess.Popen(
                    command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)))
            index, process = running.pop(0)
            stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if process.returncode != 0:
                raise RuntimeError(f'{module} --measure {json.dumps(payloads[index])} '
                                   f'failed ({process.returncode}):\n{stderr}')
            outputs[index] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for _, process in running:
            process.kill()
            process.wait()
    return [outputs[i] for i in range(len(payloads))]

"""Plumbing shared by the benchmarks: command line, environment, devices, timing, memory, output.

Every experiment module (``unet_speed``, ``amoebanet_speed``, ``unet_memory``,
``transparency``, ``overhead``) has a ``main(argv)`` that parses the options
made by :func:`make_parser`, runs the settings of one named preset, prints a
table, writes ``<output-dir>/<experiment>-<preset>.json`` (results and the
environment) and a plot next to it, and returns the JSON document.

Timing follows the project's rules for a noisy shared machine: one intra-op
thread (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1`` for subprocesses),
variants compared side by side in the same run, and fastest-step (minimum)
statistics, since noise only ever adds time. Timings on CPU first make
glibc's allocator keep freed memory for reuse (:func:`tune_malloc`), as a
caching allocator would, so that page faults do not penalize large batches.

CPU memory is measured in a fresh Python process per setting: large
allocations are forced to ``mmap`` (glibc's ``mallopt``) so that freed
tensors leave the resident set at once, the kernel's high-water mark is reset
right before the measured step (``/proc/self/clear_refs``), and the step's
peak is the high-water mark minus the resident size before the step.
"""
import argparse
import contextlib
import gc
import json
import math
import os
import platform
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence,
                    Tuple, TypeVar)

import torch
from torch import nn

import torchgpipe

__all__ = ['RESULTS_DIR', 'Preset', 'make_parser', 'environment', 'git_commit', 'threads',
           'cpu_devices', 'cuda_devices', 'synchronize', 'even_balance', 'auto_balance',
           'progress', 'format_table', 'write_results', 'save_plot', 'fastest_steps',
           'run_measure_subprocesses', 'step_peak_memory', 'parameter_count', 'GiB', 'MiB',
           'Trainer', 'measure_throughputs', 'size_balance', 'materialize', 'fix_malloc',
           'tune_malloc']

#: Where results go unless ``--output-dir`` says otherwise (git-ignored).
RESULTS_DIR = Path(__file__).resolve().parent / 'results'
REPO_ROOT = Path(__file__).resolve().parent.parent

GiB = 1024 ** 3
MiB = 1024 ** 2

T = TypeVar('T')


class Preset(dict):  # type: ignore[type-arg]
    """A named preset: a dict of settings with a one-line ``description``."""

    def __init__(self, description: str, **settings: Any) -> None:
        super().__init__(**settings)
        self.description = description


def make_parser(prog: str, doc: Optional[str], presets: Mapping[str, Preset],
                default: str = 'cpu') -> argparse.ArgumentParser:
    """The options every experiment shares; the epilog lists the presets."""
    lines = (doc or '').strip().splitlines()
    epilog = 'presets:\n' + '\n'.join(f'  {name:<12} {preset.description}'
                                      for name, preset in presets.items())
    parser = argparse.ArgumentParser(
        prog=f'python -m benchmarks.{prog}', description=lines[0] if lines else None,
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--preset', default=default, choices=list(presets),
                        help=f'named settings to run (default: {default})')
    parser.add_argument('--smoke', action='store_true',
                        help='a couple of steps only, to check that the benchmark runs (CI)')
    parser.add_argument('--output-dir', type=Path, default=RESULTS_DIR,
                        help='where the JSON and the plot go (default: benchmarks/results)')
    parser.add_argument('--no-plot', action='store_true', help='do not draw the plot')
    parser.add_argument('--threads', type=int, default=1,
                        help='intra-op threads, torch.set_num_threads (default: 1)')
    return parser


def git_commit() -> Optional[str]:
    """The checked-out commit of the repository, if git and the repository are there."""
    try:
        out = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=REPO_ROOT, capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() or None


def environment(devices: Iterable[Any]) -> Dict[str, Any]:
    """What the numbers depend on: versions, machine, threads, devices and the commit."""
    env: Dict[str, Any] = {
        'torch': torch.__version__,
        'torchgpipe': torchgpipe.__version__,
        'python': platform.python_version(),
        'platform': platform.platform(),
        'machine': platform.machine(),
        'cpu_count': os.cpu_count(),
        'torch_threads': torch.get_num_threads(),
        'omp_num_threads': os.environ.get('OMP_NUM_THREADS'),
        'malloc_tuned': MALLOC_TUNED,
        'cuda': torch.version.cuda,
        'cuda_devices': [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        'devices': [str(d) for d in devices],
        'git_commit': git_commit(),
        'time': time.strftime('%Y-%m-%dT%H:%M:%S%z'),
    }
    return env


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Runs with ``n`` intra-op threads, restoring the previous number afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def cpu_devices(n: int, *, distinct: bool = True) -> List[torch.device]:
    """``n`` CPU devices: ``cpu:0..n-1`` (a worker thread each) or ``cpu`` n times (inline)."""
    if distinct and n > 1:
        return [torch.device('cpu', i) for i in range(n)]
    return [torch.device('cpu')] * n


def cuda_devices(n: int) -> List[torch.device]:
    """The first ``n`` CUDA devices; exits with a message if there are fewer."""
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if available < n:
        raise SystemExit(f'this preset needs {n} CUDA device(s), {available} visible; '
                         'run a CPU preset instead (--preset cpu)')
    return [torch.device('cuda', i) for i in range(n)]


def synchronize(devices: Iterable[torch.device]) -> None:
    """Waits for every queued kernel on the CUDA devices among ``devices``."""
    for device in dict.fromkeys(devices):
        if device.type == 'cuda':
            torch.cuda.synchronize(device)


def even_balance(num_layers: int, partitions: int) -> List[int]:
    """Splits layers into partitions of nearly equal counts."""
    base, extra = divmod(num_layers, partitions)
    return [base + (j < extra) for j in range(partitions)]


def auto_balance(model: nn.Sequential, partitions: int, sample: Any, device: torch.device,
                 timeout: float) -> Tuple[List[int], str]:
    """A balance by :func:`torchgpipe.balance.balance_by_time`, or an even split without it.

    Returns:
        (balance, method): ``method`` is ``'time'``, ``'even'`` or ``'single'``
    """
    if partitions == 1:
        return [len(model)], 'single'
    try:
        from torchgpipe.balance import balance_by_time
    except ImportError:
        return even_balance(len(model), partitions), 'even'
    try:
        balance = balance_by_time(partitions, model, sample, timeout=timeout, device=device)
    except Exception as exc:  # noqa: BLE001 - any failure falls back to the even split
        warnings.warn(f'balance_by_time failed ({exc!r}); using an even split')
        return even_balance(len(model), partitions), 'even'
    return list(balance), 'time'


def progress(iterable: Iterable[T], *, total: Optional[int] = None, desc: str = '',
             leave: bool = False) -> Iterable[T]:
    """A tqdm progress bar on a terminal (none when tqdm is missing or output is redirected)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    bar: Iterable[T] = tqdm(iterable, total=total, desc=desc, leave=leave, disable=None,
                            dynamic_ncols=True)
    return bar


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: a header, a rule, and right-aligned cells."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ['  '.join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, '  '.join('-' * w for w in widths))
    return '\n'.join(lines)


def results_path(output_dir: Path, experiment: str, preset: str, suffix: str) -> Path:
    return Path(output_dir) / f'{experiment}-{preset}{suffix}'


def write_results(output_dir: Path, experiment: str, preset: str,
                  document: Dict[str, Any]) -> Path:
    """Writes ``<output_dir>/<experiment>-<preset>.json`` and returns its path."""
    path = results_path(output_dir, experiment, preset, '.json')
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + '\n')
    print(f'results: {path}')
    return path


def save_plot(output_dir: Path, experiment: str, preset: str,
              draw: Callable[[Any], None]) -> Optional[Path]:
    """Draws a figure with ``draw(pyplot)`` into ``<experiment>-<preset>.png``.

    Returns None, with a message, when matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print('plot skipped: matplotlib is not installed (pip install matplotlib, '
              "or pip install -e '.[benchmarks]')")
        return None
    path = results_path(output_dir, experiment, preset, '.png')
    path.parent.mkdir(parents=True, exist_ok=True)
    plt.figure(figsize=(6.4, 4.2))
    try:
        draw(plt)
        plt.tight_layout()
        plt.savefig(path, dpi=120)
    finally:
        plt.close('all')
    print(f'plot: {path}')
    return path


def finish(args: Any, experiment: str, config: Mapping[str, Any], outcome: Mapping[str, Any],
           env: Mapping[str, Any], draw: Callable[[Any], None],
           **extra: Any) -> Dict[str, Any]:
    """Writes an experiment's JSON document and its plot; returns the document.

    Args:
        args: the parsed command line (``preset``, ``smoke``, ``output_dir``,
            ``no_plot``)
        experiment: the experiment's name
        config: the settings it ran with
        outcome: its results
        env: :func:`environment` of the run
        draw: draws the plot with ``draw(pyplot)``
        extra: more top-level entries of the document
    """
    document = {'experiment': experiment, 'preset': args.preset, 'smoke': args.smoke,
                'settings': config, **extra, 'environment': env, **outcome}
    write_results(args.output_dir, experiment, args.preset, document)
    if not args.no_plot:
        save_plot(args.output_dir, experiment, args.preset, draw)
    return document


def fastest_steps(steps: Mapping[str, Callable[[], None]], rounds: int, *, warmup: int = 1,
                  desc: str = 'timing') -> Dict[str, float]:
    """The fastest time in seconds of each step function, timed side by side.

    Every round runs each step once, in an order rotated from round to
    round, so that slow spells of a shared machine hit all of them alike.
    """
    names = list(steps)
    for name in names:
        for _ in range(warmup):
            steps[name]()
    best = {name: math.inf for name in names}
    for r in progress(range(rounds), desc=desc):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            steps[name]()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


class Trainer:
    """Trains a model with plain SGD on one synthetic batch, an epoch at a time, timing each.

    The same batch is fed at every step, so that no data loading is timed.

    Args:
        model: the model (plain or GPipe), on its devices
        input: the batch, on the first device
        target: the target, on the last device
        loss_fn: ``loss_fn(output, target)``
        steps_per_epoch: steps of one epoch
        devices: the devices to synchronize before and after each epoch
    """

    def __init__(self, model: nn.Module, input: torch.Tensor, target: torch.Tensor,
                 loss_fn: Callable[[Any, torch.Tensor], torch.Tensor], *, steps_per_epoch: int,
                 devices: Sequence[torch.device]) -> None:
        self.model = model
        self.input = input
        self.target = target
        self.loss_fn = loss_fn
        self.steps_per_epoch = steps_per_epoch
        self.devices = list(devices)
        self.optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
        self.seconds: List[float] = []

    def epoch(self) -> None:
        synchronize(self.devices)
        start = time.perf_counter()
        for _ in range(self.steps_per_epoch):
            self.optimizer.zero_grad(set_to_none=True)
            loss = self.loss_fn(self.model(self.input), self.target)
            loss.backward()
            self.optimizer.step()
        synchronize(self.devices)
        self.seconds.append(time.perf_counter() - start)

    def result(self) -> Dict[str, Any]:
        """Samples/s leaving the first epoch out: the fastest epoch's and the mean."""
        samples = self.steps_per_epoch * len(self.input)
        counted = [samples / t for t in self.seconds[1:]]
        return {'epoch_seconds': self.seconds, 'samples_per_epoch': samples,
                'throughput': max(counted), 'throughput_mean': sum(counted) / len(counted)}


def measure_throughputs(factories: Mapping[str, Callable[[], Trainer]], epochs: int, *,
                        interleave: bool) -> Dict[str, Dict[str, Any]]:
    """Trains every setting for ``epochs`` epochs and returns each :meth:`Trainer.result`.

    The first epoch is a warm-up (allocations, kernel selection) and is not
    counted; ``throughput`` is that of the fastest of the other epochs (noise
    only adds time), ``throughput_mean`` their mean, as the paper reports.

    With ``interleave``, every trainer is built first, and the settings take
    turns epoch by epoch, so that slow spells of a shared machine hit them
    alike (on CPU). Otherwise each setting is built, trained and released in
    turn, so that only one occupies the devices at a time (on CUDA).
    """
    if epochs < 2:
        raise ValueError('at least two epochs: the first one is not counted')
    results: Dict[str, Dict[str, Any]] = {}
    if interleave:
        trainers = {name: factory() for name, factory in factories.items()}
        for _ in progress(range(epochs), desc='epochs (settings interleaved)'):
            for trainer in trainers.values():
                trainer.epoch()
        return {name: trainer.result() for name, trainer in trainers.items()}
    for name, factory in factories.items():
        trainer = factory()
        for _ in progress(range(epochs), desc=name):
            trainer.epoch()
        results[name] = trainer.result()
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def size_balance(model: nn.Sequential, partitions: int, sample: torch.Tensor, *,
                 param_scale: float = 2.0) -> Tuple[List[int], str]:
    """A balance by estimated memory, computed on the ``meta`` device (any model size).

    A layer costs ``param_scale`` times its parameter bytes (the parameters
    and their gradients under plain SGD) plus the bytes of its output for
    ``sample`` (a micro-batch, on the meta device). The costs are split by
    :func:`torchgpipe.balance.blockpartition.solve`, evenly without it.
    """
    if partitions == 1:
        return [len(model)], 'single'
    costs: List[int] = []
    x: Any = sample
    with torch.no_grad():
        for layer in model:
            x = layer(x)
            outputs = (x,) if isinstance(x, torch.Tensor) else x
            activation = sum(t.numel() * t.element_size() for t in outputs)
            params = sum(p.numel() * p.element_size() for p in layer.parameters())
            costs.append(int(param_scale * params + activation))
    try:
        from torchgpipe.balance.blockpartition import solve
    except ImportError:
        return even_balance(len(model), partitions), 'even'
    return [len(block) for block in solve(costs, partitions)], 'size (meta)'


def materialize(model: nn.Sequential, balance: Sequence[int],
                devices: Sequence[torch.device]) -> nn.Sequential:
    """Allocates a ``meta`` model's layers on their partitions' devices, freshly initialized.

    A model too large for one device (or for the host) is built on the meta
    device, and each layer is then allocated straight on its own device.
    """
    layers = iter(model)
    for count, device in zip(balance, devices):
        for _ in range(count):
            layer = next(layers)
            layer.to_empty(device=device)
            for module in layer.modules():
                reset = getattr(module, 'reset_parameters', None)
                if callable(reset):
                    reset()
    return model


# Memory ---------------------------------------------------------------------------------------

def _proc_status(key: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status in bytes (Linux only)."""
    try:
        with open('/proc/self/status') as status:
            for line in status:
                if line.startswith(key + ':'):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _mallopt(*options: Tuple[int, int]) -> bool:
    try:
        import ctypes
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return all([bool(mallopt(option, value)) for option, value in options])


M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def fix_malloc(threshold: int = 64 * 1024) -> bool:
    """For memory measurements: allocations of ``threshold`` bytes or more by ``mmap`` (glibc).

    Freed tensors then leave the resident set at once, instead of staying in
    the heap for reuse, so the resident set follows the live bytes. Called
    after the imports: serving the interpreter's start-up this way is slow.
    """
    return _mallopt((M_MMAP_THRESHOLD, threshold), (M_TRIM_THRESHOLD, 0))


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
    global MALLOC_TUNED
    MALLOC_TUNED = _mallopt((M_MMAP_THRESHOLD, 32 * MiB), (M_TRIM_THRESHOLD, 1 << 30))
    return MALLOC_TUNED


#: Whether :func:`tune_malloc` has tuned this process's allocator.
MALLOC_TUNED = False


def _reset_peak_rss() -> bool:
    try:
        with open('/proc/self/clear_refs', 'w') as clear_refs:
            clear_refs.write('5')
        return True
    except OSError:
        return False


def _max_rss() -> int:
    peak = _proc_status('VmHWM')
    if peak is not None:
        return peak
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == 'darwin' else maxrss * 1024


def _rss() -> int:
    rss = _proc_status('VmRSS')
    return rss if rss is not None else _max_rss()


def step_peak_memory(step: Callable[[], None], devices: Sequence[torch.device],
                     ) -> Dict[str, Any]:
    """The peak memory one call of ``step`` adds, per CUDA device or for the host.

    On CUDA, the allocator's peak of allocated bytes on each device. On CPU,
    the resident set's high-water mark minus the resident size before the
    step; meant for a fresh process (see :func:`run_measure_subprocess`).
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

    reset = _reset_peak_rss()
    resident = _rss()
    step()
    added = _max_rss() - resident
    method = 'rss high-water mark (clear_refs)' if reset else 'ru_maxrss'
    return {'method': method, 'per_device': {'host': added}, 'before': resident,
            'peak': added, 'step_peak': added}


def run_measure_subprocesses(module: str, settings: Sequence[Mapping[str, Any]], *,
                             parallel: int = 1, timeout: float = 3600) -> List[Dict[str, Any]]:
    """Runs ``python -m <module> --measure <json>`` per setting in fresh processes.

    The children run with one OpenMP thread; a child measuring CPU memory
    calls :func:`fix_malloc` first. At most ``parallel`` of them run at a
    time (each measures its own resident set, so CPU measurements may
    overlap).

    Returns:
        the JSON document each child printed last, in the order of ``settings``
    """
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS='1', PYTHONPATH=os.pathsep.join(
        p for p in (str(REPO_ROOT), env.get('PYTHONPATH')) if p))
    pending = list(enumerate(settings))
    running: List[Tuple[int, subprocess.Popen]] = []  # type: ignore[type-arg]
    outputs: Dict[int, Dict[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while pending or running:
            while pending and len(running) < max(1, parallel):
                index, setting = pending.pop(0)
                command = [sys.executable, '-m', module, '--measure', json.dumps(dict(setting))]
                running.append((index, subprocess.Popen(
                    command, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True)))
            index, process = running.pop(0)
            stdout, stderr = process.communicate(timeout=max(1.0, deadline - time.monotonic()))
            if process.returncode != 0:
                raise RuntimeError(f'{module} --measure {json.dumps(dict(settings[index]))} '
                                   f'failed ({process.returncode}):\n{stderr}')
            outputs[index] = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for _, process in running:
            process.kill()
            process.wait()
    return [outputs[i] for i in range(len(settings))]

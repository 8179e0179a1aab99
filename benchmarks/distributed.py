"""Across processes: DistributedGPipe against torch.distributed.pipelining, on 2 ranks of 1 thread.

Run from the repository root::

    python -m benchmarks.distributed                  # 2 CPU ranks over gloo (~3 min)
    python -m benchmarks.distributed --preset cuda    # 2 GPUs over NCCL, one per rank

The model and batch of ``benchmarks.schedules``' parallelism row: 8 x
(Conv2d(32, 32, 3, padding=1) + ReLU) on 32x32 images, batch 64, chunks 8,
no checkpointing, an MSE loss. Two processes of a gloo group, one intra-op
thread each, train it with each schedule two ways, in turns round after round:

- the anchor: ``torch.distributed.pipelining``'s schedule over its
  ``PipelineStage`` objects: ``Schedule1F1B`` and ``ScheduleInterleavedZeroBubble``
  on one stage of 4 blocks per rank, ``ScheduleInterleaved1F1B`` on two stages
  of 2 blocks per rank in a loop (stages 0 and 2 on rank 0), ``ScheduleZBVZeroBubble``
  on two in a V (stages 0 and 3 on rank 0);
- :class:`torchgpipe.distributed.DistributedGPipe` with the same partitions
  and ``schedule='1f1b'`` (target: at most 1.10x the anchor's step),
  ``'zb_h1'``, ``'interleaved_1f1b'`` (``placement='loop'``) and ``'zbv'``
  (``placement='v'``), each at most 1.0x the anchor's; ``'fill_drain'`` for
  information.

Each step starts after a barrier; its time is the slowest rank's. Between
rounds, while rank 1 waits, rank 0 times more steps for comparison, in
the same run: the one-process ``GPipe.train_step`` of each schedule on
``cpu:0`` and ``cpu:1`` (a worker thread each, one intra-op thread each: the
same two cores as the two ranks; the one-process steps of interleaved 1F1B,
ZB-H1 and ZBV: at most 1.0x the anchor's too) and the unwrapped model on one
thread. The figures
are the fastest step of the rounds, with the medians beside them. On CPU,
each rank keeps freed memory for reuse (:func:`benchmarks.memory.tune_malloc`),
as the other CPU timings do.

Every step does the same work: the forward and backward passes of the whole
mini-batch from the same initial parameters (gradients accumulate, no
optimizer; the anchor returns no outputs, as ``train_step`` does not). The
parameters never change, so every step's mini-batch loss is the same: the
largest relative difference between the steps' losses is reported, and must
be float rounding.
"""
import functools
import os
import socket
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from benchmarks import untraced
from benchmarks.devices import cpu_devices, cuda_devices
from benchmarks.memory import malloc_tuned, tune_malloc
from benchmarks.overhead import convnet, ms
from benchmarks.report import format_spread, format_table
from benchmarks.runner import Experiment, Figure, Preset, main as run_main
from benchmarks.timing import spread, warmup_steps

PRESETS: Dict[str, Preset] = {
    'cpu': Preset('8 convolutions, batch 64 of 32x32, chunks 8, 2 CPU ranks over gloo (~3 min)',
                  backend='gloo', batch=64, image_size=32, chunks=8, rounds=30),
    'cuda': Preset('the same on 2 GPUs over NCCL, one per rank, batch 256 of 64x64',
                   backend='nccl', batch=256, image_size=64, chunks=8, rounds=10),
}

#: Smoke: 4 micro-batches, and no warm-up round before the timed one.
SMOKE = dict(batch=8, image_size=8, chunks=4, rounds=1, warmup=0)

#: Each schedule of ours, and the anchor's that matches it: its class, and where
#: its stages are (per rank, as indices of 2 or 4 stages).
SCHEDULES = {
    '1f1b': ('Schedule1F1B', 'one'),
    'interleaved_1f1b': ('ScheduleInterleaved1F1B', 'loop'),
    'zb_h1': ('ScheduleInterleavedZeroBubble', 'one'),
    'zbv': ('ScheduleZBVZeroBubble', 'v'),
}
#: The largest ratio allowed: each of our steps over the anchor's matching one (1F1B:
#: 1.10x; the others, and the one-process train_step of each: 1.0x).
TARGETS = {'1f1b': 1.10, 'interleaved_1f1b': 1.0, 'zb_h1': 1.0, 'zbv': 1.0}
TARGET = TARGETS['1f1b']


def anchor_name(schedule: str) -> str:
    return f'pipelining {SCHEDULES[schedule][0]}, 2 ranks'


def ours_name(schedule: str) -> str:
    return f'DistributedGPipe {schedule}, 2 ranks'


def one_process_name(schedule: str) -> str:
    return f'GPipe.train_step {schedule}, 1 process'


ANCHOR = anchor_name('1f1b')
OURS = ours_name('1f1b')
FILL_DRAIN = "DistributedGPipe fill-drain, 2 ranks"
ONE_PROCESS = one_process_name('1f1b')
UNWRAPPED = 'unwrapped, 1 thread'
# In rank 1 a step whose time rank 0 alone measures: nothing to do.
RANK_0_ONLY = tuple(one_process_name(s) for s in SCHEDULES) + (UNWRAPPED,)

#: One step; returns the mini-batch loss where this rank has it, else None.
Step = Callable[[], Optional[torch.Tensor]]


def stage_indices(layout: str, rank: int) -> List[int]:
    """The stages of ``rank`` among 2 (``'one'``) or 4 (two per rank, a loop or a V)."""
    return {'one': [rank], 'loop': [rank, rank + 2], 'v': [rank, 3 - rank]}[layout]


def device_of(config: Dict[str, Any], rank: int) -> torch.device:
    return torch.device('cuda', rank) if config['backend'] == 'nccl' else torch.device('cpu')


def sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def ranks_steps(config: Dict[str, Any], rank: int) -> Dict[str, Step]:
    """The steps this rank runs, by name, each on a copy of the same initial model."""
    import torch.distributed.pipelining as pipelining

    from torchgpipe import GPipe
    from torchgpipe.distributed import DistributedGPipe

    device = device_of(config, rank)
    torch.manual_seed(0)
    model = convnet()
    size, chunks = config['image_size'], config['chunks']
    input = torch.randn(config['batch'], 32, size, size, device=device)
    target = torch.zeros_like(input)

    def copy() -> nn.Sequential:
        fresh = convnet()
        fresh.load_state_dict(model.state_dict())
        return fresh

    def anchor(schedule: str) -> Step:
        name, layout = SCHEDULES[schedule]
        stages = 2 if layout == 'one' else 4
        layers, per = list(copy()), len(model) // stages
        mine = stage_indices(layout, rank)
        built = [pipelining.PipelineStage(
            nn.Sequential(*layers[k * per:(k + 1) * per]).to(device), k, stages, device)
            for k in mine]
        runner = getattr(pipelining, name)(built if layout != 'one' or 'Interleaved' in name
                                           else built[0], n_microbatches=chunks,
                                           loss_fn=F.mse_loss)

        def step() -> Optional[torch.Tensor]:
            args = (input,) if 0 in mine else ()
            if stages - 1 not in mine:
                runner.step(*args, return_outputs=False)
                sync(device)
                return None
            losses: List[torch.Tensor] = []
            runner.step(*args, target=target, losses=losses, return_outputs=False)
            sync(device)
            # Micro-batches of equal sizes: the mean of their losses is the mini-batch's.
            return torch.stack(losses).detach().mean()
        return step

    def ours(schedule: str, pipe: DistributedGPipe) -> Step:
        def step() -> Optional[torch.Tensor]:
            loss = pipe.train_step(input, target, F.mse_loss, schedule=schedule)
            sync(device)
            return loss
        return step

    steps: Dict[str, Step] = {}
    for schedule, (_, layout) in SCHEDULES.items():
        steps[anchor_name(schedule)] = anchor(schedule)
        balance = [len(model) // 2] * 2 if layout == 'one' else [len(model) // 4] * 4
        pipe = DistributedGPipe(copy(), balance, chunks=chunks, checkpoint='never',
                                device=device, placement='v' if layout == 'v' else 'loop')
        steps[ours_name(schedule)] = ours(schedule, pipe)
        if schedule == '1f1b':
            steps[FILL_DRAIN] = ours('fill_drain', pipe)
        if rank == 0 and config['backend'] == 'gloo':
            a, b = cpu_devices(2)
            devices = {'one': [a, b], 'loop': [a, b, a, b], 'v': [a, b, b, a]}[layout]
            gpipe = GPipe(copy(), balance, devices=devices, chunks=chunks, checkpoint='never')
            # The public GPipe.train_step refuses to run inside a torch.distributed
            # job of several processes (for data parallelism it points to
            # torchgpipe.distributed.train_step); the job here is the other
            # steps', so the step is timed through its core's, which is what
            # train_step runs after its checks.
            steps[one_process_name(schedule)] = functools.partial(
                gpipe.core.train, input, target, F.mse_loss, schedule, 'mean', gpipe.training)
    if rank == 0 and config['backend'] == 'gloo':
        plain = copy()

        def unwrapped() -> torch.Tensor:
            loss = F.mse_loss(plain(input), target)
            loss.backward()
            return loss.detach()
        steps[UNWRAPPED] = unwrapped
    return steps


def rank_main(rank: int, world_size: int, port: int, config: Dict[str, Any],
              results: Any) -> None:
    """One rank: times every step, round after round, and sends rank 0's table to the parent."""
    torch.set_num_threads(1)
    device = device_of(config, rank)
    if config['backend'] == 'gloo':
        # As the other CPU timings do (benchmarks.memory.tune_malloc): freed
        # memory is reused, as a caching allocator would, rather than page-faulted
        # in again, in every rank, for every step alike.
        tune_malloc()
    else:
        # NCCL's barriers and the anchor's exchange of shapes (object
        # collectives) run on the current device: this rank's, not cuda:0.
        torch.cuda.set_device(device)
    dist.init_process_group(config['backend'], init_method=f'tcp://127.0.0.1:{port}',
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=120),
                            device_id=device if device.type == 'cuda' else None)
    steps = ranks_steps(config, rank)
    names = [n for s in SCHEDULES for n in (anchor_name(s), ours_name(s))] + [FILL_DRAIN] \
        + list(RANK_0_ONLY if config['backend'] == 'gloo' else ())
    seconds: Dict[str, List[float]] = {name: [] for name in names}
    losses: Dict[str, float] = {}
    warmup = warmup_steps(config)  # rounds, untimed
    for r in range(warmup + config['rounds']):
        # Turns rotate, so that slow spells of the machine hit every step alike.
        for name in names[r % len(names):] + names[:r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            loss = steps[name]() if name in steps else None
            # On the device: NCCL has no CPU tensors (CPU to CPU for gloo).
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64,
                                   device=device)
            if name not in RANK_0_ONLY:
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's time
            if r >= warmup:
                seconds[name].append(float(elapsed))
            if loss is not None:
                losses[name] = float(loss)
    # The loss of each step where it is computed: on the rank of the last
    # stage (rank 0 for a V), and on rank 0 for its own steps.
    gathered: List[Any] = [None, None]
    dist.all_gather_object(gathered, losses)
    if rank == 0:
        results.put({'times': {name: spread(s) for name, s in seconds.items() if name in steps},
                     'losses': {**gathered[0], **gathered[1]},
                     'malloc_tuned': malloc_tuned()})
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no Python shutdown: see docs/scaling_out.rst, "Ending a job"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(('127.0.0.1', 0))
        port: int = sock.getsockname()[1]
        return port


def spawn_ranks(target: Callable[..., None], world_size: int, config: Dict[str, Any],
                timeout: float) -> Any:
    """Runs ``target(rank, world_size, port, config, results)`` in ``world_size`` processes.

    Returns:
        what rank 0 put in ``results``

    Raises:
        RuntimeError: a rank failed, or none reported within ``timeout`` seconds
    """
    ctx = mp.get_context('spawn')
    results = ctx.SimpleQueue()
    port = free_port()
    ranks = [ctx.Process(target=target, args=(rank, world_size, port, config, results),
                         daemon=True) for rank in range(world_size)]
    with untraced():
        for process in ranks:
            process.start()
    try:
        deadline = time.monotonic() + timeout
        while results.empty():
            if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in ranks):
                raise RuntimeError('the ranks did not report: exit codes '
                                   f'{[p.exitcode for p in ranks]} (None: running)')
            time.sleep(0.1)
        return results.get()
    finally:
        for process in ranks:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    if config['backend'] == 'nccl':
        cuda_devices(2)  # exits with a message without 2 CUDA devices, one per rank
    reported = spawn_ranks(rank_main, 2, config, 60 + 20 * config['rounds'])
    times, losses = reported['times'], reported['losses']
    rows = [ratio(ours_name(s), anchor_name(s), times, TARGETS[s]) for s in SCHEDULES]
    rows.append(ratio(FILL_DRAIN, ANCHOR, times))
    if ONE_PROCESS in times:
        rows += [ratio(one_process_name(s), anchor_name(s), times,
                       TARGETS[s] if s != '1f1b' else None) for s in SCHEDULES]
        rows += [ratio(OURS, ONE_PROCESS, times), ratio(OURS, UNWRAPPED, times)]
    reference = losses[ANCHOR]
    return {'results': rows, 'times': {name: ms(t) for name, t in times.items()},
            'target': TARGET, 'losses': losses,
            'max_loss_difference': max(abs(v - reference) for v in losses.values())
            / abs(reference),
            'ranks_malloc_tuned': reported['malloc_tuned']}


def ratio(measured: str, against: str, times: Dict[str, Dict[str, float]],
          target: Optional[float] = None) -> Dict[str, Any]:
    row: Dict[str, Any] = {'measured': measured, 'against': against,
                           'ratio': times[measured]['min'] / times[against]['min'],
                           'ratio_median': times[measured]['median'] / times[against]['median']}
    if target is not None:
        row['target'] = target
        row['within_target'] = row['ratio'] <= target
    return row


def table(document: Dict[str, Any]) -> str:
    results = document['results']
    headers = ['ratio of', 'ratio (fastest)', 'ratio (medians)', 'target']
    cells = [[f"{r['measured']} / {r['against']}", f"{r['ratio']:.3f}x",
              f"{r['ratio_median']:.3f}x", f"<= {r['target']:g}x" if 'target' in r else '-']
             for r in results]
    if not document['smoke']:
        headers.append('within target')
        cells = [row + ['-' if 'target' not in r else 'yes' if r['within_target'] else 'NO']
                 for row, r in zip(cells, results)]
    return '\n'.join(['steps timed side by side in one run, one intra-op thread per rank '
                      '(per worker):', format_table(headers, cells), '',
                      'step times, ms: fastest (median, max) of the rounds',
                      format_table(['step', 'time'], [[name, format_spread(t)] for name, t
                                                      in document['times'].items()]),
                      '', 'the same mini-batch loss in every step: largest relative '
                      f"difference {document['max_loss_difference']:.1e}"])


def headline(document: Dict[str, Any]) -> List[Figure]:
    return [Figure(f"{row['measured']} / {row['against']}", f"{row['ratio']:.3f}x",
                   f"<= {row['target']:g}x", row['within_target'])
            for row in document['results'] if 'target' in row]


def plot(document: Dict[str, Any], plt: Any) -> None:
    """The step times as bars: the fastest, with a whisker to the median."""
    times = document['times']
    names = list(times)
    figure = plt.gcf()
    figure.set_size_inches(9, 4)
    axes = plt.gca()
    fastest = [times[n]['min'] for n in names]
    medians = [times[n]['median'] for n in names]
    axes.barh(range(len(names)), fastest,
              xerr=[[0] * len(names), [m - f for m, f in zip(medians, fastest)]], capsize=4,
              color=['tab:gray' if n.startswith('pipelining') else 'tab:blue' for n in names])
    axes.set_yticks(list(range(len(names))))
    axes.set_yticklabels(names, fontsize='small')
    axes.invert_yaxis()
    axes.set_xlabel('step time, ms (fastest; whisker to the median)')
    axes.set_title('a pipeline of 2 ranks against torch.distributed.pipelining (grey)',
                   fontsize='medium')
    figure.tight_layout()


EXPERIMENT = Experiment(name='distributed', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run,
                        table=table, headline=headline, plot=plot)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

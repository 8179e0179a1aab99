"""Across processes: DistributedGPipe against torch.distributed.pipelining, on 2 or 4 ranks.

Run from the repository root::

    python -m benchmarks.distributed                  # 2 CPU ranks over gloo (~3 min)
    python -m benchmarks.distributed --preset cpu4    # 4 CPU ranks over gloo (~5 min)
    python -m benchmarks.distributed --preset cuda    # 2 GPUs over NCCL, one per rank

The model and batch of ``benchmarks.schedules``' parallelism row: 8 x
(Conv2d(32, 32, 3, padding=1) + ReLU) on 32x32 images, batch 64, chunks 8,
no checkpointing, an MSE loss. The processes of a gloo group (``p`` of
them), one intra-op thread each, train it with each schedule two ways, in
turns round after round:

- the anchor: ``torch.distributed.pipelining``'s schedule over its
  ``PipelineStage`` objects: ``Schedule1F1B`` and ``ScheduleInterleavedZeroBubble``
  on one stage of ``8 / p`` blocks per rank, ``ScheduleInterleaved1F1B`` on two
  stages per rank in a loop (stages ``r`` and ``r + p`` on rank ``r``),
  ``ScheduleZBVZeroBubble`` on two in a V (stages ``r`` and ``2p - 1 - r``);
- :class:`torchgpipe.distributed.DistributedGPipe` with the same partitions
  and ``schedule='1f1b'`` and ``'zb_h1'`` (target: at most 0.97x the
  anchor's step), ``'interleaved_1f1b'`` (``placement='loop'``) and
  ``'zbv'`` (``placement='v'``) (target: at most 1.0x); ``'fill_drain'``
  for information.

A *latency-bound* pair, where messages rather than compute make the step
(as on a GPU, whose micro-batches compute in microseconds): four
``Linear(16, 16)``, batch 8, four micro-batches, 1F1B, no checkpointing,
``Schedule1F1B`` against ``DistributedGPipe`` (target: at most 1.2x).

Each step starts after a barrier; its time is the slowest rank's. On 2 CPU
ranks, between rounds, while rank 1 waits, rank 0 times more steps for
comparison, in the same run: the one-process ``GPipe.train_step`` of each
schedule on ``cpu:0`` and ``cpu:1`` (a worker thread each, one intra-op
thread each: the same two cores as the two ranks; target: at most 0.90x the
anchor's 2-process step) and the unwrapped model on one thread.

A ratio is a *paired median*: the median, over the rounds, of the two
steps' ratio in the same round, which cancels the machine's slow spells
that hit both; the ratios of the fastest steps and of the medians are
reported beside it. On CPU,
each rank keeps freed memory for reuse (:func:`benchmarks.memory.tune_malloc`),
as the other CPU timings do.

Every step does the same work: the forward and backward passes of the whole
mini-batch from the same initial parameters (gradients accumulate, no
optimizer; the anchor returns no outputs, as ``train_step`` does not). The
parameters never change, so every step's mini-batch loss is the same: the
largest relative difference between the steps' losses is reported, and must
be float rounding.
"""
import copy
import functools
import os
import socket
import statistics
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
                  backend='gloo', batch=64, image_size=32, chunks=8, rounds=30, ranks=2),
    'cpu4': Preset('the same on 4 CPU ranks over gloo, 2 per core (~5 min)',
                   backend='gloo', batch=64, image_size=32, chunks=8, rounds=20, ranks=4),
    'cuda': Preset('the same on 2 GPUs over NCCL, one per rank, batch 256 of 64x64',
                   backend='nccl', batch=256, image_size=64, chunks=8, rounds=10, ranks=2),
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
#: The largest ratio allowed: each of our steps over the anchor's matching one.
TARGETS = {'1f1b': 0.97, 'interleaved_1f1b': 1.0, 'zb_h1': 0.97, 'zbv': 1.0}
#: On more ranks than cores, which is noisy: every schedule at par.
CROWDED_TARGET = 1.0
TARGET = TARGETS['1f1b']
#: The latency-bound pair's target: our step over the anchor's, on 2 ranks.
LATENCY_TARGET = 1.2
#: The latency-bound model: its layers, width, batch and micro-batches.
LATENCY = dict(layers=4, width=16, batch=8, chunks=4)
#: The largest ratio allowed: the one-process train_step of each schedule
#: over the anchor's step on 2 ranks.
ONE_PROCESS_TARGET = 0.90


def anchor_name(schedule: str, ranks: int = 2) -> str:
    return f'pipelining {SCHEDULES[schedule][0]}, {ranks} ranks'


def ours_name(schedule: str, ranks: int = 2) -> str:
    return f'DistributedGPipe {schedule}, {ranks} ranks'


def one_process_name(schedule: str) -> str:
    return f'GPipe.train_step {schedule}, 1 process'


def fill_drain_name(ranks: int = 2) -> str:
    return f'DistributedGPipe fill-drain, {ranks} ranks'


def latency_names(ranks: int) -> List[str]:
    """The latency-bound pair's steps: the anchor's, then ours."""
    return [f'pipelining Schedule1F1B, latency-bound, {ranks} ranks',
            f'DistributedGPipe 1f1b, latency-bound, {ranks} ranks']


ANCHOR = anchor_name('1f1b')
OURS = ours_name('1f1b')
FILL_DRAIN = fill_drain_name()
ONE_PROCESS = one_process_name('1f1b')
UNWRAPPED = 'unwrapped, 1 thread'
# In rank 1 a step whose time rank 0 alone measures: nothing to do.
RANK_0_ONLY = tuple(one_process_name(s) for s in SCHEDULES) + (UNWRAPPED,)

#: One step; returns the mini-batch loss where this rank has it, else None.
Step = Callable[[], Optional[torch.Tensor]]


def stage_indices(layout: str, rank: int, ranks: int = 2) -> List[int]:
    """The stages of ``rank`` among ``ranks`` (``'one'``) or twice as many (two
    per rank, a loop or a V)."""
    return {'one': [rank], 'loop': [rank, rank + ranks],
            'v': [rank, 2 * ranks - 1 - rank]}[layout]


def device_of(config: Dict[str, Any], rank: int) -> torch.device:
    return torch.device('cuda', rank) if config['backend'] == 'nccl' else torch.device('cpu')


def one_process(config: Dict[str, Any]) -> bool:
    """Whether rank 0 times the one-process steps too: on 2 CPU ranks, whose cores they use."""
    return config['backend'] == 'gloo' and config['ranks'] == 2


def sync(device: torch.device) -> None:
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def ranks_steps(config: Dict[str, Any], rank: int) -> Dict[str, Step]:
    """The steps this rank runs, by name, each on a copy of the same initial model."""
    import torch.distributed.pipelining as pipelining

    from torchgpipe import GPipe
    from torchgpipe.distributed import DistributedGPipe

    device = device_of(config, rank)
    ranks = config['ranks']
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
        stages = ranks if layout == 'one' else 2 * ranks
        layers, per = list(copy()), len(model) // stages
        mine = stage_indices(layout, rank, ranks)
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
        steps[anchor_name(schedule, ranks)] = anchor(schedule)
        stages = ranks if layout == 'one' else 2 * ranks
        balance = [len(model) // stages] * stages
        pipe = DistributedGPipe(copy(), balance, chunks=chunks, checkpoint='never',
                                device=device, placement='v' if layout == 'v' else 'loop')
        steps[ours_name(schedule, ranks)] = ours(schedule, pipe)
        if schedule == '1f1b':
            steps[fill_drain_name(ranks)] = ours('fill_drain', pipe)
        if rank == 0 and one_process(config):
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
    steps.update(latency_bound(config, rank))
    if rank == 0 and one_process(config):
        plain = copy()

        def unwrapped() -> torch.Tensor:
            loss = F.mse_loss(plain(input), target)
            loss.backward()
            return loss.detach()
        steps[UNWRAPPED] = unwrapped
    return steps


def latency_bound(config: Dict[str, Any], rank: int) -> Dict[str, Step]:
    """The latency-bound pair's steps on this rank: the anchor's, then ours."""
    import torch.distributed.pipelining as pipelining

    from torchgpipe.distributed import DistributedGPipe

    device = device_of(config, rank)
    ranks, width = config['ranks'], LATENCY['width']
    torch.manual_seed(0)
    layers = [nn.Linear(width, width).to(device) for _ in range(LATENCY['layers'])]
    input = torch.randn(LATENCY['batch'], width, device=device)
    target = torch.randn(LATENCY['batch'], width, device=device)
    per = len(layers) // ranks
    mine = nn.Sequential(*[copy.deepcopy(layer) for layer in layers[rank * per:(rank + 1) * per]])
    runner = pipelining.Schedule1F1B(pipelining.PipelineStage(mine, rank, ranks, device),
                                     n_microbatches=LATENCY['chunks'], loss_fn=F.mse_loss)

    def anchor() -> Optional[torch.Tensor]:
        if rank == 0:
            runner.step(input, return_outputs=False)
        elif rank < ranks - 1:
            runner.step(return_outputs=False)
        else:
            losses: List[torch.Tensor] = []
            runner.step(target=target, losses=losses, return_outputs=False)
            sync(device)
            return torch.stack(losses).detach().mean()
        sync(device)
        return None
    pipe = DistributedGPipe(nn.Sequential(*copy.deepcopy(layers)), [per] * ranks,
                            chunks=LATENCY['chunks'], checkpoint='never', device=device)

    def ours() -> Optional[torch.Tensor]:
        loss = pipe.train_step(input, target, F.mse_loss, schedule='1f1b')
        sync(device)
        return loss
    theirs_name, ours_name_ = latency_names(ranks)
    return {theirs_name: anchor, ours_name_: ours}


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
    ranks = config['ranks']
    names = [n for s in SCHEDULES for n in (anchor_name(s, ranks), ours_name(s, ranks))] + \
        [fill_drain_name(ranks)] + latency_names(ranks) + \
        list(RANK_0_ONLY if one_process(config) else ())
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
    gathered: List[Any] = [None] * world_size
    dist.all_gather_object(gathered, losses)
    if rank == 0:
        timed = {name: s for name, s in seconds.items() if name in steps}
        results.put({'times': {name: spread(s) for name, s in timed.items()},
                     'seconds': timed,
                     'losses': {k: v for theirs in gathered for k, v in theirs.items()},
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
    ranks = config['ranks']
    if config['backend'] == 'nccl':
        cuda_devices(ranks)  # exits with a message without a CUDA device per rank
    reported = spawn_ranks(rank_main, ranks, config, 60 + 20 * ranks * config['rounds'])
    times, losses, seconds = reported['times'], reported['losses'], reported['seconds']
    anchor = anchor_name('1f1b', ranks)
    rows = [ratio(ours_name(s, ranks), anchor_name(s, ranks), seconds,
                  TARGETS[s] if ranks == 2 else CROWDED_TARGET) for s in SCHEDULES]
    rows.append(ratio(fill_drain_name(ranks), anchor, seconds))
    theirs, ours = latency_names(ranks)
    rows.append(ratio(ours, theirs, seconds, LATENCY_TARGET if ranks == 2 else None))
    if ONE_PROCESS in times:
        rows += [ratio(one_process_name(s), anchor_name(s), seconds, ONE_PROCESS_TARGET)
                 for s in SCHEDULES]
        rows += [ratio(OURS, ONE_PROCESS, seconds), ratio(OURS, UNWRAPPED, seconds)]
    reference = losses[anchor]
    return {'results': rows, 'times': {name: ms(t) for name, t in times.items()},
            'ranks': ranks, 'target': TARGET, 'losses': losses,
            'max_loss_difference': max(abs(v - reference) for name, v in losses.items()
                                       if name not in (theirs, ours)) / abs(reference),
            'latency_loss_difference': abs(losses[ours] - losses[theirs]) / abs(losses[theirs]),
            'ranks_malloc_tuned': reported['malloc_tuned']}


def ratio(measured: str, against: str, seconds: Dict[str, List[float]],
          target: Optional[float] = None) -> Dict[str, Any]:
    """``measured``'s step over ``against``'s: the paired median (the headline),
    and the ratios of the fastest steps and of the medians."""
    ours, theirs = seconds[measured], seconds[against]
    row: Dict[str, Any] = {
        'measured': measured, 'against': against,
        'ratio': statistics.median(a / b for a, b in zip(ours, theirs)),
        'ratio_fastest': min(ours) / min(theirs),
        'ratio_median': statistics.median(ours) / statistics.median(theirs)}
    if target is not None:
        row['target'] = target
        row['within_target'] = row['ratio'] <= target
    return row


def table(document: Dict[str, Any]) -> str:
    results = document['results']
    headers = ['ratio of', 'paired median', 'fastest', 'medians', 'target']
    cells = [[f"{r['measured']} / {r['against']}", f"{r['ratio']:.3f}x",
              f"{r['ratio_fastest']:.3f}x", f"{r['ratio_median']:.3f}x",
              f"<= {r['target']:g}x" if 'target' in r else '-'] for r in results]
    if not document['smoke']:
        headers.append('within target')
        cells = [row + ['-' if 'target' not in r else 'yes' if r['within_target'] else 'NO']
                 for row, r in zip(cells, results)]
    return '\n'.join(['steps timed side by side in one run, one intra-op thread per rank '
                      '(per worker); ratios: the median of the rounds\' ratios (paired), '
                      'of the fastest steps, of the median steps:',
                      format_table(headers, cells), '',
                      'step times, ms: fastest (median, max) of the rounds',
                      format_table(['step', 'time'], [[name, format_spread(t)] for name, t
                                                      in document['times'].items()]),
                      '', 'the same mini-batch loss in every step: largest relative '
                      f"difference {document['max_loss_difference']:.1e} (latency-bound pair: "
                      f"{document.get('latency_loss_difference', 0.0):.1e})"])


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
    axes.set_title(f"a pipeline of {document['ranks']} ranks against "
                   'torch.distributed.pipelining (grey)',
                   fontsize='medium')
    figure.tight_layout()


EXPERIMENT = Experiment(name='distributed', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run,
                        table=table, headline=headline, plot=plot)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

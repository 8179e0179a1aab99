"""Sharded stages: DistributedGPipe x FSDP2 against x DDP and against torch.distributed.pipelining.

Run from the repository root::

    python -m benchmarks.sharded                      # 4 CPU ranks over gloo (~2 min)

On a DeviceMesh of pp 2 x dp 2, a stack of transformer MLP blocks
(``Linear(d, 4d)``, GELU, ``Linear(4d, d)``, a residual) trains with Adam,
each dp rank on its half of the global batch, 1F1B, no checkpointing, three
ways on the same ranks, in turns round after round:

- **ours x FSDP2**: :class:`~torchgpipe.distributed.DistributedGPipe` over
  ``pp``, ``fully_shard`` on each of a rank's blocks over ``dp``
  (``reshard_after_forward=False``); the pipeline drives the units;
- **ours x DDP**: the same pipeline, its replicas under
  ``DistributedDataParallel`` over ``dp`` (:func:`torchgpipe.distributed.train_step`);
- **the anchor**: torch.distributed.pipelining's ``Schedule1F1B`` over a
  ``PipelineStage`` of the same blocks, each a ``fully_shard`` unit and the
  stage its root, as torchtitan builds it; pipelining drives FSDP.

Two figures, each with its target:

- *memory at rest* per rank after ``optimizer.step()``, what the parameters,
  gradients and Adam's states hold (this rank's shards), counted from the
  tensors: ours x FSDP2 over ours x DDP (target: at most 0.6x). The peak a
  step adds to the resident set (the largest rank's, in each way's second
  step, freed memory returned at once) is reported beside it;
- *step time*: ours x FSDP2 over the anchor, a paired median (the median
  over the rounds of the two steps' ratio in the same round, which cancels
  the machine's slow spells; target: at most 1.0x); each step's time is the
  slowest rank's, after a barrier.

Beside them, the peak a rank's resident set grows by while it builds its
sharded stage (``DistributedGPipe``, then ``fully_shard``): from a model
built on the meta device, each rank materializing its own shards
(``pipe.to_empty()``, then values), against every rank building the whole
model first; and the share of the model's parameters a rank keeps. Last,
each pipeline plans the model with ``torchgpipe.plan(..., shards=2)``
(Adam's ``param_scale``), and the plan's prediction of the configuration
timed here (``plan.predict``) is set beside the measurements: each rank's
peak in a step (what it holds at rest and what the step adds) and the
median ``train_step`` (without ``zero_grad`` and the optimizer's step).

Every way starts from the same parameters and takes the same steps: the
largest relative difference between their losses at each step is reported
and must be float rounding.
"""
import os
import statistics
import sys
import time
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.distributed import ratio, spawn_ranks
from benchmarks.memory import MiB, fix_malloc, step_peak_memory, trim_malloc, tune_malloc
from benchmarks.overhead import ms
from benchmarks.report import format_spread, format_table
from benchmarks.runner import Experiment, Figure, Preset, main as run_main
from benchmarks.timing import spread, warmup_steps

PRESETS: Dict[str, Preset] = {
    'cpu': Preset('8 MLP blocks of width 256, global batch 32 x 16 tokens, chunks 4 per dp '
                  'rank, 4 CPU ranks (pp 2 x dp 2) over gloo (~2 min)',
                  blocks=8, width=256, batch=32, tokens=16, chunks=4, rounds=30),
}

#: Smoke: a narrow model, one round, no warm-up.
SMOKE = dict(width=16, batch=8, tokens=4, rounds=1, warmup=0)

FSDP = 'DistributedGPipe x FSDP2'
DDP = 'DistributedGPipe x DDP'
ANCHOR = 'pipelining Schedule1F1B x FSDP2'
WAYS = (FSDP, DDP, ANCHOR)
#: The largest ratios allowed: memory at rest against DDP's, step time against the anchor's.
MEMORY_TARGET = 0.6
TIME_TARGET = 1.0


class Block(nn.Module):
    """A transformer's MLP block with its residual."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(x)))


def blocks(config: Dict[str, Any]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[Block(config['width']) for _ in range(config['blocks'])])


def at_rest(module: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """The bytes this rank holds of the parameters, gradients and optimizer states."""
    def held(t: Optional[Tensor]) -> int:
        if t is None:
            return 0
        local = t.to_local() if hasattr(t, 'to_local') else t
        return local.numel() * local.element_size()
    parameters = list(module.parameters())
    return sum(held(p) + held(p.grad) for p in parameters) + sum(
        held(v) for state in optimizer.state.values() for v in state.values()
        if isinstance(v, Tensor))


def ways(config: Dict[str, Any], mesh: Any) -> Dict[str, Any]:
    """This rank's three ways: each one's step (returning the loss where it is known), and
    its module and optimizer."""
    import torch.distributed.pipelining as pipelining
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from torchgpipe.distributed import DistributedGPipe
    from torchgpipe.distributed import train_step as ddp_step

    pp, dp = mesh.get_local_rank('pp'), mesh.get_local_rank('dp')
    model = blocks(config)
    per = config['blocks'] // 2
    share = config['batch'] // 2
    generator = torch.Generator().manual_seed(1)
    whole = torch.randn(config['batch'], config['tokens'], config['width'], generator=generator)
    input = whole[dp * share:(dp + 1) * share]
    target = torch.zeros_like(input)

    def copy() -> nn.Sequential:
        fresh = blocks(config)
        fresh.load_state_dict(model.state_dict())
        return fresh

    def adam(module: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.Adam(module.parameters(), lr=1e-4)

    built: Dict[str, Any] = {}
    pipe = DistributedGPipe(copy(), [per, per], chunks=config['chunks'], checkpoint='never',
                            group=mesh['pp'].get_group())
    for layer in pipe.children():
        fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
    built[FSDP] = (pipe, adam(pipe), lambda m: m.train_step(input, target, F.mse_loss))

    replica = DistributedGPipe(copy(), [per, per], chunks=config['chunks'],
                               checkpoint='never', group=mesh['pp'].get_group())
    ddp = DistributedDataParallel(replica, process_group=mesh['dp'].get_group())
    built[DDP] = (ddp, adam(ddp), lambda m: ddp_step(m, input, target, F.mse_loss))

    stage = nn.Sequential(*list(copy())[pp * per:(pp + 1) * per])
    for block in stage:
        fully_shard(block, mesh=mesh['dp'], reshard_after_forward=False)
    fully_shard(stage, mesh=mesh['dp'], reshard_after_forward=False)
    schedule = pipelining.Schedule1F1B(
        pipelining.PipelineStage(stage, pp, 2, torch.device('cpu'),
                                 group=mesh['pp'].get_group()),
        n_microbatches=config['chunks'], loss_fn=F.mse_loss)

    def anchor(_: nn.Module) -> Optional[Tensor]:
        if pp == 0:
            schedule.step(input, return_outputs=False)
            return None
        losses: List[Tensor] = []
        schedule.step(target=target, losses=losses, return_outputs=False)
        return torch.stack(losses).detach().mean()
    built[ANCHOR] = (stage, adam(stage), anchor)

    def step(name: str) -> Callable[[], Optional[Tensor]]:
        module, optimizer, forward_backward = built[name]

        def run() -> Optional[Tensor]:
            optimizer.zero_grad()
            start = time.perf_counter()
            loss = forward_backward(module)
            passes[name] = time.perf_counter() - start
            optimizer.step()
            return loss
        return run
    #: The seconds of each way's last forward and backward passes, without the optimizer.
    passes: Dict[str, float] = {}
    return {'steps': {name: step(name) for name in WAYS}, 'passes': passes,
            'held': {name: built[name][:2] for name in WAYS}, 'data': (input, target)}


def prediction(config: Dict[str, Any], mesh: Any, input: Tensor, target: Tensor,
               ) -> Dict[str, Any]:
    """What :func:`torchgpipe.plan`, on this rank's pipeline with ``shards=2`` and Adam's
    ``param_scale``, predicts of the configuration timed here: the step's seconds and
    each rank's peak bytes."""
    import torchgpipe
    per = config['blocks'] // 2
    plan = torchgpipe.plan(blocks(config), input, group=mesh['pp'].get_group(),
                           target=target, loss_fn=F.mse_loss, param_scale=4.0,
                           shards=2, chunks=config['chunks'], schedules=['1f1b'],
                           checkpoint=['never'])
    option = plan.predict('1f1b', [per, per], chunks=config['chunks'], checkpoint='never')
    return {'step': option.step, 'memory': option.memory}


def build(config: Dict[str, Any], mesh: Any, meta: bool) -> None:
    """Builds this rank's sharded stage: from the whole model, or (``meta``) from one
    built on the meta device, materializing this rank's shards alone."""
    from torch.distributed.fsdp import fully_shard

    from torchgpipe.distributed import DistributedGPipe
    per = config['blocks'] // 2
    with torch.device('meta' if meta else 'cpu'):
        model = blocks(config)
    pipe = DistributedGPipe(model, [per, per], chunks=config['chunks'],
                            group=mesh['pp'].get_group())
    for layer in pipe.children():
        fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
    if meta:
        pipe.to_empty()
        with torch.no_grad():
            for p in pipe.parameters():
                p.to_local().normal_(std=0.02)  # values: the pages, taken


def building_peaks(config: Dict[str, Any], mesh: Any) -> Dict[str, int]:
    """The peak this rank's resident set grows by while it builds its stage each way,
    after a build of two blocks each way (what is made once, paid)."""
    for meta in (True, False):
        build({**config, 'blocks': 2}, mesh, meta)
    peaks = {}
    for meta in (True, False):
        trim_malloc()
        dist.barrier()
        peaks['meta' if meta else 'whole'] = step_peak_memory(
            lambda: build(config, mesh, meta), [])['step_peak']
    return peaks


def rank_main(rank: int, world_size: int, port: int, config: Dict[str, Any],
              results: Any) -> None:
    """One rank: measures each way's memory, then times them round after round, and sends
    rank 0's figures to the parent."""
    from torch.distributed.device_mesh import init_device_mesh
    torch.set_num_threads(1)
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=120))
    mesh = init_device_mesh('cpu', (2, 2), mesh_dim_names=('pp', 'dp'))
    fix_malloc()  # freed memory leaves the resident set at once, until the timings
    building = building_peaks(config, mesh)
    built = ways(config, mesh)
    steps = built['steps']
    losses: Dict[str, List[float]] = {name: [] for name in WAYS}

    def record(name: str, loss: Optional[Tensor]) -> None:
        if loss is not None:
            losses[name].append(float(loss))
    # Memory first: each way's second step (its first allocates Adam's states, and
    # whatever else is made once).
    for name in WAYS:
        record(name, steps[name]())
    peaks: Dict[str, int] = {}
    for name in WAYS:
        trim_malloc()
        dist.barrier()
        loss: List[Optional[Tensor]] = []
        peaks[name] = step_peak_memory(lambda: loss.append(steps[name]()), [])['step_peak']
        record(name, loss[0])
    rest = {name: at_rest(*built['held'][name]) for name in WAYS}
    tune_malloc()  # then timings, freed memory kept for reuse as a caching allocator does
    seconds: Dict[str, List[float]] = {name: [] for name in WAYS}
    passes: List[float] = []  # ours x FSDP2's, the planner's prediction beside them
    warmup = warmup_steps(config)
    for r in range(warmup + config['rounds']):
        for name in WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]:
            dist.barrier()
            start = time.perf_counter()
            record(name, steps[name]())
            elapsed = torch.tensor([time.perf_counter() - start, built['passes'][name]],
                                   dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's
            if r >= warmup:
                seconds[name].append(float(elapsed[0]))
                if name == FSDP:
                    passes.append(float(elapsed[1]))
    predicted = prediction(config, mesh, *built['data'])
    figures = {'at_rest': rest, 'peak': peaks, 'losses': losses, 'building': building,
               'predicted': predicted}
    gathered: List[Any] = [None] * world_size
    dist.all_gather_object(gathered, figures)
    if rank == 0:
        results.put({'seconds': seconds, 'passes': passes, 'ranks': gathered})
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no Python shutdown: see docs/scaling_out.rst, "Ending a job"


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    reported = spawn_ranks(rank_main, 4, config, 120 + 30 * config['rounds'])
    seconds, ranks = reported['seconds'], reported['ranks']
    rest = {name: max(r['at_rest'][name] for r in ranks) for name in WAYS}
    peak = {name: max(r['peak'][name] for r in ranks) for name in WAYS}
    # The loss of each step, on the ranks of the last stage: the mean over dp.
    losses = {name: [statistics.mean(values) for values in zip(
        *[r['losses'][name] for r in ranks if r['losses'][name]])] for name in WAYS}
    reference = losses[ANCHOR]
    building = {way: max(r['building'][way] for r in ranks) / MiB for way in ('meta', 'whole')}
    model_mib = sum(p.numel() * p.element_size() for p in blocks(config).parameters()) / MiB
    memory = {'measured': FSDP, 'against': DDP, 'ratio': rest[FSDP] / rest[DDP],
              'target': MEMORY_TARGET}
    memory['within_target'] = memory['ratio'] <= MEMORY_TARGET
    # Rank r is pp r // 2 of its pipeline: the planner's worker. Its peak in a step: what
    # it holds at rest, and what the step adds.
    planner = {'step_ms': [1000 * r['predicted']['step'] for r in ranks],
               'memory_mib': [r['predicted']['memory'][n // 2] / MiB
                              for n, r in enumerate(ranks)],
               'measured_mib': [(r['at_rest'][FSDP] + r['peak'][FSDP]) / MiB for r in ranks],
               'passes_ms': 1000 * statistics.median(reported['passes'])}
    # The memory ratio, the step time's (both with targets), and DDP's step time.
    return {'results': [memory, ratio(FSDP, ANCHOR, seconds, TIME_TARGET),
                        ratio(DDP, ANCHOR, seconds)],
            'at_rest_mib': {name: rest[name] / MiB for name in WAYS},
            'step_peak_mib': {name: peak[name] / MiB for name in WAYS},
            # The largest rank's; a rank keeps a quarter of the model (pp 2 x dp 2).
            'building_peak_mib': building, 'model_mib': model_mib, 'planner': planner,
            'times': {name: ms(spread(s)) for name, s in seconds.items()},
            'max_loss_difference': max(
                abs(a - b) / abs(b) for name in WAYS for a, b in zip(losses[name], reference))}


def table(document: Dict[str, Any]) -> str:
    labels = ['memory at rest', 'step time (paired median)', 'step time (paired median)']
    rows = [[f"{label}, {r['measured']} / {r['against']}", f"{r['ratio']:.3f}x",
             f"<= {r['target']:g}x" if 'target' in r else '-',
             ('yes' if r['within_target'] else 'NO') if 'target' in r else '-']
            for label, r in zip(labels, document['results'])]
    if document['smoke']:
        rows = [row[:3] for row in rows]
    headers = ['figure', 'value', 'target'] + ([] if document['smoke'] else ['within target'])
    per_way = [[name, f"{document['at_rest_mib'][name]:.2f}",
                f"{document['step_peak_mib'][name]:.2f}",
                format_spread(document['times'][name])] for name in WAYS]
    return '\n'.join([
        'pp 2 x dp 2 on 4 CPU ranks, one intra-op thread each:',
        format_table(headers, rows), '',
        'per rank (the largest): MiB at rest (parameters, gradients, Adam), MiB a step adds '
        'at its peak; step time, ms: fastest (median, max)',
        format_table(['way', 'at rest', 'step peak', 'step time'], per_way), '',
        'building a rank\'s sharded stage, MiB its resident set grows by at the peak '
        f"(the largest rank's; the model's parameters: {document['model_mib']:.2f} MiB, a "
        f"rank's share: {document['model_mib'] / 4:.2f}):",
        format_table(['built', 'peak'], [
            ['on the meta device, each rank its shards',
             f"{document['building_peak_mib']['meta']:.2f}"],
            ['whole on every rank', f"{document['building_peak_mib']['whole']:.2f}"]]), '',
        'torchgpipe.plan(..., shards=2) on each pipeline, for this configuration (x FSDP2), '
        'against the measurement:',
        format_table(['rank', 'step, ms', 'peak MiB predicted', 'peak MiB measured'], [
            [str(n), f'{step:.1f}', f'{predicted:.2f}', f'{measured:.2f}']
            for n, (step, predicted, measured) in enumerate(zip(
                *(document['planner'][k] for k in ('step_ms', 'memory_mib', 'measured_mib'))))])
        + f"\n(measured: {document['planner']['passes_ms']:.1f} ms, the median train_step; "
        f"{document['times'][FSDP]['median']:.1f} ms with zero_grad and Adam's step)", '',
        'the same losses every way: largest relative difference '
        f"{document['max_loss_difference']:.1e}"])


def headline(document: Dict[str, Any]) -> List[Figure]:
    return [Figure(f"{row['measured']} / {row['against']}, {what}", f"{row['ratio']:.3f}x",
                   f"<= {row['target']:g}x", row['within_target'])
            for what, row in zip(('memory at rest', 'step time'), document['results'])]


def plot(document: Dict[str, Any], plt: Any) -> None:
    """Memory at rest and step time of each way, side by side."""
    figure, (memory, times) = plt.subplots(1, 2, figsize=(10, 3.5))
    colors = ['tab:blue', 'tab:cyan', 'tab:gray']
    memory.barh(WAYS, [document['at_rest_mib'][n] for n in WAYS], color=colors)
    memory.set_xlabel('MiB per rank at rest (parameters, gradients, Adam)')
    memory.invert_yaxis()
    fastest = [document['times'][n]['min'] for n in WAYS]
    medians = [document['times'][n]['median'] for n in WAYS]
    times.barh(WAYS, fastest, color=colors, capsize=4,
               xerr=[[0] * len(WAYS), [m - f for m, f in zip(medians, fastest)]])
    times.set_xlabel('step time, ms (fastest; whisker to the median)')
    times.set_yticklabels([])
    times.invert_yaxis()
    figure.suptitle('pp 2 x dp 2: sharded stages against replicas and against '
                    'torch.distributed.pipelining (grey)', fontsize='medium')
    figure.tight_layout()


EXPERIMENT = Experiment(name='sharded', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run,
                        table=table, headline=headline, plot=plot)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

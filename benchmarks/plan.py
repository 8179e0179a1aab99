"""The planner: how close its predictions come, and what its choice gains, on CPU workers.

Run from the repository root::

    python -m benchmarks.plan                  # 3 models on cpu:0 and cpu:1 (~7-10 min)
    python -m benchmarks.plan --preset cpu2    # the same across 2 processes (~15-30 min)
    python -m benchmarks.plan --preset cpu4    # the same across 4 processes (~25-45 min)
    python -m benchmarks.plan --preset cuda    # the same models, larger, on 4 CUDA devices

For each of three models, :func:`torchgpipe.plan` plans for the devices
(one intra-op thread per worker, ``--threads 1``), then a grid of
configurations is measured: every configuration's pipeline is made, then
each takes a training step in turn, traced by :func:`torchgpipe.trace`, for
a few rounds (the median step; see :func:`in_rounds`):

- an MLP: 12 blocks of ``Linear(512, 512)`` and ReLU, batch 64, MSE loss;
- a CNN with skips: a bottleneck ResNet of 3 stages (its shortcuts are skip
  connections), 32x32 images, batch 32, cross-entropy;
- a transformer with a large-vocabulary head: GPT-2 of 4 blocks, 128 wide,
  a vocabulary of 16384, flattened by :func:`torchgpipe.to_sequential`, 16
  sequences of 64 tokens, cross-entropy over the vocabulary; planned under a
  memory limit: the least the even split with 1F1B needs without
  checkpointing, at its best number of micro-batches for memory.

The grid: every schedule with its layouts (one partition per worker;
interleaved 1F1B with two per worker in a loop; ZBV with two in a V), the
time-optimal balance of :func:`torchgpipe.balance.blockpartition.solve`,
chunks 1, 2, 4, ... up to the batch or 32, and every checkpoint mode; plus
the plan's choice, and the configurations the planner's pilot stepped to
find its pace (1F1B, one balance per micro-batch size; see :func:`pilots`).
Three tables:

- prediction against measurement, every configuration measured (targets:
  median error within 10%, none beyond 20%). The pilot's configurations are
  predicted at what the pilot measured, by construction: their errors (the
  *pilot drift*) are how far the machine moved between the planner's
  first minute and the grid's rounds, a floor under the others';
- the choice against the fastest configuration of the grid that fits the
  memory limit by prediction (target: within 5%);
- on the transformer, the plan against the even split by layer count with
  1F1B (its best chunks and checkpoint mode within the limit), timed side by
  side, a paired median (target: at most 0.85x).

Last, the time :func:`torchgpipe.plan` takes for an MLP of 100 layers (target:
under a minute).

The ablation: after its plan, each model is planned again with each of the
planner's corrections left out in turn (:data:`CORRECTIONS`, :func:`without`),
each such plan's choice measured with the grid, and every configuration of
the grid predicted by it. A correction earns its lines where leaving it out
raises the grid's median error, or moves the choice away from the grid's
fastest, by more than the *repeat difference* (two measurements of one
configuration: the medians of its odd and of its even rounds).

The presets ``cpu2`` and ``cpu4`` plan the same models for a
:class:`~torchgpipe.distributed.DistributedGPipe` over 2 or 4 processes
(``torchgpipe.plan(..., group=...)``, one intra-op thread per process) and
measure each configuration there (see :mod:`benchmarks.plan_ranks`), each
rank's peak memory too: a fourth table, the predicted peak of each rank
against its measured one (target: within 10%). The even split is not
compared there.
"""
import contextlib
import copy
import gc
import statistics
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgpipe
from benchmarks.devices import cpu_devices, cuda_devices, synchronize
from benchmarks import plan_ranks
from benchmarks.models.resnet import resnet
from benchmarks.report import format_table
from benchmarks.runner import Experiment, Figure, Preset, main as run_main
from torchgpipe import GPipe, Plan
from torchgpipe.planner.calibrate import traced_span
from torchgpipe.planner.option import Option
from torchgpipe.planner.calibrate import in_turns
from torchgpipe.planner.pilot import time_balance
from torchgpipe.engine.generators import BUILT_INS

Row = Dict[str, Any]
Loss = Callable[[Any, Tensor], Tensor]

MODES = ['never', 'except_last', 'always']
PRESETS: Dict[str, Preset] = {
    'cpu': Preset('an MLP, a CNN with skips and a transformer on cpu:0 and cpu:1 (~7-10 min)',
                  device='cpu', workers=2, scale=1, rounds=7, most_chunks=32,
                  models=['mlp', 'cnn', 'transformer'], layers_100=100,
                  modes=MODES, limited='transformer'),
    'cpu2': Preset('the same models on 2 processes, one CPU thread each (~15-30 min)',
                   device='cpu', ranks=2, scale=1, rounds=7, most_chunks=32,
                   models=['mlp', 'cnn', 'transformer'], modes=MODES, limited='transformer'),
    'cpu4': Preset('the same models on 4 processes, one CPU thread each (~25-45 min)',
                   device='cpu', ranks=4, scale=1, rounds=7, most_chunks=32,
                   models=['mlp', 'cnn', 'transformer'], modes=MODES, limited='transformer'),
    'cuda': Preset('the same models, 4 times wider, on 4 CUDA devices',
                   device='cuda', workers=4, scale=4, rounds=7, most_chunks=32,
                   models=['mlp', 'cnn', 'transformer'], layers_100=100,
                   modes=MODES, limited='transformer'),
}
#: Smoke: the MLP stands in for the transformer, whose capture alone takes seconds.
SMOKE = dict(scale=0, rounds=1, most_chunks=2, layers_100=8, models=['mlp'], limited='mlp',
             modes=['never'])

TARGETS = {'median error': 0.10, 'largest error': 0.20, 'choice over the best': 1.05,
           'plan over the even split': 0.85, 'planning 100 layers': 60.0,
           'median memory error': 0.10, 'largest memory error': 0.10}


def model(name: str, scale: int, device: torch.device
          ) -> Tuple[nn.Sequential, Tensor, Tensor, Loss]:
    """A model of the benchmark, its batch, target and loss; ``scale`` 0 is a tiny one."""
    torch.manual_seed(0)
    if name == 'mlp':
        width = 512 * scale or 16
        module = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.ReLU())
                                 for _ in range(12)])
        input, target = torch.randn(64, width), torch.randn(64, width)
        loss: Loss = F.mse_loss
    elif name == 'cnn':
        module = resnet((1, 1, 1), width=16 * scale or 4, num_classes=10, batch_norm=False,
                        small_input=True)
        input, target = torch.randn(32, 3, 32, 32), torch.randint(0, 10, (32,))
        loss = F.cross_entropy
    else:
        module, input, target, loss = transformer(scale)
    return module.to(device), input.to(device), target.to(device), loss


def transformer(scale: int) -> Tuple[nn.Sequential, Tensor, Tensor, Loss]:
    """GPT-2 with a large vocabulary, flattened; its loss over the vocabulary."""
    import transformers
    vocabulary = 16384 if scale else 512
    config = transformers.GPT2Config(n_layer=4, n_embd=128 * max(scale, 1) if scale else 16,
                                     n_head=4, vocab_size=vocabulary, n_positions=64,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    sequential = torchgpipe.to_sequential(transformers.GPT2LMHeadModel(config))
    interface = sequential.interface
    input = torch.randint(0, vocabulary, (16, 64))

    def loss(output: Any, labels: Tensor) -> Tensor:
        logits = interface.outputs(output).logits
        return F.cross_entropy(logits.reshape(-1, vocabulary), labels.reshape(-1))
    return sequential, interface.inputs(input_ids=input), torch.randint(0, vocabulary, (16, 64)), \
        loss


#: Untimed steps of a configuration as its pipeline is made, before the rounds.
WARM_UP = 2
#: Times one training step of a configuration: its span, in seconds, as a trace gives it.
StepTimer = Callable[[], float]


def traced_step(module: nn.Sequential, option: Option, plan: Plan, input: Tensor,
                target: Tensor, loss: Loss) -> Tuple[StepTimer, Row]:
    """A configuration's pipeline on the plan's devices, after :data:`WARM_UP` steps, and
    the function that times one more step of it (traced), its gradients made anew, as
    after ``zero_grad()`` (the planner predicts such a step, and its pilot times them).

    On CUDA devices the pipeline is made again before each step, untimed: the
    pipelines of the other configurations moved the layers to their devices
    since (CPU devices share one memory, where nothing moves).
    """
    layout = Plan(option, [], plan.devices, None)
    pipe = GPipe(module, **layout.kwargs)
    moved = any(device.type != 'cpu' for device in pipe.devices)

    def step() -> None:
        pipe.train_step(input, target, loss, schedule=option.schedule)
        synchronize(pipe.devices)
    for _ in range(WARM_UP):
        step()

    def timer() -> float:
        nonlocal pipe
        if moved:
            pipe = GPipe(module, **layout.kwargs)
        module.zero_grad(set_to_none=True)  # as a training loop does, before its step
        return traced_span(pipe, step)
    return timer, {}


def in_rounds(timers: Sequence[StepTimer], rounds: int) -> List[Tuple[float, Row]]:
    """The median of ``rounds`` steps of each configuration, and each step's time
    (``steps``), measured in turns: a round times one step of each, after a round to
    warm up.

    The machine has slow spells of a second or more: measured one after the
    other, two runs of the same configuration came out up to a third apart
    (their medians of five steps). In turns, a spell falls on one step of
    many configurations, which their medians leave out.

    What ran before (the planner's copies, the pipelines just made) is
    collected first, and what is left is frozen out of the collector's
    reach, so that no collection of it falls within a step timed (the first
    two or three steps after a collection ran slower, by up to half, on the
    MLP).
    """
    gc.collect()
    gc.freeze()
    try:
        measured = in_turns(timers, rounds)
    finally:
        gc.unfreeze()
    return [(statistics.median(steps), {'steps': steps}) for steps in measured]


def grid(plan: Plan, most_chunks: int, batch: int, modes: Sequence[str]) -> List[Option]:
    """Every schedule and layout, the time-optimal balance, chunks in powers of two, every mode."""
    costs = plan.costs
    assert costs is not None
    middle = costs.sizes[len(costs.sizes) // 2]
    options: List[Option] = []
    for schedule, facts in BUILT_INS.items():
        for virtual, _ in facts.shapes:
            n = virtual * len(plan.devices)
            if n > costs.layers or virtual == 4:
                continue
            balance = list(time_balance(costs, middle, n))
            chunks = 1
            while chunks <= min(most_chunks, batch):
                for mode in modes:
                    options.append(plan.predict(schedule, balance, chunks, mode))
                chunks *= 2
    return options


def pilots(plan: Plan, most_chunks: int) -> List[Option]:
    """The configurations the planner's pilot stepped to find its pace: 1F1B without
    checkpointing, one partition per worker, the balance that evens the layers' times, at
    each micro-batch size the mini-batch splits into evenly (see
    :mod:`torchgpipe.planner.pilot`), in at most ``most_chunks`` micro-batches (the
    grid's most: the MLP's pilot of 64 is left out).

    Each is predicted at the median step the pilot measured, by construction,
    where the pilot's steps gave its size a pace (a size they could not, which
    takes its neighbours', did not happen in the committed runs): measured
    again in the grid, its error is the machine's drift between the planner's
    first minute and the grid's rounds, not the time model's. The balance is
    found again from the paced costs, which scale each size's layers by one
    factor: the pilot's but for a tie of two balances.
    """
    costs = plan.costs
    assert costs is not None
    p = len(plan.devices)
    found: List[Option] = []
    if not costs.pace:  # no pilot: CUDA devices, or one worker
        return found
    for size in costs.sizes:
        chunks = costs.batch // size
        if chunks <= most_chunks and chunks * size == costs.batch:
            found.append(plan.predict('1f1b', list(time_balance(costs, size, p)), chunks,
                                      'never'))
    return found


#: The planner's corrections to what it measured, each left out in turn by :func:`without`
#: (the ablation of ``summary``): the pilot's pace (:mod:`torchgpipe.planner.pilot`), and
#: across processes the message costs calibrated on the group
#: (:func:`~torchgpipe.planner.calibrate.message_cost`,
#: :func:`~torchgpipe.planner.calibrate.skip_cost`). (The ranks that loaded the machine
#: while rank 0 timed the layers, the *companions*, and the trials of the few predicted
#: fastest earned nothing and were removed: see docs/benchmarks.rst.)
CORRECTIONS = ('pilot pace', 'group calibration')


def corrections(workers: int, processes: bool) -> List[str]:
    """The corrections a plan for ``workers`` CPU workers (or processes) makes."""
    if workers < 2:
        return []
    return list(CORRECTIONS if processes else CORRECTIONS[:1])


@contextlib.contextmanager
def without(correction: Optional[str]) -> Iterator[None]:
    """The planner with ``correction`` left out (``None``: none): the pace 1 at every size,
    or messages costing nothing beside the overhead per task."""
    import torchgpipe.planner as planner
    if correction is None:
        yield
        return
    patches = {
        'pilot pace': [mock.patch.object(planner.pilot, 'pace',
                                         lambda costs, *_: [1.0] * len(costs.sizes))],
        'group calibration': [mock.patch.object(planner, 'wide_step', lambda *_: 0.0),
                              mock.patch.object(planner, 'message_cost',
                                                lambda *_: (0.0, 0.0)),
                              mock.patch.object(planner, 'skip_overhead', lambda *_: 0.0)],
    }[correction]
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        yield


#: Readies one configuration: ``(module, option, plan, input, target, loss)`` to the
#: :data:`StepTimer` of its steps and any further figures of its row.
Ready = Callable[..., Tuple[StepTimer, Row]]


#: The plans of one model: with every correction (``None``) and without each one.
Plans = Dict[Optional[str], Plan]


def plan_model(name: str, config: Dict[str, Any], device: torch.device, where: Row,
               **kwargs: Any) -> Plan:
    """:func:`torchgpipe.plan` of one model, its loss and its most micro-batches
    (``where``: the planner's ``devices`` or ``group``), with further ``kwargs``."""
    module, input, target, loss = model(name, config['scale'], device)
    return torchgpipe.plan(module, input, **where, target=target, loss_fn=loss,
                           chunks=most_chunks(config, input), **kwargs)


def planned(name: str, config: Dict[str, Any], device: torch.device, where: Row,
            correction: Optional[str], limit: Optional[float],
            sync: Callable[[], object] = lambda: None) -> Tuple[Plan, float]:
    """Plans one model without ``correction`` (``None``: with every one) under ``limit``;
    the plan, and the seconds planning took."""
    sync()
    started = time.perf_counter()
    with without(correction):
        plan = plan_model(name, config, device, where, memory_limit=limit)
    return plan, time.perf_counter() - started


def batch_of(input: Any) -> int:
    """The batch size of a model's input: its tensor's, or its first tensor's."""
    return int(input.size(0) if isinstance(input, Tensor) else input[0].size(0))


def most_chunks(config: Dict[str, Any], input: Any) -> int:
    """The most micro-batches of the grid and the planner: the preset's, or the batch."""
    return min(config['most_chunks'], batch_of(input))


def limit_for(name: str, config: Dict[str, Any], device: torch.device, workers: int,
              where: Row) -> Optional[float]:
    """The memory limit the model is planned under (``None`` but for the limited one)."""
    if name != config['limited']:
        return None
    module, input, _, _ = model(name, config['scale'], device)
    return limit_of(lambda **kwargs: plan_model(name, config, device, where, **kwargs),
                    len(module), workers, most_chunks(config, input))


def measured_rows(name: str, config: Dict[str, Any], device: torch.device, plans: Plans,
                  planning: float, limit: Optional[float], ready: Ready
                  ) -> Tuple[Dict[str, Any], Tuple[Any, ...]]:
    """Measures the choices of ``plans`` and the grid's other configurations in rounds
    (:func:`in_rounds`), each readied by ``ready``.

    Returns:
        the model's result, and what the even split needs: the module, the
        plan, the input, the target, the loss and the batch size
    """
    module, input, target, loss = model(name, config['scale'], device)
    batch, most = batch_of(input), most_chunks(config, input)
    plan = plans[None]
    variants = {c: v for c, v in plans.items() if c is not None}
    piloted = pilots(plan, most)
    planned = grid(plan, most, batch, config['modes'])
    # The choices, then the grid's configurations, then the pilot's, each once.
    unique: Dict[str, Option] = {}
    for option in [plan.chosen, *planned, *[v.chosen for v in variants.values()], *piloted]:
        unique.setdefault(option.describe(), option)
    options = list(unique.values())
    pilot_keys = {o.describe() for o in piloted}
    grid_keys = {o.describe() for o in planned}
    readied = [ready(module, option, plan, input, target, loss) for option in options]
    rows = [{'model': name, 'configuration': option.describe(), 'predicted': option.step,
             'measured': measured, 'fits': limit is None or max(option.memory) <= limit,
             'memory': max(option.memory), 'chosen': option is plan.chosen,
             'pilot': option.describe() in pilot_keys, 'grid': option.describe() in grid_keys,
             'without': {c: v.predict(option.schedule, option.balance, option.chunks,
                                      option.checkpoint).step for c, v in variants.items()},
             **more, **steps}
            for option, (_, more), (measured, steps) in zip(
                options, readied, in_rounds([timer for timer, _ in readied], config['rounds']))]
    costs = plan.costs
    assert costs is not None
    # What the planner measured of the pipeline itself, beside the layers.
    calibration = {'overhead': costs.overhead, 'checkpoint_overhead': costs.checkpoint_overhead,
                   'split_overhead': costs.split_overhead, 'transfer': list(costs.transfer),
                   'skip_overhead': costs.skip_overhead,
                   'pace': costs.pace, 'cores': costs.cores}
    result = {'model': name, 'plan': str(plan), 'planning_seconds': planning, 'limit': limit,
              'calibration': calibration, 'rows': rows,
              'chosen_without': {c: v.chosen.describe() for c, v in variants.items()}}
    return result, (module, plan, input, target, loss, batch)


def model_rows(name: str, config: Dict[str, Any], devices: List[torch.device]) -> Dict[str, Any]:
    """Plans one model with every correction and without each, measures the grid and the
    choices; the even split too for the transformer."""
    where: Row = {'devices': devices}
    limit = limit_for(name, config, devices[0], len(devices), where)
    plans: Plans = {}
    planning = 0.0
    for correction in [None, *corrections(len(devices), processes=False)]:
        plans[correction], seconds = planned(name, config, devices[0], where, correction,
                                             limit)
        planning = planning or seconds
    result, (module, plan, input, target, loss, batch) = measured_rows(
        name, config, devices[0], plans, planning, limit, traced_step)
    if name == config['limited']:
        result['even'] = against_even_split(module, plan, input, target, loss, config, batch)
    return result


def limit_of(planner: Callable[..., Plan], layers: int, workers: int, most: int) -> float:
    """What the even split with 1F1B needs without checkpointing, at its best chunks for memory."""
    free = planner(schedules=['1f1b'], checkpoint=['never'])
    split = even_split(layers, workers)
    return min(max(free.predict('1f1b', split, 2 ** k, 'never').memory)
               for k in range(most.bit_length()))


def even_split(layers: int, parts: int) -> List[int]:
    base, extra = divmod(layers, parts)
    return [base + (j < extra) for j in range(parts)]


def against_even_split(module: nn.Sequential, plan: Plan, input: Tensor, target: Tensor,
                       loss: Loss, config: Dict[str, Any], batch: int) -> Row:
    """The plan against the even split with 1F1B at its best fitting chunks and mode, paired."""
    even = even_split(len(module), len(plan.devices))
    fitting = [plan.predict('1f1b', even, 2 ** k, mode)
               for k in range(6) for mode in config['modes']
               if 2 ** k <= min(config['most_chunks'], batch)]
    fitting = [o for o in fitting if plan.memory_limit is None
               or max(o.memory) <= plan.memory_limit]
    if not fitting:
        return {'even': None}
    timed = in_rounds([traced_step(module, o, plan, input, target, loss)[0] for o in fitting],
                      config['rounds'])
    measured = {o.describe(): seconds for o, (seconds, _) in zip(fitting, timed)}
    best = min(fitting, key=lambda o: measured[o.describe()])
    ratios = []
    pipes = {key: (GPipe(copy.deepcopy(module), **Plan(o, [], plan.devices, None).kwargs),
                   o.schedule) for key, o in (('plan', plan.chosen), ('even', best))}
    for r in range(config['rounds'] * 4):
        seconds = {}
        for key in (('plan', 'even') if r % 2 else ('even', 'plan')):
            pipe, schedule = pipes[key]
            started = time.perf_counter()
            pipe.train_step(input, target, loss, schedule=schedule)
            synchronize(pipe.devices)
            seconds[key] = time.perf_counter() - started
        ratios.append(seconds['plan'] / seconds['even'])
    return {'even': best.describe(), 'ratio': statistics.median(ratios[1:] or ratios)}


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    if config.get('ranks'):
        return plan_ranks.run(config)
    workers = config['workers']
    devices = cuda_devices(workers) if config['device'] == 'cuda' else cpu_devices(workers)
    models = [model_rows(name, config, devices) for name in config['models']]
    many = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.ReLU())
                           for _ in range(config['layers_100'])]).to(devices[0])
    started = time.perf_counter()
    torchgpipe.plan(many, torch.randn(32, 64, device=devices[0]), devices=devices,
                    chunks=min(32, config['most_chunks']))
    return {'results': models, 'planning_100': time.perf_counter() - started,
            'layers_100': config['layers_100'], 'devices': [str(d) for d in devices]}


def errors(document: Dict[str, Any]) -> List[float]:
    return [r['predicted'] / r['measured'] - 1 for m in document['results'] for r in m['rows']]


def spreads(document: Dict[str, Any]) -> List[float]:
    """How far apart each configuration's traced steps were: the fastest to the slowest,
    over the median. Below this, an error is the machine's noise, not the prediction's."""
    return [(max(r['steps']) - min(r['steps'])) / r['measured']
            for m in document['results'] for r in m['rows']]


def memory_errors(document: Dict[str, Any]) -> List[float]:
    """Each rank's predicted peak memory over its measured one, less 1 (across processes)."""
    return [p / m - 1 for model in document['results'] for r in model['rows']
            for p, m in zip(r.get('memory_predicted', []), r.get('memory_measured', []))]


def summary(document: Dict[str, Any]) -> Dict[str, float]:
    """The figures of the targets."""
    gaps = [abs(e) for e in errors(document)]
    figures = {'median error': statistics.median(gaps), 'largest error': max(gaps),
               'median step spread': statistics.median(spreads(document))}
    drift = [abs(r['predicted'] / r['measured'] - 1) for m in document['results']
             for r in m['rows'] if r.get('pilot')]
    if drift:  # the pilot's own configurations: the machine's drift since the planner
        figures['median pilot drift'] = statistics.median(drift)
        figures['largest pilot drift'] = max(drift)
    if 'planning_100' in document:
        figures['planning 100 layers'] = document['planning_100']
    memory = [abs(e) for e in memory_errors(document)]
    if memory:
        figures['median memory error'] = statistics.median(memory)
        figures['largest memory error'] = max(memory)
    choices = []
    for m in document['results']:
        chosen = next(r for r in m['rows'] if r['chosen'])
        best = min(r['measured'] for r in m['rows'] if r['fits'])
        choices.append(chosen['measured'] / best)
    figures['choice over the best'] = max(choices)
    even = [m['even'] for m in document['results'] if m.get('even', {}).get('even')]
    if even:
        figures['plan over the even split'] = even[0]['ratio']
    figures.update(ablation(document))
    return figures


def ablation(document: Dict[str, Any]) -> Dict[str, float]:
    """What each correction earns: over the grid's configurations, the median error with
    every correction and with each left out (:func:`without`), and the worst model's
    choice over its fastest measured; beside them the noise, the median difference
    between two measurements of one configuration (its odd rounds' median and its even
    rounds'), over the median of all."""
    rows = [r for m in document['results'] for r in m['rows'] if r.get('grid')]
    left_out = [c for c in CORRECTIONS if rows and c in rows[0].get('without', {})]
    if not left_out:
        return {}
    repeats = [abs(statistics.median(r['steps'][0::2]) - statistics.median(r['steps'][1::2]))
               / r['measured'] for r in rows if len(r['steps']) > 1]
    figures = {'repeat difference': statistics.median(repeats or [0.0]),
               'grid median error': statistics.median(abs(r['predicted'] / r['measured'] - 1)
                                                      for r in rows)}
    for c in left_out:
        figures[f'grid median error without {c}'] = statistics.median(
            abs(r['without'][c] / r['measured'] - 1) for r in rows)
        choices = []
        for m in document['results']:
            by_name = {r['configuration']: r for r in m['rows']}
            best = min(r['measured'] for r in m['rows'] if r['fits'])
            choices.append(by_name[m['chosen_without'][c]]['measured'] / best)
        figures[f'choice over the best without {c}'] = max(choices)
    return figures


def table(document: Dict[str, Any]) -> str:
    lines = []
    for m in document['results']:
        lines += [f"{m['model']}: {m['plan']}", '']
        cells = [[r['configuration'] + (' (chosen)' if r['chosen'] else '')
                  + (' (pilot)' if r.get('pilot') else ''),
                  f"{r['predicted'] * 1e3:.2f}", f"{r['measured'] * 1e3:.2f}",
                  f"{(r['predicted'] / r['measured'] - 1) * 100:+.1f}%",
                  'yes' if r['fits'] else 'no']
                 + ([' '.join(f'{(p / q - 1) * 100:+.0f}%' for p, q in
                              zip(r['memory_predicted'], r['memory_measured']))]
                    if 'memory_measured' in r else [])
                 for r in m['rows']]
        heads = ['configuration', 'predicted ms', 'measured ms', 'error', 'fits']
        if m['rows'] and 'memory_measured' in m['rows'][0]:
            heads.append('memory error per rank')
        lines += [format_table(heads, cells), '']
        if m.get('even', {}).get('even'):
            lines.append(f"plan over the even split ({m['even']['even']}), paired median: "
                         f"{m['even']['ratio']:.3f}x")
    figures = summary(document)
    lines += ['', format_table(['figure', 'value', 'target'],
                               [[k, f'{v:.3f}', f"{TARGETS[k]:g}" if k in TARGETS else '-']
                                for k, v in figures.items()])]
    return '\n'.join(lines)


def headline(document: Dict[str, Any]) -> List[Figure]:
    figures = summary(document)
    return [Figure(k, f'{v:.3f}', f'<= {TARGETS[k]:g}', v <= TARGETS[k]) if k in TARGETS
            else Figure(k, f'{v:.3f}') for k, v in figures.items()]


def plot(document: Dict[str, Any], plt: Any) -> None:
    """Predicted against measured step time, a point per configuration, a colour per model."""
    axes = plt.gca()
    for m in document['results']:
        axes.scatter([r['measured'] * 1e3 for r in m['rows']],
                     [r['predicted'] * 1e3 for r in m['rows']], s=10, label=m['model'])
    top = max(max(r['measured'], r['predicted']) for m in document['results']
              for r in m['rows']) * 1e3
    for share, style in ((1.0, '-'), (1.1, ':'), (0.9, ':')):
        axes.plot([0, top], [0, top * share], style, color='black', linewidth=0.6)
    axes.set_xlabel('measured step, ms (traced, median)')
    axes.set_ylabel('predicted step, ms')
    axes.set_title('the planner: prediction against measurement (dotted: 10%)',
                   fontsize='medium')
    axes.legend(fontsize='small')


EXPERIMENT = Experiment(name='plan', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run,
                        table=table, headline=headline, plot=plot, tune_malloc=True)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

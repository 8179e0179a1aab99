"""The planner: balance, chunks, schedule, placement and checkpointing, chosen from measurements.

It measures each layer once (:mod:`~torchgpipe.planner.costs`) and the pipeline's cost
per task (:mod:`~torchgpipe.planner.calibrate`), predicts every configuration worth
trying with the simulator (:mod:`~torchgpipe.planner.search`), and returns the fastest
that fits in memory.
"""
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Generator, List, Optional, Sequence, Tuple, cast

import torch
from torch import Tensor, nn

from torchgpipe.balance.sandbox import preserve_rng_state
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors
from torchgpipe.foundation.validation import Device, describe
from torchgpipe.planner import pilot
from torchgpipe.planner.arguments import check_arguments
from torchgpipe.planner.calibrate import (Timer, copy_cost, gpipes, message_cost,
                                          pipeline_timer, skip_cost, skip_step, task_overhead,
                                          wide_step)
from torchgpipe.planner.compare import Comparison
from torchgpipe.planner.costs import Costs, measure
from torchgpipe.planner.option import Option, size
from torchgpipe.planner.result import Plan
from torchgpipe.planner.predict import micro_batches
from torchgpipe.planner.search import chunk_counts, search

if TYPE_CHECKING:
    from torchgpipe.planner.group import PlanningGroup

__all__ = ['plan', 'Plan', 'Option', 'Comparison']

def plan(module: nn.Sequential, sample: TensorOrTensors, *,
         devices: Optional[Sequence[Device]] = None, group: Optional[Any] = None,
         device: Optional[Device] = None, memory_limit: Optional[float] = None,
         target: Optional[TensorOrTensors] = None, loss_fn: Optional[LossFunction] = None,
         param_scale: float = 2.0, chunks: int = 32, schedules: Optional[Sequence[str]] = None,
         checkpoint: Optional[Sequence[str]] = None, repeat: int = 3,
         runners_up: int = 5, shards: int = 1) -> Plan:
    """Chooses how to pipeline ``module``: the fastest configuration that fits in memory.

    Each layer is measured once, on a copy, at every micro-batch size, and the pipeline's
    cost per task on ``devices``. The simulator then predicts the step time and memory of
    every schedule, layout, number of micro-batches, checkpoint mode and a few balances.
    ``module`` and the random generators are left untouched. With ``group``, each rank
    calls ``plan`` with the same arguments and its own ``device``, and all get one plan,
    for a :class:`~torchgpipe.distributed.DistributedGPipe`.

    Args:
        module (torch.nn.Sequential): the model
        sample (torch.Tensor or tuple): a mini-batch as training gives it
            (its batch size is the one planned for)

    Keyword Args:
        devices (list of devices): one worker each, such as ``['cuda:0', 'cuda:1']`` or
            ``['cpu:0', 'cpu:1']`` (default: every visible CUDA device); not with ``group``
        group (torch.distributed.ProcessGroup, optional): plan for its processes
            instead, such as ``torch.distributed.group.WORLD``
        device (device, optional): with ``group``, this rank's (default: the CPU)
        memory_limit (int, optional): the most bytes a device may use (default: no limit)
        target (torch.Tensor or tuple, optional): with ``loss_fn``, to measure the loss
        loss_fn (callable, optional): as :meth:`~torchgpipe.GPipe.train_step` takes it
        param_scale (float): parameter-sized tensors per parameter, as for
            :func:`~torchgpipe.balance.balance_by_size` (default: ``2.0``; ``4.0`` for Adam)
        chunks (int): the most micro-batches to try (default: ``32``)
        schedules (list of str, optional): the schedules to try (default: all)
        checkpoint (list of str, optional): the checkpoint modes to try (default: all)
        repeat (int): timed runs per layer and micro-batch size (default: ``3``)
        runners_up (int): how many other configurations the plan keeps (default: ``5``)
        shards (int): the data-parallel ranks each partition is sharded over by FSDP2
            (``fully_shard``; with one partition a rank, ``reshard_after_forward`` frees
            nothing during a step): its parameters and optimizer states are counted a shard
            each between steps, whole beside them during one, with an all-gather and a
            reduce-scatter a partition per step (default: ``1``, not sharded; with
            ``group`` only)

    Returns:
        Plan: printable; apply it with ``GPipe(module, **plan.kwargs)`` (or
        ``DistributedGPipe(module, **plan.kwargs, group=group, device=device)``) and
        ``train_step(..., schedule=plan.schedule)``

    Raises:
        TypeError: an argument of the wrong type
        RuntimeError: with ``group`` or ``device``, torch.distributed is not
            initialized, or rank 0 failed measuring the layers
        ValueError: a bad argument (named), more devices than layers, no schedule
            that fits, or a ``memory_limit`` nothing fits (naming the least needed);
            with ``group``, on every rank if one rank's arguments are wrong or differ

    Example::

        >>> import torchgpipe
        >>> model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU())
        >>> plan = torchgpipe.plan(model, torch.randn(32, 16), devices=['cpu:0', 'cpu:1'],
        ...                        target=torch.randn(32, 16), loss_fn=F.mse_loss)
        >>> pipe = GPipe(model, **plan.kwargs)
        >>> loss = pipe.train_step(torch.randn(32, 16), torch.randn(32, 16), F.mse_loss,
        ...                        schedule=plan.schedule)
        >>> print(plan)  # doctest: +SKIP
    """
    problem: Optional[Exception] = None
    try:
        batch, workers, names, modes, most = check_arguments(
            module, sample, target, loss_fn, devices, group, device, schedules, checkpoint,
            chunks, repeat, runners_up, memory_limit, param_scale, shards)
    except (TypeError, ValueError) as error:
        if group is None:
            raise
        # Across processes, the other ranks hear of it before anyone raises.
        problem, batch, workers, names, modes, most = error, 0, [], [], [], 0

    loss = None if loss_fn is None or target is None else (loss_fn, target)
    team = None
    if group is not None:
        # Imported here: ``import torchgpipe`` loads no torchgpipe.distributed.
        from torchgpipe.planner.group import PlanningGroup
        team = PlanningGroup(group, device, problem, {} if problem else {
            'layers': [sum(p.numel() for p in layer.parameters()) for layer in module],
            'sample': [(tuple(x.shape), str(x.dtype)) for x in Batch(sample)
                       if isinstance(x, Tensor)],
            'memory_limit': memory_limit, 'param_scale': param_scale, 'shards': shards,
            'chunks': most,
            'schedules': names, 'checkpoint': modes, 'repeat': repeat,
            'runners_up': runners_up, 'loss_fn': loss is not None})
        if team.size > len(module):
            raise ValueError(describe('the ranks of group must be no more than the layers',
                                      f'{team.size} ranks, {len(module)} layers',
                                      f'plan for a group of at most {len(module)} ranks'))
    counts = chunk_counts(batch, most)
    sizes = sizes_to_measure(batch, counts)
    steps: Optional[pilot.Step] = None
    local = workers if team is None else [team.device]
    with sharing_cores(local) as worker_threads, preserve_rng_state(*local), \
            gradients_set_aside(module):
        if team is None:
            costs = measure(module, sample, sizes, workers[0], repeat=repeat, loss=loss)
            costs.overhead, costs.checkpoint_overhead, costs.split_overhead = \
                task_overhead(pipeline_timer(gpipes(workers)), len(workers))
            costs.transfer = copy_cost(workers)
            if workers[0].type == 'cpu' and len(workers) > 1:
                # Threads sharing the cores and the interpreter's lock: their pace.
                steps = pilot.model_steps(module, sample, target, loss_fn,
                                          gpipes(workers))
            names_of = [str(d) for d in workers]
        else:
            cores = team.cores()
            costs = team.first(lambda: measure(module, sample, sizes, team.device,
                                               repeat=repeat, loss=loss))
            steps_of, costs.cores = team.timer(), cores
            overheads = task_overhead(steps_of, team.size, costs.cores)
            wide = wide_step(steps_of, team.size)
            costs.transfer = team.first(
                lambda: message_cost(wide, team.size, team.device, overheads, costs.cores))
            costs.skip_overhead = skip_overhead(team, steps_of, overheads, costs)
            costs.overhead, costs.checkpoint_overhead, costs.split_overhead = overheads
            costs.processes = True
            if team.size > 1 and team.device.type == 'cpu':
                # Processes sharing the machine's cores: their pace. Every
                # rank has the same costs and the slowest rank's steps, and
                # so finds the same pace.
                steps = pilot.model_steps(module, sample, target, loss_fn, team.pilots(),
                                          ready=team.barrier, agree=team.slowest)
            names_of = team.names
        if steps is not None:
            costs = pilot.paced(costs, pilot.pace(costs, len(names_of), steps))
        found = search(costs, len(names_of), memory_limit=memory_limit, schedules=names,
                       chunks=counts, checkpoints=modes, param_scale=param_scale,
                       shards=shards)
        return choose(found, names_of, names, memory_limit, runners_up, costs,
                      float(param_scale), processes=group is not None,
                      threads=worker_threads, shards=shards)


def skip_overhead(team: 'PlanningGroup', steps_of: Timer, overheads: Tuple[float, float, float],
                  costs: Costs) -> float:
    """What a skip's message between the ranks of ``team`` costs, if any."""
    if not costs.skips or team.size < 2:
        return 0.0
    step = skip_step(steps_of, team.size)
    return cast(float, team.first(lambda: skip_cost(
        step, team.size, team.device, overheads, costs.transfer, costs.cores)))


def choose(options: List[Option], names_of: List[str], names: List[str],
           memory_limit: Optional[float], runners_up: int, costs: Costs,
           param_scale: float, processes: bool = False,
           threads: Optional[int] = None, shards: int = 1) -> Plan:
    """The plan of the fastest predicted configuration that fits; ``ValueError`` when none
    does. ``names_of`` names each worker."""
    if not options:
        raise ValueError(describe(
            'schedules must hold one that fits the devices and the layers',
            f'schedules: {names}, {len(names_of)} workers, {costs.layers} layers',
            "add '1f1b', or leave schedules out (interleaved 1F1B and ZBV need two "
            'layers per device)'))
    if not options[0].fits(memory_limit):
        least = options[0]
        worst = max(range(len(least.memory)), key=least.memory.__getitem__)
        raise ValueError(describe(
            'memory_limit must leave room for some configuration',
            f'memory_limit: {size(float(memory_limit or 0))}',
            f'the least any needs is {size(least.memory[worst])} on {names_of[worst]} '
            f'({least.describe()}); raise memory_limit to that, or add devices'))
    fitting = [o for o in options if o.fits(memory_limit)]
    return Plan(fitting[0], fitting[1:1 + runners_up], names_of,
                None if memory_limit is None else float(memory_limit), costs, param_scale,
                processes, threads, shards)


@contextmanager
def sharing_cores(workers: Sequence[torch.device]) -> Generator[Optional[int], None, None]:
    """Measures CPU layers with each worker's share of the cores, as they will train
    (all of them would predict too fast); yields those threads (``None`` on CUDA)."""
    before = torch.get_num_threads()
    if workers[0].type != 'cpu':
        yield None
        return
    torch.set_num_threads(max(1, before // len(workers)))
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@contextmanager
def gradients_set_aside(module: nn.Module) -> Generator[None, None, None]:
    """Sets the gradients of ``module`` aside while planning (measured copies start without,
    as after ``zero_grad()``), and gives the same tensors back."""
    held = [(p, p.grad) for p in module.parameters() if p.grad is not None]
    for p, _ in held:
        p.grad = None
    try:
        yield
    finally:
        for p, grad in held:
            p.grad = grad


def sizes_to_measure(batch: int, counts: Sequence[int]) -> List[int]:
    """The micro-batch sizes to measure: powers of two from the smallest to the mini-batch."""
    smallest = min(min(micro_batches(batch, m)) for m in counts)
    sizes = {batch, smallest}
    power = 1
    while power < batch:
        if power > smallest:
            sizes.add(power)
        power *= 2
    return sorted(sizes)



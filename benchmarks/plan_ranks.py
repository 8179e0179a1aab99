"""The planner across processes: ``benchmarks.plan``'s presets ``cpu2`` and ``cpu4``.

Every rank of a gloo group (one intra-op thread each) plans a model with
``torchgpipe.plan(..., group=...)``, in processes of their own for each plan
(with every correction, and without each: a pipeline keeps its process groups,
and their threads, until its process ends, and a plan makes a dozen), then
the ranks of one more group train each configuration of the grid (and the
choices) as a :class:`~torchgpipe.distributed.DistributedGPipe` built from
its ``Plan.kwargs``:

- the step time: every rank's span of a step traced by
  :func:`torchgpipe.trace`, the median of the rounds of
  :func:`benchmarks.plan.in_rounds` (the ranks started together at each);
- each rank's peak memory, two ways, beside the prediction (its activations
  at their peak, and ``param_scale`` 2: the parameters and their gradients),
  each measured in a step of its own after the gradients are dropped, plus
  the bytes of the rank's own parameters:

  - the *tensors* (``memory_measured``, the figure the targets judge): the
    most bytes of tensor storage the step holds at once, seen by a
    :class:`~torchgpipe.balance.working.Live` mode (every storage an
    operator makes, from its making until it is freed), as a CUDA
    allocator's peak counts them. A step under the mode first learns the
    storages that last from step to step (the message buffers): those are
    left out;
  - the *resident set* (``memory_resident``, for information): its growth
    over the step, with large allocations served by ``mmap`` so that it
    follows the live bytes (:func:`benchmarks.memory.fix_malloc`, the heap
    trimmed first). It holds what the C allocator keeps beside the tensors
    (the heaps of the threads that send and receive, freed memory not yet
    returned), which the planner does not predict: in the committed run, a
    median of 2.5 MB a rank beyond the tensors for the MLP, 7.4 MB for the
    CNN and 37 MB for GPT-2.

The buffers of the ranks' words are not part of either: they last from step
to step. Before the measurements, the pipeline steps twice (:func:`settle`):
the first step of its shapes sends headers, which the next ones do not.
"""
import gc
import os
import sys
import warnings
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

from benchmarks.distributed import spawn_ranks
from benchmarks.memory import fix_malloc, step_peak_memory, trim_malloc, tune_malloc
from torchgpipe import Plan
from torchgpipe.distributed import DistributedGPipe
from torchgpipe.planner.calibrate import traced_span
from torchgpipe.planner.option import Option
from torchgpipe.balance.working import Live

if TYPE_CHECKING:  # (benchmarks.plan imports this module)
    from benchmarks.plan import StepTimer



def run(config: Dict[str, Any]) -> Dict[str, Any]:
    """Plans each model with every correction and without each, each plan in processes of
    its own (a plan's pipelines keep their process groups, and their threads, to the
    end of the process: plans made after others would run on a busier machine), then
    measures its grid in processes of its own; returns what rank 0 gathered."""
    from benchmarks import plan as bench  # imported here: it imports this module
    ranks, timeout = config['ranks'], 600 * config['ranks']
    results = []
    for name in config['models']:
        limit = spawn_ranks(rank_main, ranks, {**config, 'job': ('limit', name)}, timeout)
        plans, planning = {}, 0.0
        for correction in [None, *bench.corrections(ranks, processes=True)]:
            plans[correction], seconds = spawn_ranks(
                rank_main, ranks, {**config, 'job': ('plan', name, correction, limit)},
                timeout)
            planning = planning or seconds
        results.append(spawn_ranks(rank_main, ranks, {
            **config, 'job': ('measure', name, plans, planning, limit)}, timeout))
    return {'results': results, 'devices': [f'rank {r}' for r in range(ranks)]}


def rank_main(rank: int, world_size: int, port: int, config: Dict[str, Any],
              results: Any) -> None:
    """One rank of a job: finds a model's memory limit, plans it, or measures its grid
    with the others; rank 0 reports."""
    from benchmarks import plan as bench
    torch.set_num_threads(1)
    tune_malloc()
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=600))
    kind, name, *job = config['job']
    cpu, where = torch.device('cpu'), {'group': dist.group.WORLD}
    if kind == 'limit':
        done: Any = bench.limit_for(name, config, cpu, world_size, where)
    elif kind == 'plan':
        done = bench.planned(name, config, cpu, where, *job, sync=dist.barrier)
    else:
        done = bench.measured_rows(name, config, cpu, *job, ready)[0]
    if rank == 0:
        results.put(done)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no Python shutdown: see docs/scaling_out.rst, "Ending a job"


def ready(module: nn.Sequential, option: Option, plan: Plan, input: Any, target: Tensor,
          loss: Any) -> Tuple['StepTimer', Dict[str, Any]]:
    """A configuration's pipeline, settled, and each rank's peak memory in its step beside
    its prediction; and the function that times one more step of it (every rank's span,
    the ranks started together)."""
    layout = Plan(option, [], plan.devices, None, processes=True)
    with warnings.catch_warnings():
        # A configuration of the grid may leave a rank only layers without
        # parameters (GPT-2's first, a view): no optimizer is built here.
        warnings.filterwarnings('ignore', 'rank .* holds no parameters', UserWarning)
        pipe = DistributedGPipe(module, **layout.kwargs)

    def step() -> None:
        pipe.train_step(input, target, loss, schedule=option.schedule)
    gc.collect()
    settle(step)
    own = sum(p.numel() * p.element_size() for p in pipe.parameters())
    module.zero_grad(set_to_none=True)
    fix_malloc()
    trim_malloc()
    dist.barrier()
    resident = step_peak_memory(step, [torch.device('cpu')])['step_peak'] + own
    tune_malloc()
    tensors = tensor_peak(module, step) + own
    memory: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(memory, (float(tensors), float(resident)))

    def timer() -> float:
        module.zero_grad(set_to_none=True)  # a step after zero_grad(), as traced_step's
        dist.barrier()
        return traced_span(pipe, step)
    return timer, {'memory_predicted': option.memory,
                   'memory_measured': [m[0] for m in memory],
                   'memory_resident': [m[1] for m in memory]}


def tensor_peak(module: nn.Module, step: Callable[[], None]) -> int:
    """The most bytes of tensors a step holds at once, beside those that last from step
    to step (the parameters, the message buffers), its gradients made anew."""
    live = Live({t.untyped_storage().data_ptr()
                 for t in [*module.parameters(), *module.buffers()]})
    with live:
        step()  # learns the storages that last
    module.zero_grad(set_to_none=True)
    gc.collect()
    lasting, since = set(live.alive.values()), len(live.log)
    dist.barrier()
    with live:
        step()
    module.zero_grad(set_to_none=True)
    return live.peak(lasting, since)


def settle(step: Callable[[], None]) -> None:
    """Steps a new pipeline past its first step of these shapes, which sends headers,
    and makes the buffers of its words."""
    step()
    step()

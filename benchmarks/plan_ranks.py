"""The planner across processes: ``benchmarks.plan``'s presets ``cpu2`` and ``cpu4``.

Every rank of a gloo group (one intra-op thread each) plans the models with
``torchgpipe.plan(..., group=...)``, then trains each configuration of the
grid (and the choice) as a :class:`~torchgpipe.distributed.DistributedGPipe`
built from its ``Plan.kwargs``:

- the step time: the median of a few steps traced on every rank
  (:func:`torchgpipe.trace`), after one untimed step;
- each rank's peak memory: one more step after the gradients are dropped,
  with large allocations served by ``mmap`` so that the resident set follows
  the live bytes (:func:`benchmarks.memory.fix_malloc`, the heap trimmed
  first); the resident set's growth over the step plus the bytes of the
  rank's own parameters, beside the prediction (its activations at their
  peak, and ``param_scale`` 2: the parameters and their gradients). The
  message buffers, made in the first step, are not part of the growth.
"""
import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor, nn

import torchgpipe
from benchmarks.distributed import spawn_ranks
from benchmarks.memory import fix_malloc, step_peak_memory, trim_malloc, tune_malloc
from torchgpipe import Plan
from torchgpipe.distributed import DistributedGPipe
from torchgpipe.planner.option import Option



def run(config: Dict[str, Any]) -> Dict[str, Any]:
    """Spawns the ranks; returns what rank 0 gathered."""
    reported: Dict[str, Any] = spawn_ranks(rank_main, config['ranks'], config,
                                           600 * len(config['models']) * config['ranks'])
    return reported


def rank_main(rank: int, world_size: int, port: int, config: Dict[str, Any],
              results: Any) -> None:
    """One rank: plans and measures every model, with the others; rank 0 reports."""
    torch.set_num_threads(1)
    tune_malloc()
    dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=rank,
                            world_size=world_size, timeout=timedelta(seconds=600))
    models = [model_rows(name, config) for name in config['models']]
    if rank == 0:
        results.put({'results': models, 'devices': [f'rank {r}' for r in range(world_size)]})
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # no Python shutdown: see docs/scaling_out.rst, "Ending a job"


def model_rows(name: str, config: Dict[str, Any]) -> Dict[str, Any]:
    """Plans one model on every rank, then measures the grid and the choice."""
    from benchmarks import plan as bench  # imported here: it imports this module
    result: Dict[str, Any] = bench.planned_rows(
        name, config, torch.device('cpu'), dist.get_world_size(), {'group': dist.group.WORLD},
        measure, sync=dist.barrier)[0]
    return result


def measure(module: nn.Sequential, option: Option, plan: Plan, input: Any, target: Tensor,
            loss: Any, rounds: int) -> Tuple[float, Dict[str, Any]]:
    """A configuration's median traced step, and each rank's peak memory in its step
    beside its prediction."""
    layout = Plan(option, [], plan.devices, None, processes=True)
    with warnings.catch_warnings():
        # A configuration of the grid may leave a rank only layers without
        # parameters (GPT-2's first, a view): no optimizer is built here.
        warnings.filterwarnings('ignore', 'rank .* holds no parameters', UserWarning)
        pipe = DistributedGPipe(module, **layout.kwargs)

    def step() -> None:
        pipe.train_step(input, target, loss, schedule=option.schedule)
    step()  # makes the message buffers, and warms up
    module.zero_grad(set_to_none=True)
    fix_malloc()
    trim_malloc()
    dist.barrier()
    grown = step_peak_memory(step, [torch.device('cpu')])['step_peak']
    tune_malloc()
    mine = grown + sum(p.numel() * p.element_size() for p in pipe.parameters())
    memory: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(memory, float(mine))
    with torchgpipe.trace(pipe) as timeline:
        for _ in range(rounds):
            step()
    module.zero_grad(set_to_none=True)
    from benchmarks.plan import steps_of  # imported here: it imports this module
    step_time, steps = steps_of(timeline, rounds)
    return step_time, {**steps, 'memory_predicted': option.memory, 'memory_measured': memory}

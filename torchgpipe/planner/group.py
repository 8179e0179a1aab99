"""Planning for the processes of a group: every rank calls, rank 0 measures, all agree.

The ranks do what a pipeline of them would, so what is measured is what the
pipeline will see::

    every rank      agree on the arguments, and on devices of one type
    rank 0          measures the layers  ── the costs (or its error) ──► every rank
    every rank      steps of DistributedGPipe: the overhead per task, large messages
    rank 0          fits the cost per byte ── to every rank
    every rank      steps of the model's copy: the pace; then the same search alone

A bad argument on one rank is raised on every rank; rank 0's error while
measuring reaches the others as a :class:`RuntimeError` naming it.
"""
import contextlib
import os
import socket
import warnings
from typing import Any, Callable, ContextManager, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import nn

from torchgpipe.distributed import DistributedGPipe
from torchgpipe.foundation.validation import (Device, check_device, check_process_group,
                                              describe)
from torchgpipe.planner.calibrate import Make, Timer, pipeline_timer

__all__: List[str] = []


#: How to name a device for DistributedGPipe's ``device`` argument.
DEVICE_FIX = "give this rank's own device, such as device='cpu', or a CUDA device it has"


class PlanningGroup:
    """The ranks of ``group`` planning together, this process one of them, with its
    ``device`` (``None``: the CPU), the ``problem`` of its arguments if any, and the
    ``signature`` every rank must agree on: ``ValueError`` on every rank if a rank's
    arguments or device are wrong or differ. On this rank alone: ``RuntimeError`` before
    torch.distributed starts, ``TypeError`` if ``group`` is not a process group,
    ``ValueError`` if this process is not in it."""

    def __init__(self, group: Any, device: Optional[Device], problem: Optional[Exception],
                 signature: Dict[str, Any]) -> None:
        check_process_group('plan with group=', group,
                            'plan only on the ranks of the pipeline group')
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        #: Each rank's name as a traced step names its row, ``'rank r'`` (r its global rank).
        self.names = [f'rank {dist.get_global_rank(group, r)}' for r in range(self.size)]
        self.device = self._agree(device, problem, signature)

    def _agree(self, device: Optional[Device], problem: Optional[Exception],
               signature: Dict[str, Any]) -> torch.device:
        """This rank's device, once every rank's is good and every rank's arguments agree."""
        mine: Optional[torch.device] = None
        said = f'error: {problem}' if problem is not None else ''
        if problem is None:
            try:
                mine = check_device(device, DEVICE_FIX)
                said = str(mine)
            except (TypeError, ValueError) as error:
                problem, said = error, f'error: {error}'
        everyone = self._gather((said, signature), mine)
        if problem is not None:
            raise problem
        for name, (theirs, _) in zip(self.names, everyone):
            if theirs.startswith('error: '):
                raise ValueError(f'{name} cannot plan: {theirs[len("error: "):]}')
        types = {torch.device(theirs).type for theirs, _ in everyone}
        if len(types) > 1:
            raise ValueError(describe('the devices of the ranks must be of one type',
                                      ', '.join(f'{n}: {d}' for n, (d, _) in
                                                zip(self.names, everyone)),
                                      'plan for CUDA devices or for the CPU on every rank'))
        first = everyone[0][1]
        differing = [f'{name}: {key} {theirs[key]!r} ({self.names[0]}: {first[key]!r})'
                     for name, (_, theirs) in zip(self.names, everyone)
                     for key in first if theirs[key] != first[key]]
        if differing:
            raise ValueError(describe('every rank must plan with the same arguments',
                                      ', '.join(differing),
                                      'call plan with the same module, sample and keywords '
                                      'on every rank'))
        assert mine is not None
        return mine

    def _gather(self, value: Any, device: Optional[torch.device]) -> List[Any]:
        """Every rank's ``value``, in rank order."""
        everyone: List[Any] = [None] * self.size
        with on(device):
            dist.all_gather_object(everyone, value, group=self.group)
        return everyone

    def cores(self) -> Optional[float]:
        """How many ranks can work at full speed at once, where they are processes of one
        machine that outnumber its cores: their cores (the union of their affinities)
        over the most threads a rank uses. ``None`` (a core each) on CUDA, across
        machines, or with cores enough. A container's CPU quota is not seen."""
        if self.device.type != 'cpu':
            return None
        allowed = os.sched_getaffinity(0) if hasattr(os, 'sched_getaffinity') \
            else set(range(os.cpu_count() or 1))
        everyone = self._gather((socket.gethostname(), sorted(allowed),
                                 min(torch.get_num_threads(), len(allowed))), self.device)
        if len({host for host, _, _ in everyone}) > 1:
            return None
        cores = len(set().union(*[set(mine) for _, mine, _ in everyone]))
        capacity = float(cores / max(threads for _, _, threads in everyone))
        return capacity if capacity < self.size else None

    def first(self, work: Callable[[], Any]) -> Any:
        """What ``work()`` gives on rank 0, on every rank; its error, as an error on every rank.

        Raises:
            RuntimeError: on the other ranks, if ``work`` raised on rank 0
        """
        if self.rank == 0:
            try:
                value = ('value', work())
            except BaseException as error:  # Ctrl-C too: the others must not wait on
                self._share(('error', f'{type(error).__name__}: {error}'))
                raise
            self._share(value)
            return value[1]
        kind, value = self._share(None)
        if kind == 'error':
            raise RuntimeError(f'{self.names[0]} failed measuring for the plan: {value}')
        return value

    def _share(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        held = [value]
        with on(self.device):
            dist.broadcast_object_list(held, src=dist.get_global_rank(self.group, 0),
                                       group=self.group)
        return held[0]

    def timer(self) -> Timer:
        """Times a calibration model's steps over the group: each step starts together on
        every rank, and takes the slowest rank's median."""
        return pipeline_timer(self.pilots(), self.barrier, self.slowest)

    def barrier(self) -> None:
        """Waits for every rank: a step starts together on all of them."""
        with on(self.device):
            dist.barrier(group=self.group)

    def slowest(self, seconds: float) -> float:
        """The slowest rank's ``seconds``, on every rank."""
        return float(max(self._gather(seconds, self.device)))

    def pilots(self) -> Make:
        """Pipelines of the pilot as DistributedGPipe over the group."""
        def make(model: nn.Sequential, kwargs: Dict[str, Any]) -> DistributedGPipe:
            with warnings.catch_warnings():
                # A rank may hold only layers without parameters; the warning
                # for an optimizer the user would build has no use here.
                warnings.filterwarnings('ignore', 'rank .* holds no parameters',
                                        UserWarning)
                return DistributedGPipe(model, **kwargs, group=self.group, device=self.device)
        return make


def on(device: Optional[torch.device]) -> ContextManager[Any]:
    """Collectives of objects on ``device``: NCCL's run on the current CUDA device."""
    if device is not None and device.type == 'cuda':
        return torch.cuda.device(device)
    return contextlib.nullcontext()

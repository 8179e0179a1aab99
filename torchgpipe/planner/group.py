"""Planning for the processes of a group: every rank calls, the first measures, all agree.

For :class:`~torchgpipe.distributed.DistributedGPipe`, every rank of the
group calls :func:`torchgpipe.plan` with the same arguments and its own
device. The ranks do what a pipeline of them would, so that what is
measured is what the pipeline will see::

    rank 0                          ranks 1 .. p-1
    agree: the same arguments, and devices of one type   (every rank)
    measures the layers             train copies of the layers (the load of
                                    a busy pipeline on the same machine)
    ---- the layers' costs, or rank 0's error, sent to every rank ----
    steps of DistributedGPipe across the group: overhead per task and
    message cost                                          (every rank)
    ---- rank 0's message cost, sent to every rank ----
    search, each rank alone: the same costs give every rank the same plan

An error on one rank before work starts (a device it does not have) is
raised on every rank; an error while rank 0 measures reaches the others as
a :class:`RuntimeError` naming it, rather than leaving them waiting.
"""
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from torchgpipe.balance.profile import layerwise_sandbox, to_device
from torchgpipe.distributed import DistributedGPipe
from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.validation import Device, check_available, describe, parse_device
from torchgpipe.planner.calibrate import CHUNKS, Timer, median_step, zeros_loss
from torchgpipe.planner.costs import Companions, Costs, rows

__all__: List[str] = []

#: How to name a device for DistributedGPipe's ``device`` argument.
DEVICE_FIX = "give this rank's own, such as device='cuda:0' or device='cpu'"


class Team:
    """The ranks of ``group`` planning together; this process is one of them.

    Args:
        group: the process group the pipeline will run on
        device: this rank's device (``None``: the CPU, as DistributedGPipe takes it)
        signature: the arguments every rank must agree on, by name

    Raises:
        RuntimeError: torch.distributed is not initialized
        TypeError: ``group`` is not a process group
        ValueError: this process is not in ``group``; on every rank, if any
            rank's device is wrong, if the devices are not of one type, or
            if the ranks' arguments differ
    """

    def __init__(self, group: Any, device: Optional[Device], signature: Dict[str, Any]
                 ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError('plan with group= needs torch.distributed: call '
                               "torch.distributed.init_process_group('gloo') (or 'nccl') "
                               'first, on every rank')
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(describe('group must be a process group', f'group: {group!r}',
                                     'give e.g. group=torch.distributed.group.WORLD'))
        if dist.get_rank(group) < 0:
            raise ValueError(describe('this process must be in group', f'rank {dist.get_rank()}',
                                      'plan only on the ranks of the pipeline group'))
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        #: Each rank's name as a traced step names its row, ``'rank r'`` (r its global rank).
        self.names = [f'rank {dist.get_global_rank(group, r)}' for r in range(self.size)]
        self.device = self._agree(device, signature)

    def _agree(self, device: Optional[Device], signature: Dict[str, Any]) -> torch.device:
        """This rank's device, once every rank's is good and every rank's arguments agree."""
        mine: Optional[torch.device] = None
        try:
            mine = torch.device('cpu') if device is None else \
                parse_device('device', device, DEVICE_FIX)
            check_available('device', mine, DEVICE_FIX)
            said = str(mine)
        except (TypeError, ValueError) as error:
            said = f'error: {error}'
        everyone: List[Any] = [None] * self.size
        dist.all_gather_object(everyone, (said, signature), group=self.group)
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

    def share(self, value: Any) -> Any:
        """Rank 0's ``value``, on every rank."""
        held = [value]
        dist.broadcast_object_list(held, src=dist.get_global_rank(self.group, 0),
                                   group=self.group)
        return held[0]

    def measure(self, measure: Callable[[], Costs], module: nn.Sequential,
                sample: TensorOrTensors, size: int) -> Costs:
        """Rank 0's measurement, on every rank; the other ranks load the machine meanwhile.

        Args:
            measure: what rank 0 runs
            module, sample: what the other ranks train copies of, at micro-batches of ``size``
        """
        if self.rank == 0:
            try:
                costs = measure()
            except BaseException as error:  # Ctrl-C too: the others must not wait on
                self.share(('error', f'{type(error).__name__}: {error}'))
                raise
            self.share(('costs', costs.to_dict()))
            return costs
        layers = list(layerwise_sandbox(module, self.device))
        with Companions(1, layers, rows(to_device(sample, self.device), size), self.device):
            kind, value = self.share(None)
        if kind == 'error':
            raise RuntimeError(f'{self.names[0]} failed measuring the layers to plan: {value}')
        return Costs.from_dict(value)

    def timer(self) -> Timer:
        """Times a calibration model's steps as a DistributedGPipe over the group.

        Each step starts together on every rank (a barrier, not timed); a
        step's time is the slowest rank's median.
        """
        def timed(model: nn.Sequential, checkpoint: str, schedule: str, input: Tensor) -> float:
            pipe = DistributedGPipe(model, [1] * self.size, chunks=CHUNKS, checkpoint=checkpoint,
                                    group=self.group, device=self.device)
            target = torch.zeros_like(input)
            mine = median_step(lambda: pipe.train_step(input, target, zeros_loss,
                                                       schedule=schedule),
                               ready=lambda: dist.barrier(group=self.group))
            everyone: List[Any] = [None] * self.size
            dist.all_gather_object(everyone, mine, group=self.group)
            return float(max(everyone))
        return timed


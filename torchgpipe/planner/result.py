"""A plan: the configuration chosen, why, and how to apply, save and check it."""
import json
import os
from dataclasses import asdict, fields
from typing import Any, Dict, List, Optional, Sequence, Union

from torchgpipe.engine.generators import BUILT_INS, built_in, unknown_name, worker_of
from torchgpipe.foundation.validation import (check_balance, check_checkpoint, check_chunks,
                                              describe)
from torchgpipe.planner.compare import Comparison, compare
from torchgpipe.planner.costs import Costs
from torchgpipe.planner.option import Option, option, size
from torchgpipe.planner.predict import Candidate, micro_batches, predict
from torchgpipe.timeline import Timeline

__all__: List[str] = []

#: The format of a saved plan.
FORMAT = 'torchgpipe-plan/2'
#: What a saved option may hold (a later version's fields are left out).
FIELDS = {f.name for f in fields(Option)}


class Plan:
    """The configuration :func:`torchgpipe.plan` chose, and the ones it set aside: apply it
    with ``GPipe(module, **plan.kwargs)`` (for processes, ``DistributedGPipe(module,
    **plan.kwargs, group=group, device=device)``) and ``train_step(..., schedule=plan.schedule)``.

    Attributes:
        chosen (Option): the fastest configuration predicted that fits
        runners_up (list of Option): the next fastest that fit, in order
        devices (list of str): each worker's device, or rank (``'rank 0'``, ...)
        memory_limit (float or None): the limit it was planned under, in bytes
        processes (bool): whether the plan is for the processes of a group
        threads (int or None): the intra-op threads each CPU worker measured with,
            which training must have too (:attr:`kwargs`' pipeline warns otherwise)
    """

    def __init__(self, chosen: Option, runners_up: List[Option], devices: List[str],
                 memory_limit: Optional[float], costs: Optional[Costs] = None,
                 param_scale: float = 2.0, processes: bool = False,
                 threads: Optional[int] = None, shards: int = 1) -> None:
        self.processes = processes
        self.threads = threads
        self.chosen = chosen
        self.runners_up = runners_up
        self.devices = devices
        self.memory_limit = memory_limit
        #: The measurements planned from (``None`` in a plan loaded from a file).
        self.costs = costs
        self.param_scale = param_scale
        self.shards = shards

    def predict(self, schedule: str, balance: Sequence[int], chunks: int,
                checkpoint: str = 'except_last') -> Option:
        """What another configuration would cost, by the same measurements: such as a split
        written by hand, ``plan.predict('1f1b', [4, 4], chunks=8).step``, its partitions
        laid out as the schedule lays them out.

        Args:
            schedule (str), balance (list of int), chunks (int): the configuration
            checkpoint (str): the checkpoint mode (default: ``'except_last'``)

        Returns:
            Option: its predicted step time, memory and work per device

        Raises:
            ValueError: the plan was loaded from a file (it keeps no measurements), or
                the configuration does not fit the devices, the layers or the schedule
            TypeError: a balance that is not a list of ints
        """
        costs = self.costs
        if costs is None:
            raise ValueError(describe('predict needs the measurements of torchgpipe.plan',
                                      'a plan loaded from a file',
                                      'plan again with torchgpipe.plan to predict others'))
        balance = check_balance(range(costs.layers), balance)
        name = built_in(schedule)
        if name is None:
            raise unknown_name(str(schedule))
        p = len(self.devices)
        shape = next((s for s in BUILT_INS[name].shapes if s[0] * p == len(balance)), None)
        if shape is None:
            counts = ' or '.join(str(v * p) for v, _ in BUILT_INS[name].shapes)
            raise ValueError(describe(f'balance must have {counts} partitions for {name} on '
                                      f'{p} devices', f'balance: {list(balance)}',
                                      f'give {counts} numbers of layers'))
        check_checkpoint(checkpoint)
        count = len(micro_batches(costs.batch, check_chunks(chunks)))
        candidate = Candidate(name, tuple(balance), count, checkpoint, p, shape[1])
        prediction = predict(costs, candidate, param_scale=self.param_scale,
                             shards=self.shards)
        return option(candidate, prediction.step, prediction.memory, prediction.busy)

    @property
    def balance(self) -> List[int]:
        """The layers of each partition."""
        return list(self.chosen.balance)

    @property
    def chunks(self) -> int:
        """The number of micro-batches."""
        return self.chosen.chunks

    @property
    def checkpoint(self) -> str:
        """The checkpoint mode."""
        return self.chosen.checkpoint

    @property
    def schedule(self) -> str:
        """The schedule for ``train_step(..., schedule=plan.schedule)``."""
        return self.chosen.schedule

    def partition_devices(self) -> List[str]:
        """The worker of each partition as the placement lays them out: its device, or rank."""
        n, p = len(self.chosen.balance), len(self.devices)
        return [self.devices[worker_of(j, n, p, self.chosen.placement)] for j in range(n)]

    @property
    def kwargs(self) -> Dict[str, Any]:
        """The keyword arguments of :class:`~torchgpipe.GPipe` for this plan, or of
        :class:`~torchgpipe.distributed.DistributedGPipe` for processes (with each rank's
        ``group`` and ``device``)."""
        if self.processes:
            return {'balance': self.balance, 'chunks': self.chunks,
                    'checkpoint': self.checkpoint, 'placement': self.chosen.placement,
                    'planned_threads': self.threads}
        return {'balance': self.balance, 'devices': self.partition_devices(),
                'chunks': self.chunks, 'checkpoint': self.checkpoint,
                'planned_threads': self.threads}

    @property
    def step_time(self) -> float:
        """The predicted time of a training step, in seconds."""
        return self.chosen.step

    @property
    def memory(self) -> Dict[str, float]:
        """The predicted peak memory of each device, in bytes."""
        return dict(zip(self.devices, self.chosen.memory))

    def table(self) -> List[Dict[str, Any]]:
        """The chosen configuration and the runners-up as rows of data, in order."""
        return [{'schedule': o.schedule, 'balance': o.balance, 'chunks': o.chunks,
                 'checkpoint': o.checkpoint, 'placement': o.placement, 'step': o.step,
                 'memory': dict(zip(self.devices, o.memory))}
                for o in [self.chosen, *self.runners_up]]

    def __str__(self) -> str:
        limit = 'no memory limit' if self.memory_limit is None else \
            f'memory limit {size(self.memory_limit)}'
        lines = [f'plan: {self.chosen.describe()}',
                 f'  on {", ".join(self.devices)}, {limit}',
                 f'  predicted step {self.chosen.step * 1e3:.2f} ms, peak memory '
                 + ', '.join(f'{d} {size(m)}' for d, m in self.memory.items())]
        if self.threads is not None:
            lines.append(f'  intra-op threads per worker: {self.threads}, as measured; train '
                         f'with torch.set_num_threads({self.threads})')
        if self.chunks == 1:
            lines.append('  chunks=1, no pipelining: what each micro-batch adds (the '
                         "pipeline's work per task, smaller operations) outweighs the idle "
                         'time it would fill')
        lines += ['', f'{"step":>10}  {"vs chosen":>9}  {"peak memory":>12}  configuration']
        chosen = max(self.chosen.step, 1e-12)
        for o in [self.chosen, *self.runners_up]:
            lines.append(f'{o.step * 1e3:>7.2f} ms  {o.step / chosen:>8.3f}x  '
                         f'{size(max(o.memory)):>12}  {o.describe()}')
        return '\n'.join(lines)

    def __repr__(self) -> str:
        return f'<Plan {self.chosen.describe()}, step {self.chosen.step * 1e3:.2f} ms>'

    def compare(self, timeline: Timeline, step: Optional[int] = None) -> Comparison:
        """How far each prediction was from a traced step of the plan's pipeline: the step
        time, each device's (or rank's) time at each kind of task, and on CUDA each
        device's peak memory.

        Args:
            timeline (Timeline): :func:`torchgpipe.trace`'s record of a training step
                with ``schedule=plan.schedule``
            step (int, optional): which traced step (default: the last)

        Returns:
            Comparison: printable; ``.rows`` as data, ``.error`` the step's

        Raises:
            ValueError: the step is not a training step of this plan

        Example::

            >>> model = GPipe(module, **plan.kwargs)  # doctest: +SKIP
            >>> with torchgpipe.trace(model) as timeline:  # doctest: +SKIP
            ...     model.train_step(input, target, loss_fn, schedule=plan.schedule)
            >>> print(plan.compare(timeline))  # doctest: +SKIP
        """
        return compare(self.chosen, self.devices, timeline, step, self.processes)

    def save(self, path: Union[str, 'os.PathLike[str]']) -> None:
        """Writes the plan to a JSON file, for :meth:`load` to read in the next job."""
        data = {'format': FORMAT, 'chosen': asdict(self.chosen),
                'runners_up': [asdict(o) for o in self.runners_up],
                'devices': self.devices, 'memory_limit': self.memory_limit,
                'processes': self.processes, 'threads': self.threads}
        with open(path, 'w') as file:
            json.dump(data, file, indent=1)

    @classmethod
    def load(cls, path: Union[str, 'os.PathLike[str]']) -> 'Plan':
        """Reads a plan :meth:`save` wrote (``ValueError`` for another file)."""
        with open(path) as file:
            data = json.load(file)
        if not isinstance(data, dict) or data.get('format') != FORMAT:
            found = data.get('format') if isinstance(data, dict) else type(data).__name__
            raise ValueError(describe(f'a plan file must be one Plan.save wrote, of format '
                                      f'{FORMAT!r}', f'{os.fspath(path)!r}: format {found!r}',
                                      'plan again with torchgpipe.plan and save that'))
        def read(option: Dict[str, Any]) -> Option:
            # Fields a later version may add are left out.
            return Option(**{k: v for k, v in option.items() if k in FIELDS})
        return cls(read(data['chosen']), [read(o) for o in data['runners_up']],
                   data['devices'], data['memory_limit'],
                   processes=data['processes'], threads=data['threads'])

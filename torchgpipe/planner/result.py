"""A plan: the configuration chosen, why, and how to apply, keep and check it.

A :class:`~torchgpipe.Plan` holds the chosen configuration and its prediction, with the
runners-up; it prints as a short report, gives the arguments of
:class:`~torchgpipe.GPipe` (:attr:`~torchgpipe.Plan.kwargs`) and the schedule of
``train_step`` (:attr:`~torchgpipe.Plan.schedule`), saves itself to a small JSON
file and loads back, and compares itself with a traced step
(:meth:`~torchgpipe.Plan.compare`).
"""
import json
import os
from dataclasses import asdict
from typing import Any, Dict, List, Optional, Union

from torchgpipe.foundation.validation import describe
from torchgpipe.planner.compare import Comparison, compare
from torchgpipe.planner.option import Option, size
from torchgpipe.timeline import Timeline

__all__: List[str] = []

#: The format of a saved plan; a file of another format is refused.
FORMAT = 'torchgpipe-plan/1'
class Plan:
    """The configuration :func:`torchgpipe.plan` chose, and the ones it set aside.

    Apply it in one line, ``GPipe(module, **plan.kwargs)``, and train with
    ``model.train_step(input, target, loss_fn, schedule=plan.schedule)``.

    Attributes:
        chosen (Option): the fastest configuration that fits
        runners_up (list of Option): the next fastest that fit, in order
        devices (list of str): the device of each worker
        memory_limit (float or None): the limit it was planned under, in bytes
    """

    def __init__(self, chosen: Option, runners_up: List[Option], devices: List[str],
                 memory_limit: Optional[float]) -> None:
        self.chosen = chosen
        self.runners_up = runners_up
        self.devices = devices
        self.memory_limit = memory_limit

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
        """The device of each partition: the workers', laid out as the placement says."""
        n, p = len(self.chosen.balance), len(self.devices)
        if self.chosen.placement == 'v':
            return [self.devices[min(j, n - 1 - j)] for j in range(n)]
        return [self.devices[j % p] for j in range(n)]

    @property
    def kwargs(self) -> Dict[str, Any]:
        """The keyword arguments of :class:`~torchgpipe.GPipe` for this plan."""
        return {'balance': self.balance, 'devices': self.partition_devices(),
                'chunks': self.chunks, 'checkpoint': self.checkpoint}

    @property
    def step_time(self) -> float:
        """The predicted time of a training step, in seconds."""
        return self.chosen.step

    @property
    def memory(self) -> Dict[str, float]:
        """The predicted peak memory of each device, in bytes."""
        return dict(zip(self.devices, self.chosen.memory))

    def table(self) -> List[Dict[str, Any]]:
        """The chosen configuration and the runners-up as rows of data, fastest first."""
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
                 + ', '.join(f'{d} {size(m)}' for d, m in self.memory.items()),
                 '', f'{"step":>10}  {"vs chosen":>9}  {"peak memory":>12}  configuration']
        for o in [self.chosen, *self.runners_up]:
            lines.append(f'{o.step * 1e3:>7.2f} ms  {o.step / self.chosen.step:>8.3f}x  '
                         f'{size(max(o.memory)):>12}  {o.describe()}')
        return '\n'.join(lines)

    def __repr__(self) -> str:
        return f'<Plan {self.chosen.describe()}, step {self.chosen.step * 1e3:.2f} ms>'

    def compare(self, timeline: Timeline, step: Optional[int] = None) -> Comparison:
        """How far each prediction was from a traced step of the plan's pipeline.

        Trace a training step of ``GPipe(module, **plan.kwargs)`` with
        ``schedule=plan.schedule``, then compare: the step time, each
        device's time at each kind of task, and, on CUDA, each device's peak
        memory, predicted beside measured.

        Args:
            timeline (Timeline): what :func:`torchgpipe.trace` recorded
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
        return compare(self.chosen, self.devices, timeline, step)

    def save(self, path: Union[str, 'os.PathLike[str]']) -> None:
        """Writes the plan to a JSON file, for :meth:`load` to read in the next job."""
        data = {'format': FORMAT, 'chosen': asdict(self.chosen),
                'runners_up': [asdict(o) for o in self.runners_up],
                'devices': self.devices, 'memory_limit': self.memory_limit}
        with open(path, 'w') as file:
            json.dump(data, file, indent=1)

    @classmethod
    def load(cls, path: Union[str, 'os.PathLike[str]']) -> 'Plan':
        """Reads a plan :meth:`save` wrote.

        Raises:
            ValueError: the file is not a saved plan
        """
        with open(path) as file:
            data = json.load(file)
        if not isinstance(data, dict) or data.get('format') != FORMAT:
            found = data.get('format') if isinstance(data, dict) else type(data).__name__
            raise ValueError(describe(f'a plan file must be one Plan.save wrote, of format '
                                      f'{FORMAT!r}', f'{os.fspath(path)!r}: format {found!r}',
                                      'plan again with torchgpipe.plan and save that'))
        return cls(Option(**data['chosen']), [Option(**o) for o in data['runners_up']],
                   data['devices'], data['memory_limit'])

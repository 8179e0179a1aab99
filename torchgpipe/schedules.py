"""Schedules of one's own: what a user needs to write, read and check one.

A schedule gives each worker (a device's thread, or a rank) its actions, written
``{partition}{kind}{micro-batch}`` as in torch.distributed.pipelining: ``1F0`` is the
forward pass of micro-batch 0 on partition 1, ``0B2`` a backward pass (``I`` and ``W``
its two halves). :meth:`GPipe.train_step <torchgpipe.GPipe.train_step>` takes one, its
text, lists of actions, or a built-in one's name (``'1F1B'``, ``'ZB-H1'``).

Example::

    >>> from torchgpipe.schedules import Action, Schedule, build
    >>> print(build('1F1B', micro_batches=3, partitions=2))
    0F0 0F1 0B0 0F2 0B1 0B2
    1F0 1B0 1F1 1B1 1F2 1B2
    >>> own = Schedule([[Action('F', micro_batch=0, partition=0),
    ...                  Action('B', micro_batch=0, partition=0)]])
    >>> len(own.check(micro_batches=1, partitions=1))  # clock cycles
    2
"""
from typing import Optional

from torchgpipe.engine.generators import SCHEDULES, built_in, named, unknown_name
from torchgpipe.engine.schedule import Action, Kind, Schedule
from torchgpipe.foundation.validation import describe

__all__ = ['Action', 'Kind', 'Schedule', 'NAMES', 'built_in', 'build']

#: The names of the built-in schedules, as :func:`built_in` gives them.
NAMES = SCHEDULES


def build(name: str, *, micro_batches: int, partitions: int,
          workers: Optional[int] = None) -> Schedule:
    """The built-in schedule ``name`` for a step, to read, print or start one's own from.

    Args:
        name (str): a built-in schedule's name, as :func:`built_in` reads it
        micro_batches (int): the micro-batches of the step
        partitions (int): the partitions of the model
        workers (int, optional): for ``'interleaved_1f1b'``, the devices the
            partitions loop over (default: ``partitions``)

    Returns:
        Schedule: checked, and shared by equal calls (change a copy:
        ``Schedule(schedule.workers)``)

    Raises:
        ValueError: an unknown name (with the closest), or a step the schedule cannot
            lay out (:doc:`/troubleshooting`)
    """
    found = built_in(name)
    if found is None:
        raise unknown_name(str(name))
    for label, value in (('micro_batches', micro_batches), ('partitions', partitions),
                         ('workers', partitions if workers is None else workers)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(describe(f'{label} of a schedule must be a positive int',
                                      f'{label}: {value!r}',
                                      'give e.g. micro_batches=8, partitions=4'))
    return named(found, micro_batches, partitions, partitions if workers is None else workers)

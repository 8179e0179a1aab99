"""The timeline of a pipeline: every task, where and when it really ran.

:func:`trace` records each forward task, recomputation, backward task and
copy, named as a schedule writes actions (``jFi``, ``jF'i``, ``jBi``): the
paper's Figure 7, from a run, a row per device::

    cpu:0  F0 F1 F2 F3                  F'3 B3 F'2 B2 ...
    cpu:1     F0 F1 F2 F3            F'3 B3 F'2 B2 ...
    cpu:2        F0 F1 F2 F3      F'3 B3 ...
    cpu:3           F0 F1 F2 F3 B3 B2 ...

Backward tasks run inside the autograd engine, which interleaves them: the
recorder hooks each node of a task and keeps the pieces of time they ran.
Across processes each rank records its own, gathered at the end
(:meth:`Timeline.gather`).
"""
from contextlib import contextmanager
from typing import Any, Generator

import torch.distributed as dist

from torchgpipe.modules.gpipe import GPipe
from torchgpipe.timeline.events import (DeviceSummary, Event, PartitionSummary, Summary,
                                        segments)
from torchgpipe.timeline.recording import StepInfo, Timeline

__all__ = ['trace', 'Timeline', 'Event', 'StepInfo', 'Summary', 'DeviceSummary',
           'PartitionSummary', 'segments']


@contextmanager
def trace(module: Any) -> Generator[Timeline, None, None]:
    """Records the timeline of every forward and backward pass of a pipeline within the context.

    On a :class:`~torchgpipe.distributed.DistributedGPipe`, every rank enters and
    leaves the context together, and each timeline then holds every rank's
    events (only its own if the context ends with an exception).

    Args:
        module (GPipe or DistributedGPipe): the pipeline to watch

    Yields:
        Timeline: the recorder, to read once the backward pass is done

    Raises:
        TypeError: ``module`` is neither a GPipe nor a DistributedGPipe
        RuntimeError: the pipeline is traced already

    Example::

        >>> import torchgpipe
        >>> model = GPipe(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8)),
        ...               balance=[2, 1], devices=['cpu:0', 'cpu:1'], chunks=4)
        >>> with torchgpipe.trace(model) as timeline:
        ...     model(torch.randn(16, 8)).sum().backward()
        >>> sorted(e.name for e in timeline.events if e.kind == 'forward')
        ['0F0', '0F1', '0F2', '0F3', '1F0', '1F1', '1F2', '1F3']
        >>> summary = timeline.summary()  # print() it for a table
        >>> summary.micro_batches, summary.partitions
        (4, 2)
        >>> timeline.save('timeline.json')  # doctest: +SKIP
        >>> timeline.plot('timeline.png')  # doctest: +SKIP
    """
    # Imported here: "import torchgpipe" leaves torchgpipe.distributed unloaded.
    from torchgpipe.distributed import DistributedGPipe
    if isinstance(module, GPipe):
        timeline = Timeline()
        places = {str(d): d for d in module.devices}
    elif isinstance(module, DistributedGPipe):
        # Every rank's clock starts as the barrier ends: their times agree.
        dist.barrier(module.group)
        timeline = Timeline([f'rank {module.ranks[r]}' for r in module.rank_of],
                            dist.get_rank())
        places = {f'rank {dist.get_rank()}': module.device}
    else:
        raise TypeError(f'trace() watches a GPipe or a DistributedGPipe, got '
                        f'{type(module).__name__}: wrap the model first, e.g. '
                        'trace(GPipe(model, balance, chunks=...))')
    state = module.core.state
    if state.recorder is not None:
        raise RuntimeError('this pipeline is traced already: nest no trace() of the same '
                           'pipeline in another; one trace records every step inside it')
    timeline.start_memory(places.values())
    state.recorder = timeline
    try:
        yield timeline
    finally:
        state.recorder = None
        timeline.stop_memory(places)
        timeline.closed = True
    # Only after a block that raised nothing: then every rank is here too.
    if isinstance(module, DistributedGPipe):
        timeline.gather(module.group, module.device)

"""The timeline of a pipeline: every task, where and when it really ran.

:func:`trace` records, for each step of a :class:`~torchgpipe.GPipe` inside it,
every forward task, recomputation, backward task and copy between devices,
measured rather than simulated, each named as a schedule writes its actions
(partition, kind, micro-batch): ``jFi`` for the forward pass of micro-batch
``i`` on partition ``j``, ``jF'i`` for its recomputation, ``jBi`` for its
backward pass. Paper, Figure 7, drawn from a run, a row per device (whose
partition's index the names leave out)::

    cpu:0  F0 F1 F2 F3                  F'3 B3 F'2 B2 ...
    cpu:1     F0 F1 F2 F3            F'3 B3 F'2 B2 ...
    cpu:2        F0 F1 F2 F3      F'3 B3 ...
    cpu:3           F0 F1 F2 F3 B3 B2 ...

How each kind is caught:

- forward tasks are timed by the worker that runs them, around the task;
- copies between devices are timed by the worker that receives them;
- backward tasks and recomputations happen inside the autograd engine: when
  a forward task is done, the pipeline hands its output to the recorder,
  which walks the task's part of the autograd graph (from its outputs down
  to its inputs' nodes, the parameters' accumulators and the portals of skip
  connections) and hooks every node of it. ``jBi`` spans from the first of
  its nodes to start to the last to finish, once per backward pass (a graph
  kept by ``retain_graph=True`` gives one per pass).

The engine may run nodes of other tasks in between (on CPU it runs every
node of a backward pass in one thread, by its own priorities), so an event
keeps the *pieces* of time in which its own work ran; busy times add those up.

On CPU the times are wall-clock (:func:`time.perf_counter`). On CUDA they are
CUDA events recorded on the stream that ran the work, so they measure the
device rather than the launch; they are read once the device is synchronized.

Across processes (a :class:`~torchgpipe.distributed.DistributedGPipe`), each
rank records its own tasks the same way, on a row named after the rank, and
the messages it sends and waits for on a row beside it; when the trace ends,
the ranks gather everything into each rank's timeline
(:mod:`torchgpipe.timeline.ranks`), and the Chrome trace draws each message
as an arrow from its sender to its receiver (:mod:`torchgpipe.timeline.chrome`).

Outside :func:`trace` none of this runs: a pipeline checks once per task
whether a recorder is attached.
"""
from contextlib import contextmanager
from typing import Any, Generator

import torch.distributed as dist

from torchgpipe.gpipe import GPipe
from torchgpipe.timeline.events import (DeviceSummary, Event, PartitionSummary, Summary,
                                        segments)
from torchgpipe.timeline.recording import StepInfo, Timeline

__all__ = ['trace', 'Timeline', 'Event', 'StepInfo', 'Summary', 'DeviceSummary',
           'PartitionSummary', 'segments']


@contextmanager
def trace(module: Any) -> Generator[Timeline, None, None]:
    """Records the timeline of every forward and backward pass of a pipeline within the context.

    On a :class:`~torchgpipe.distributed.DistributedGPipe`, every rank of its
    group enters the context (a barrier starts every rank's clock together)
    and leaves it (the ranks then exchange their events): each rank's
    timeline holds every rank's events, a row per rank and one per rank's
    messages, and its summary every rank's busy and idle time. If the
    context ends with an exception, the ranks exchange nothing, and each
    timeline holds its own rank's events only.

    Args:
        module (GPipe or DistributedGPipe): the pipeline to watch

    Yields:
        Timeline: the recorder; read :attr:`~torchgpipe.timeline.Timeline.events`,
        :meth:`~torchgpipe.timeline.Timeline.summary`,
        :meth:`~torchgpipe.timeline.Timeline.save` or
        :meth:`~torchgpipe.timeline.Timeline.plot` once the backward pass is done

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
    from torchgpipe.distributed.pipe import DistributedGPipe
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

"""The engine: one executor for every way to run, and the pipeline core that drives it.

- :mod:`~torchgpipe.engine.core`: :class:`~torchgpipe.engine.core.Core`, the
  pipeline a :class:`~torchgpipe.GPipe` holds, which builds every step.
- :mod:`~torchgpipe.engine.schedule`: a schedule is a list of actions per
  worker (``0F1``, ``1B0``, ``2I0``, ``2W0``), with its text and its checks.
- :mod:`~torchgpipe.engine.generators`: the built-in schedules, short pure
  functions; :mod:`~torchgpipe.engine.simulator`: when each action of a
  schedule starts and ends, given its cost (each worker with a core, or
  sharing fewer cores than they are).
- :mod:`~torchgpipe.engine.inputs`: a step's input and target, in micro-batches.
- :mod:`~torchgpipe.engine.step`: :class:`~torchgpipe.engine.step.Step` runs any
  schedule's actions on the workers of :mod:`torchgpipe.runtime.worker`.
- The partition boundary, the one thing that differs between ways to run:
  :mod:`~torchgpipe.engine.linked` (one autograd graph across partitions, for
  the forward path of :mod:`~torchgpipe.engine.pipeline`) or
  :mod:`~torchgpipe.engine.stage` (each partition's graph cut at its input,
  for training steps).
- :mod:`~torchgpipe.engine.split`: a backward pass in two, ``I`` then ``W``;
  :mod:`~torchgpipe.engine.evaluation`: the forward actions alone, for
  ``eval_step``.
- :mod:`~torchgpipe.engine.mailbox`: the typed messages the partitions' actions
  send each other, and the mailbox they wait in.

:class:`~torchgpipe.GPipe` and :class:`~torchgpipe.distributed.DistributedGPipe`
are its users.
"""
from typing import List

__all__: List[str] = []

"""Training steps the library drives: schedules as data, their executor, and its messages.

- :mod:`~torchgpipe.train.schedule`: a schedule is a list of actions per
  worker (``0F1``, ``1B0``, ``2I0``, ``2W0``), with its text and its checks.
- :mod:`~torchgpipe.train.generators`: the built-in schedules, short pure
  functions.
- :mod:`~torchgpipe.train.inputs`: a step's input and target, in micro-batches.
- :mod:`~torchgpipe.train.step`: :class:`~torchgpipe.train.step.Step` runs any
  schedule's actions on the workers of :mod:`torchgpipe.worker`, each
  partition's graph standing alone.
- :mod:`~torchgpipe.train.split`: a backward pass in two, ``I`` then ``W``.
- :mod:`~torchgpipe.train.mailbox`: the typed messages the partitions' actions
  send each other, and the mailbox they wait in.

:meth:`GPipe.train_step <torchgpipe.GPipe.train_step>` and
:class:`~torchgpipe.distributed.DistributedGPipe` are its users.
"""
from typing import List

__all__: List[str] = []

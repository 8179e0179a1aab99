"""An evaluation step: the forward actions of a step alone, without autograd, in eval mode.

``eval_step`` runs the engine of a training step with forward actions alone,
in fill-drain order, each partition under ``torch.no_grad()``; the last keeps
its outputs, or each micro-batch's weighted loss::

    partition 0   F0 F1 F2 F3
    partition 1      F0 F1 F2 F3   ─► outputs, or the loss of each

The layers are in evaluation mode for the step, and back in their own after.
"""
from contextlib import contextmanager
from typing import Iterator, List, Optional, Tuple

import torch
from torch import nn

from torchgpipe.engine.inputs import split_given, weighted
from torchgpipe.engine.pipeline import clock_cycles
from torchgpipe.engine.schedule import Action, Kind, Schedule
from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors
from torchgpipe.foundation.validation import check_loss, check_target_and_loss, describe

__all__: List[str] = []


def forward_only(m: int, n: int) -> Schedule:
    """Each of ``n`` partitions' forward actions on ``m`` micro-batches, in clock order.

    Example::

        >>> print(forward_only(2, 2))
        0F0 0F1
        1F0 1F1
    """
    tasks = [task for cycle in clock_cycles(m, n) for task in cycle]
    return Schedule(([Action(Kind.F, i, j) for i, j in tasks if j == w] for w in range(n)),
                    name='forward only')


@contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """Puts ``module`` in evaluation mode, and each of its layers back in its own mode after."""
    modes = [(layer, layer.training) for layer in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for layer, training in modes:
            layer.training = training


def check_evaluation(target: Optional[TensorOrTensors], loss_fn: object, reduction: str,
                     output_fn: object, target_elsewhere: bool = False) -> None:
    """Checks the arguments of an evaluation step: a target and a loss function, or
    neither, and then maybe a function of the output; with ``target_elsewhere`` (a
    process of a pipeline across processes), a loss function may come without the target.

    Raises:
        TypeError: ``loss_fn`` or ``output_fn`` is not callable, or
            ``reduction`` not a string
        ValueError: only one of ``target`` and ``loss_fn``, ``output_fn`` with
            them, or an unknown ``reduction``
    """
    if output_fn is not None:
        if loss_fn is not None:
            raise ValueError(describe('eval_step returns the loss, or the output (or '
                                      'output_fn of it), not both',
                                      'loss_fn and output_fn', 'pass one of them'))
        if not callable(output_fn):
            raise TypeError(describe('output_fn must be callable', f'output_fn: {output_fn!r}',
                                     'pass a function of the output, e.g. '
                                     'lambda logits: logits.argmax(-1)'))
    if target is not None or not target_elsewhere:
        check_target_and_loss('eval_step', target, loss_fn,
                              'for the loss, or neither for the output')
    if loss_fn is not None:
        check_loss(loss_fn, reduction)


def split_evaluation(input: TensorOrTensors, target: Optional[TensorOrTensors], chunks: int,
                     reduction: str, last_device: torch.device
                     ) -> Tuple[List[Batch], List[Optional[TensorOrTensors]], List[float]]:
    """Splits an evaluation step's input, and its target if any, into micro-batches.

    Returns:
        as :func:`~torchgpipe.engine.inputs.split_step`; without a target, a
        ``None`` target and a weight of 1 for each micro-batch

    Raises:
        as :func:`~torchgpipe.engine.inputs.split_step`
    """
    batches, targets, sizes = split_given(input, target, chunks, last_device)
    assert batches is not None and sizes is not None
    return (batches, list(targets) if targets is not None else [None] * len(batches),
            evaluation_weights(sizes, reduction, target is not None))


def evaluation_weights(sizes: List[int], reduction: str, loss: bool) -> List[float]:
    """The weight of each micro-batch's loss, as :func:`~torchgpipe.engine.inputs.weighted`
    gives it; 1 for each without a loss (an output alone)."""
    return weighted(sizes, reduction) if loss else [1.0] * len(sizes)


def join(outputs: Optional[List[Batch]]) -> Optional[TensorOrTensors]:
    """The outputs of the micro-batches as one mini-batch, if they are here."""
    return None if outputs is None else microbatch.gather(outputs)

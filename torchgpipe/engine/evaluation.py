"""An evaluation step: a training step's forward actions alone, without autograd, in eval
mode; the last partition keeps the outputs, or each micro-batch's weighted loss."""
from contextlib import contextmanager
from typing import Iterator, List, Optional

from torch import nn

from torchgpipe.engine.schedule import Action, Kind, Schedule
from torchgpipe.engine.step import weighted
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, gather
from torchgpipe.foundation.validation import check_loss, check_target_and_loss, describe

__all__: List[str] = []


def forward_only(m: int, n: int) -> Schedule:
    """The forward actions of ``m`` micro-batches on ``n`` partitions, in clock order.

    Example::

        >>> print(forward_only(2, 2))
        0F0 0F1
        1F0 1F1
    """
    return Schedule(([Action(Kind.F, i, j) for i in range(m)] for j in range(n)),
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
    """Checks the arguments of an evaluation step: a target and a loss function, or neither
    (a rank may have no target: ``target_elsewhere``), or else maybe ``output_fn``."""
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


def evaluation_weights(sizes: List[int], reduction: str, loss: bool) -> List[float]:
    """Each micro-batch's loss weight; 1 without a loss."""
    return weighted(sizes, reduction) if loss else [1.0] * len(sizes)


def join(outputs: Optional[List[Batch]]) -> Optional[TensorOrTensors]:
    """The micro-batches' outputs as one mini-batch, if here."""
    return None if outputs is None else gather(outputs)

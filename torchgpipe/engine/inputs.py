"""A training step's input and target, split into micro-batches and checked before any work."""
from typing import List, Optional, Tuple

import torch

from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, check, move, scatter
from torchgpipe.foundation.validation import describe

__all__: List[str] = []


def split_given(input: Optional[TensorOrTensors], target: Optional[TensorOrTensors],
                chunks: int, last_device: torch.device
                ) -> Tuple[Optional[List[Batch]], Optional[List[TensorOrTensors]],
                           Optional[List[int]]]:
    """Splits what is given of a step's input and target (a rank's) into micro-batches,
    checked; the targets on the last device, as the loss function sees them; and the
    micro-batches' sizes, for the losses' weights."""
    if input is not None:
        check(input)
    if target is not None:
        check(target, 'target')
    batches = None if input is None else scatter(input, chunks)
    targets = None if target is None else scatter(target, chunks, 'target')
    sizes = None if batches is None else [b[0].size(0) for b in batches]
    target_sizes = None if targets is None else [t[0].size(0) for t in targets]
    if sizes is not None and target_sizes is not None and sizes != target_sizes:
        raise ValueError(describe('target must split into the micro-batches the input does',
                                  f'input micro-batches of {sizes}, target of {target_sizes}',
                                  'give a target with one row per sample of the input'))
    if targets is None:
        return batches, None, sizes
    # Views where the target is in the last device's memory already: no copies.
    move(targets, last_device)
    return batches, [t.plain for t in targets], sizes or target_sizes


def weighted(sizes: List[int], reduction: str) -> List[float]:
    """The weight of the loss of each micro-batch of ``sizes`` samples, under ``reduction``."""
    total = sum(sizes)
    if not total:
        # A data loader's leftover, whose mean loss would be nan.
        raise ValueError(describe('train_step needs at least one sample',
                                  'input: a mini-batch of 0 rows',
                                  'skip empty batches, e.g. with drop_last=True in the '
                                  'DataLoader'))
    return [size / total if reduction == 'mean' else 1.0 for size in sizes]

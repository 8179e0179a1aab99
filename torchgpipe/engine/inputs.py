"""A training step's input and target, split into micro-batches and checked before any work."""
from typing import List, Tuple

import torch

from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors
from torchgpipe.foundation.validation import describe

__all__: List[str] = []


def split_step(input: TensorOrTensors, target: TensorOrTensors, chunks: int, reduction: str,
               last_device: torch.device
               ) -> Tuple[List[Batch], List[TensorOrTensors], List[float]]:
    """Splits a training step's input and target into micro-batches, checked before any work.

    Returns:
        (batches, targets, weights): the input's micro-batches; the target's,
        on the last device, as the loss function sees them (NoChunk tensors
        unwrapped, as a layer sees its input); and the weight of each
        micro-batch's loss

    Raises:
        TypeError: the input or the target is not a tensor or a tuple of them
        ValueError: they cannot be split alike, or the mini-batch is empty
    """
    microbatch.check(input)
    microbatch.check(target, 'target')
    batches = microbatch.scatter(input, chunks)
    targets = microbatch.scatter(target, chunks, 'target')
    sizes = [b[0].size(0) for b in batches]
    target_sizes = [t[0].size(0) for t in targets]
    if sizes != target_sizes:
        raise ValueError(describe('target must split into the micro-batches the input does',
                                  f'input micro-batches of {sizes}, target of {target_sizes}',
                                  'give a target with one row per sample of the input'))
    total = sum(sizes)
    if not total:
        # The unwrapped model's mean loss would be nan: a step on an
        # empty batch is a data loader's leftover, not a training step.
        raise ValueError(describe('train_step needs at least one sample',
                                  'input: a mini-batch of 0 rows',
                                  'skip empty batches, e.g. with drop_last=True in the '
                                  'DataLoader'))
    # Views of the user's target where it is already in the last device's
    # memory (any CPU device, 'cpu:1' too): no copy of it per micro-batch.
    microbatch.move(targets, last_device)
    weights = [size / total if reduction == 'mean' else 1.0 for size in sizes]
    return batches, [t.plain for t in targets], weights

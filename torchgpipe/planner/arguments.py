"""The checks of :func:`torchgpipe.plan`'s arguments, before any work."""
import os
from typing import Any, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from torchgpipe.engine.generators import SCHEDULES, built_in, unknown_name
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors
from torchgpipe.foundation.placement import check_materialized
from torchgpipe.foundation.validation import (CHECKPOINTS, Device, brief, check_chunks,
                                              check_loss, check_names, check_number,
                                              check_process_group, check_target_and_loss,
                                              check_worker_devices, describe, verify_module)

__all__: List[str] = []


def check_arguments(module: nn.Sequential, sample: TensorOrTensors,
                    target: Optional[TensorOrTensors], loss_fn: Optional[LossFunction],
                    devices: Optional[Sequence[Device]], group: Optional[Any],
                    device: Optional[Device], schedules: Optional[Sequence[str]],
                    checkpoint: Optional[Sequence[str]], chunks: int, repeat: int,
                    runners_up: int, memory_limit: Optional[float],
                    param_scale: float, shards: int = 1
                    ) -> Tuple[int, List[torch.device], List[str], List[str], int]:
    """Checks :func:`torchgpipe.plan`'s arguments; returns the batch size, the devices (none
    with ``group``), the schedules and checkpoint modes, and the most micro-batches."""
    verify_module(module)
    # group.WORLD is None before init_process_group: device=, or no devices under
    # torchrun, meant a group.
    if group is None and devices is None and (device is not None or 'WORLD_SIZE' in os.environ):
        check_process_group('plan with group=', None, 'plan on the ranks of the job')
    if group is None and device is not None:
        raise ValueError(describe('device is for planning across processes, with group',
                                  f'device: {device!r}, group: None',
                                  'give devices=[...] to plan in one process'))
    if group is not None and devices is not None:
        raise ValueError(describe('plan takes devices or group, not both',
                                  f'devices: {devices!r}, group: given',
                                  "leave devices out, and give each rank's own device="))
    batch = check_sample(sample, target)
    workers = check_worker_devices(devices, len(module)) if group is None else []
    check_materialized(module)  # every layer is measured
    names = check_names('schedules', schedules, list(SCHEDULES), built_in, unknown_name,
                        "['1f1b', 'zb_h1']")
    modes = check_names('checkpoint', checkpoint, CHECKPOINTS,
                        lambda mode: mode if mode in CHECKPOINTS else None, unknown_mode,
                        "['never', 'except_last']")
    most = check_chunks(chunks)
    for name, value, least in (('repeat', repeat, 1), ('runners_up', runners_up, 0)):
        check_number(name, value, f'give e.g. {name}={max(least, 3)}', integer=True,
                     least=least, must=f'at least {least}')
    check_number('memory_limit', memory_limit, 'give bytes, such as memory_limit=8 * 2**30',
                 optional=True)
    check_number('param_scale', param_scale, 'give e.g. param_scale=4.0 for Adam')
    check_number('shards', shards, "give the size of the mesh's dimension fully_shard "
                 'shards over, such as shards=2', integer=True, least=1, must='at least 1')
    if shards != 1 and group is None:
        raise ValueError(describe('shards is for a pipeline of processes, with group',
                                  f'shards: {shards!r}, group: None',
                                  "plan on the pipeline's ranks with group=, or leave shards "
                                  'out'))
    check_target_and_loss('plan', target, loss_fn,
                          'to measure the loss with the last layer, or neither')
    if loss_fn is not None:
        check_loss(loss_fn)
    return batch, workers, names, modes, most


def check_sample(sample: TensorOrTensors, target: Optional[TensorOrTensors]) -> int:
    """The sample's batch size, once it (and the target) is checked."""
    microbatch.check(sample, 'sample')
    held = Batch(sample)
    tensors = list(held)
    if held.layout is not None and held.layout.nochunk:
        raise TypeError(describe('plan measures samples of tensors split along dimension 0',
                                 'sample: a tuple holding a NoChunk tensor',
                                 'give the sample without it, as its layers see it, or plan '
                                 'by hand with balance_by_time'))
    first = next((x for x in tensors if isinstance(x, Tensor)), None)
    if first is None or first.dim() == 0:
        raise ValueError(describe('sample must hold a tensor with a batch dimension',
                                  f'sample: {brief(sample)}', 'give one mini-batch'))
    batch = first.size(0)
    if target is not None:
        microbatch.check(target, 'target')
        sizes = {x.size(0) for x in Batch(target) if isinstance(x, Tensor) and x.dim()}
        if sizes != {batch}:
            raise ValueError(describe('target must have the batch size of sample',
                                      f'sample: {batch}, target: {sorted(sizes)}',
                                      "give the sample's own target"))
    return batch


def unknown_mode(mode: str) -> ValueError:
    return ValueError(describe(f'checkpoint must list modes of {list(CHECKPOINTS)}',
                               f'checkpoint: {mode!r}',
                               "give e.g. checkpoint=['never', 'except_last']"))

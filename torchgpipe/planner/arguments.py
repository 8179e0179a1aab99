"""The checks of :func:`torchgpipe.plan`'s arguments, before any work."""
import os
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from torchgpipe.engine.generators import SCHEDULES, built_in, unknown_name
from torchgpipe.engine.step import LossFunction
from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors
from torchgpipe.foundation.placement import check_materialized
from torchgpipe.foundation.validation import (CHECKPOINTS, Device, brief, check_available,
                                              check_chunks, check_loss, check_number,
                                              check_process_group,
                                              check_target_and_loss, describe, parse_devices,
                                              verify_module)

__all__: List[str] = []


def check_arguments(module: nn.Sequential, sample: TensorOrTensors,
                    target: Optional[TensorOrTensors], loss_fn: Optional[LossFunction],
                    devices: Optional[Sequence[Device]], group: Optional[Any],
                    device: Optional[Device], schedules: Optional[Sequence[str]],
                    checkpoint: Optional[Sequence[str]], chunks: int, repeat: int,
                    runners_up: int, trials: int, memory_limit: Optional[float],
                    param_scale: float
                    ) -> Tuple[int, List[torch.device], List[str], List[str], int]:
    """Checks :func:`torchgpipe.plan`'s arguments; returns the batch size, the devices (none
    with ``group``), the schedules and checkpoint modes, and the most micro-batches."""
    verify_module(module)
    # group.WORLD is None before init_process_group: device=, or no devices under
    # torchrun, meant a group.
    if group is None and devices is None and (device is not None or 'WORLD_SIZE' in os.environ):
        check_process_group('plan with group=', None, '')
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
    for name, value, least in (('repeat', repeat, 1), ('runners_up', runners_up, 0),
                               ('trials', trials, 0)):
        check_number(name, value, f'give e.g. {name}={max(least, 3)}', integer=True,
                     least=least, must=f'at least {least}')
    check_number('memory_limit', memory_limit, 'give bytes, such as memory_limit=8 * 2**30',
                 optional=True)
    check_number('param_scale', param_scale, 'give e.g. param_scale=4.0 for Adam')
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


def check_worker_devices(devices: Optional[Sequence[Device]], layers: int
                         ) -> List[torch.device]:
    """The planner's devices, one worker each: distinct, available, no more than the layers."""
    fix = "give e.g. devices=['cuda:0', 'cuda:1'], or devices=['cpu:0', 'cpu:1'] on CPU"
    if devices is None:
        if not torch.cuda.is_available():
            raise ValueError(describe('plan needs devices when CUDA is not available',
                                      'devices: None', fix))
        devices = [f'cuda:{k}' for k in range(torch.cuda.device_count())]
    parsed = parse_devices(devices, 'worker', fix)
    for k, device in enumerate(parsed):
        check_available(f'devices[{k}]', device, fix)
    if len({d.type for d in parsed}) > 1:
        raise ValueError(describe('devices must be of one type',
                                  f'devices: {[str(d) for d in parsed]}',
                                  'plan for CUDA devices or for CPU devices'))
    if not parsed or len(set(map(str, parsed))) != len(parsed):
        raise ValueError(describe('devices must be distinct, one worker each',
                                  f'devices: {[str(d) for d in parsed]}',
                                  'give each device once; on CPU, number them, as '
                                  "['cpu:0', 'cpu:1'], for a worker thread each"))
    if len(parsed) > layers:
        raise ValueError(describe('devices must be no more than the layers',
                                  f'{len(parsed)} devices, {layers} layers',
                                  f'give at most {layers} devices'))
    return parsed


def check_names(name: str, given: object, every: Sequence[str],
                known: Callable[[str], Optional[str]], unknown: Callable[[str], Exception],
                example: str) -> List[str]:
    """The names ``given`` to try (one, or a list; all of ``every`` if ``None``), each as
    ``known`` reads it, ``unknown(name)`` raised for one it does not."""
    if given is None:
        return list(every)
    if isinstance(given, str):
        given = [given]
    if not isinstance(given, Iterable):
        raise TypeError(describe(f'{name} must be a list of names', f'{name}: {given!r}',
                                 f'give e.g. {name}={example}'))
    names = []
    for each in given:
        found = known(str(each))
        if found is None:
            raise unknown(str(each))
        names.append(found)
    if not names:
        raise ValueError(describe(f'{name} must name at least one', f'{name}: []',
                                  'leave it out to try every one'))
    return list(dict.fromkeys(names))


def unknown_mode(mode: str) -> ValueError:
    return ValueError(describe(f'checkpoint must list modes of {list(CHECKPOINTS)}',
                               f'checkpoint: {mode!r}',
                               "give e.g. checkpoint=['never', 'except_last']"))

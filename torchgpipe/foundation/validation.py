"""Argument validation: one message format and one policy for every entry point.

A wrong type is a :exc:`TypeError`, a wrong value a :exc:`ValueError`, checked before
anything changes. A message says what is required (0.0.7's words), what was received,
and the fix::

    number of chunks must be positive integer (chunks: 0); give the number of
    micro-batches, such as chunks=8
"""
import math
import numbers
import sys
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Sized, Union, cast

import torch
from torch import nn

__all__: List[str] = []

#: What a device argument may be: a device, a CUDA index, or a name such as 'cuda:0'.
Device = Union[torch.device, int, str]
#: What a ``devices`` argument may be: any iterable of them.
Devices = Union[Iterable[Device], List[Device]]


def describe(requirement: str, received: str, fix: str) -> str:
    """The message of a validation error: what the argument must be, naming it; its name
    and value (``"chunks: 0"``); and the fix, with an example."""
    return f'{requirement} ({received}); {fix}'


def brief(value: object) -> str:
    """A value as a message shows it: its ``repr`` if one short line, else its type."""
    text = repr(value)
    if len(text) <= 60 and '\n' not in text:
        return text
    return f'a {type(value).__name__} object'


def real_number(value: object) -> Optional[numbers.Real]:
    """The real number ``value`` stands for (a 0-dim tensor's too); ``None`` for a bool."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return value


def as_int(value: object) -> Optional[int]:
    """The int an integral number stands for (``3.0``, ``torch.tensor(3)``), as in 0.0.7."""
    number = real_number(value)
    if number is None:
        return None
    if isinstance(number, numbers.Integral):
        return int(number)
    # NaN and the infinities are no integers either.
    as_float = float(number)
    return int(as_float) if as_float.is_integer() else None


def check_chunks(chunks: object) -> int:
    """Checks the number of micro-batches (an integral number, as :func:`as_int`)."""
    value = as_int(chunks)
    if value is not None and value > 0:
        return value
    fix = 'give the number of micro-batches, such as chunks=8'
    if real_number(chunks) is None:
        raise TypeError(describe('chunks must be an int', f'chunks: {chunks!r}', fix))
    raise ValueError(describe('number of chunks must be positive integer',
                              f'chunks: {chunks!r}', fix))


def check_number(name: str, value: object, fix: str, *, integer: bool = False, least: int = 0,
                 must: str = 'finite and non-negative', optional: bool = False
                 ) -> Optional[float]:
    """Checks a number argument: an int if ``integer``, else a real number (no bool), finite
    and at least ``least`` (``must`` says so); or ``None`` if ``optional``."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int if integer else numbers.Real):
        kind = 'an int' if integer else 'a real number'
        raise TypeError(describe(f'{name} must be {kind}' + (', or None' if optional else ''),
                                 f'{name}: {value!r}', fix))
    number = cast(float, value)  # an int or a numbers.Real, which the stubs cannot compare
    if not least <= number < math.inf:
        raise ValueError(describe(f'{name} must be {must}', f'{name}: {value!r}', fix))
    return number


def parse_device(name: str, value: object, fix: str) -> torch.device:
    """Parses the device argument ``name``: a device, a string or a CUDA index, as given."""
    if isinstance(value, bool) or not isinstance(value, (torch.device, int, str)):
        raise TypeError(describe(f'{name} must be a torch.device, a string or a CUDA index',
                                 f'{name}: {value!r}', fix))
    try:
        return torch.device(value)
    except RuntimeError as exc:
        raise ValueError(describe(f'{name} is not a valid device',
                                  f'{name}: {value!r}', fix)) from exc


def check_available(name: str, device: torch.device, no_cuda_fix: str) -> None:
    """Checks that a CUDA device ``name`` exists here; other devices pass."""
    if device.type != 'cuda':
        return
    if not torch.cuda.is_available():
        raise ValueError(describe(f'{name} is {device} but CUDA is not available',
                                  f'{name}: {str(device)!r}', no_cuda_fix))
    # torch's stubs type the index as int, but a bare 'cuda' has none.
    index: Optional[int] = device.index
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(describe(f'{name} is {device} but only {count} CUDA devices are visible',
                                  f'{name}: {str(device)!r}',
                                  f"use an index below {count}, such as 'cuda:0'"))


def check_device(value: object, fix: str) -> torch.device:
    """A process's own ``device`` argument: parsed (``None``: the CPU), and available here."""
    device = torch.device('cpu') if value is None else parse_device('device', value, fix)
    check_available('device', device, fix)
    return device


def parse_devices(devices: object, each: str, fix: str) -> List[torch.device]:
    """Parses a list of devices, one per ``each``: any iterable but a single device."""
    values = None
    if not isinstance(devices, (str, int, torch.device)):
        try:
            values = list(cast(Iterable[object], devices))
        except TypeError:
            pass
    if values is None:
        raise TypeError(describe(f'devices must be a list of devices, one per {each}',
                                 f'devices: {devices!r}', fix))
    return [parse_device(f'devices[{i}]', value, fix) for i, value in enumerate(values)]


def deny_moving() -> TypeError:
    """The error of moving a GPipe module as a whole (0.0.7's words)."""
    return TypeError('denied to move parameters and buffers, '
                     'because GPipe should manage device placement')


#: What every balance error adds.
BALANCE_HINT = """\
torchgpipe.balance can find a balance for you, from the time (balance_by_time)
or the memory (balance_by_size) each layer takes on a sample batch:

  from torchgpipe.balance import balance_by_time

  balance = balance_by_time(len(devices), model, sample, device=devices[0])
  model = GPipe(model, balance, devices=devices, chunks=8)
"""


def recommend_auto_balance(message: str) -> str:
    """Appends :data:`BALANCE_HINT` to an error message about the balance."""
    return f'{message}\n\n{BALANCE_HINT}'


class BalanceError(ValueError):
    """The balance does not fit the module."""


def verify_module(module: object) -> None:
    """Checks that the module can be partitioned (tied parameters may be shared).

    Raises:
        TypeError: the module is not :class:`~torch.nn.Sequential`
        ValueError: a child appears twice
    """
    if not isinstance(module, nn.Sequential):
        # 0.0.7's words, which users match on; the fix is a note, not part of str().
        error = TypeError('module must be nn.Sequential to be partitioned')
        if sys.version_info >= (3, 11):
            error.add_note(f'(module: {type(module).__name__}) flatten it first with '
                           'torchgpipe.to_sequential(module), or write its layers as an '
                           'nn.Sequential; see "module must be nn.Sequential" in the '
                           "documentation's troubleshooting page")
        raise error

    # Sequential's own iteration lists a repeated child once.
    names: Dict[int, str] = {}
    if any(names.setdefault(id(child), name) != name for name, child in module._modules.items()):
        raise ValueError('module with duplicate children is not supported')


def example_balance(layers: int) -> List[int]:
    """A balance of ``layers`` layers for error messages: two even partitions."""
    partitions = min(2, layers)
    return [layers // partitions + (j < layers % partitions) for j in range(partitions)]


def check_balance(module: Sized, balance: object) -> List[int]:
    """Checks the balance against the module (or its layers): ints (as :func:`as_int`),
    positive, summing to its layers (else :class:`BalanceError`)."""
    layers = len(module)
    example = example_balance(layers)

    type_error = TypeError(describe(
        'balance must be a list of ints, the number of layers of each partition',
        f'balance: {balance!r}',
        f'give one int per partition, such as balance={example} for {layers} layers'))
    # A string is iterable, but its characters are no numbers of layers.
    if isinstance(balance, (str, bytes)):
        raise type_error
    try:
        values = list(cast(Iterable[object], balance))
    except TypeError:
        raise type_error from None
    entries = [as_int(x) for x in values]
    if None in entries:
        raise type_error
    result = cast(List[int], entries)

    if sum(result) != layers:
        raise BalanceError(describe('module and sum of balance have different length',
                                    f'module: {layers}, sum of balance: {sum(result)}',
                                    f'make the numbers add up to the {layers} layers, '
                                    f'such as balance={example}'))
    if any(x <= 0 for x in result):
        raise BalanceError(describe('all balance numbers must be positive integer',
                                    f'balance: {result!r}',
                                    f'give every partition at least one layer, '
                                    f'such as balance={example}'))
    return result


def device_example(device: object) -> str:
    """A single device as an example of a correct call writes it; else ``'cpu'``."""
    if isinstance(device, (str, int, torch.device)) and not isinstance(device, bool):
        try:
            return str(torch.device(device))
        except RuntimeError:
            pass
    return 'cpu'


def check_devices(devices: object, partitions: int) -> List[torch.device]:
    """Checks ``devices`` (``None``: every CUDA device): one per partition (else
    ``IndexError``), those used available; returns every device given."""
    if devices is None:
        devices = range(torch.cuda.device_count())
    example = [device_example(devices)] * partitions
    device_list = parse_devices(devices, 'partition',
                                f'give one device per partition, such as devices={example}')

    if len(device_list) < partitions:
        # Fill up with the last device: one device may hold several partitions.
        last = [str(d) for d in device_list[-1:]] or ['cpu']
        example = [str(d) for d in device_list] + last * (partitions - len(device_list))
        raise IndexError(describe('too few devices to hold given partitions',
                                  f'devices: {len(device_list)}, partitions: {partitions}',
                                  f'give one device per partition, such as devices={example}, '
                                  f'or use fewer partitions'))

    # Only the devices in use must exist: extra ones are ignored.
    no_cuda_fix = f"run on the CPU, such as devices={['cpu'] * partitions}"
    for i, device in enumerate(device_list[:partitions]):
        check_available(f'devices[{i}]', device, no_cuda_fix)
    return device_list


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


#: The checkpoint modes, from the most memory kept to the least.
CHECKPOINTS = ('never', 'except_last', 'always')


def check_checkpoint(checkpoint: object) -> str:
    """A checkpoint mode; as in 0.0.7, anything whose ``str()`` is one (an enum member)."""
    mode = str(checkpoint)
    if mode not in CHECKPOINTS:
        # Word for word as in 0.0.7 (users match on it).
        raise ValueError("checkpoint is not one of 'always', 'except_last', or 'never'")
    return mode


def check_process_group(caller: str, group: object, fix: str) -> None:
    """Checks that torch.distributed is initialized, ``group`` is a process group (``None``:
    the default one), and this process is in it (``fix``: what to do if not)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f'{caller} needs torch.distributed: call '
                           "torch.distributed.init_process_group('gloo') (or 'nccl') first, on "
                           'every rank (until then, torch.distributed.group.WORLD is None)')
    if group is dist.GroupMember.NON_GROUP_MEMBER or (
            isinstance(group, (dist.ProcessGroup, type(None))) and dist.get_rank(group) < 0):
        raise ValueError(describe('this process must be in group', f'rank {dist.get_rank()}',
                                  fix))
    if not isinstance(group, (dist.ProcessGroup, type(None))):
        raise TypeError(describe('group must be a process group', f'group: {group!r}',
                                 'give e.g. group=torch.distributed.group.WORLD'))


def check_step(loss_fn: object, reduction: object) -> None:
    """Checks ``train_step``'s loss arguments, and that gradients are enabled."""
    check_loss(loss_fn, reduction)
    if not torch.is_grad_enabled():
        raise RuntimeError('train_step runs a backward pass, but gradients are disabled '
                           '(torch.no_grad() or torch.inference_mode()); call it outside '
                           'of them, or call the module itself for inference')


def check_timeout(timeout: object) -> Optional[float]:
    """Checks a step timeout: positive seconds (``inf`` too), or ``None``."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
        raise TypeError(describe('timeout must be a number of seconds, or None',
                                 f'timeout: {timeout!r}', 'give seconds, e.g. timeout=600'))
    if not timeout > 0:
        raise ValueError(describe('timeout must be positive', f'timeout: {timeout!r}',
                                  "give seconds, e.g. timeout=600, or None for the process "
                                  "group's"))
    return float(timeout)


def check_planned_threads(planned_threads: object) -> Optional[int]:
    """Checks the intra-op threads a plan measured with: a positive int, or ``None``."""
    return cast(Optional[int], check_number(
        'planned_threads', planned_threads,
        'pass plan.kwargs as torchgpipe.plan gives them, or leave planned_threads out',
        integer=True, least=1, must='positive', optional=True))


def check_loss_value(loss: object) -> torch.Tensor:
    """What ``loss_fn`` returned, if a tensor of one element; else ``TypeError``."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f' of shape {tuple(loss.shape)}' if isinstance(loss, torch.Tensor) else ''
        raise TypeError(describe('loss_fn must return a tensor of one element (a reduced '
                                 'loss)', f'loss_fn returned {type(loss).__name__}{shape}',
                                 'reduce the loss inside loss_fn, e.g. F.mse_loss(output, '
                                 'target) with its default reduction, or .mean() of a '
                                 'per-sample loss'))
    return loss


def check_loss(loss_fn: object, reduction: object = 'mean') -> None:
    """Checks a loss function, and how it reduces a micro-batch (``'mean'`` or ``'sum'``)."""
    if not isinstance(reduction, str) or reduction not in ('mean', 'sum'):
        error = ValueError if isinstance(reduction, str) else TypeError
        raise error(describe("reduction must be 'mean' or 'sum'",
                             f'reduction: {reduction!r}',
                             "say how loss_fn reduces a micro-batch, e.g. "
                             "reduction='mean' for F.cross_entropy"))
    if not callable(loss_fn):
        raise TypeError(describe('loss_fn must be callable', f'loss_fn: {loss_fn!r}',
                                 'pass a function of (output, target), e.g. F.mse_loss'))


def check_target_and_loss(caller: str, target: object, loss_fn: object, use: str) -> None:
    """Checks that ``target`` and ``loss_fn`` come together (``use``: what for), or neither."""
    if (target is None) != (loss_fn is None):
        given, missing = ('target', 'loss_fn') if loss_fn is None else ('loss_fn', 'target')
        raise ValueError(describe(f'{caller} takes a target and a loss_fn together, or neither',
                                  f'{given} without {missing}', f'pass {missing} too {use}'))


def check_evaluation(target: object, loss_fn: object, reduction: str,
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


def check_one_process() -> None:
    """Checks that ``train_step`` runs in one process: it averages no gradients across."""
    if (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1):
        raise RuntimeError('train_step does not all-reduce gradients across processes; '
                           'under DistributedDataParallel, call torchgpipe.distributed.'
                           'train_step(ddp_model, input, target, loss_fn) instead')

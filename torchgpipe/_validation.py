"""Argument validation: one message format and one policy for every entry point.

An argument of the wrong type raises :exc:`TypeError`; an argument of the
right type but a wrong value raises :exc:`ValueError` (or the subclass the
contract names, such as :class:`~torchgpipe.gpipe.BalanceError`, or
:exc:`IndexError` for too few devices). Every message says, in this order,
what is required, what was received, and how to fix it::

    number of chunks must be positive integer (chunks: 0); give the number of
    micro-batches, such as chunks=8

so a user can match on the requirement (torchgpipe 0.0.7's messages are kept
as requirements, word for word) and copy the fix. Arguments are checked
before anything is changed: a failed call leaves the user's module as it was.
"""
import numbers
from typing import List, Optional

import torch

__all__: List[str] = []


def describe(requirement: str, received: str, fix: str) -> str:
    """The message of a validation error.

    Args:
        requirement (str): what the argument must be, naming it
        received (str): the argument's name and the value received, such as
            ``"chunks: 0"``
        fix (str): how to fix the call, with an example of a correct argument

    Returns:
        str: ``'<requirement> (<received>); <fix>'``
    """
    return f'{requirement} ({received}); {fix}'


def brief(value: object) -> str:
    """A value as a message shows it: its ``repr`` when that is one short
    line, else only its type (a module's or a tensor's ``repr`` can fill a
    screen)."""
    text = repr(value)
    if len(text) <= 60 and '\n' not in text:
        return text
    return f'a {type(value).__name__} object'


def real_number(value: object) -> Optional[numbers.Real]:
    """The real number ``value`` stands for: itself, or the value of a 0-dim
    tensor; ``None`` for a bool (a bool counts no micro-batches or layers),
    a bool tensor, or anything that is no real number."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and value.dtype != torch.bool:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return value


def as_int(value: object) -> Optional[int]:
    """The :class:`int` an integral number stands for, as torchgpipe 0.0.7
    took it: ``3``, ``3.0``, a NumPy integer or a 0-dim tensor such as
    ``torch.tensor(3)``.

    Returns:
        int or None: the value as an int; ``None`` for a non-integral number
        (``2.5``) or anything :func:`real_number` refuses
    """
    number = real_number(value)
    if number is None:
        return None
    if isinstance(number, numbers.Integral):
        return int(number)
    # NaN and the infinities are no integers either.
    as_float = float(number)
    return int(as_float) if as_float.is_integer() else None


def check_chunks(chunks: object) -> int:
    """Checks the number of micro-batches, wherever it is given.

    An integral number that is not an :class:`int` (``8.0``, a NumPy
    integer, ``torch.tensor(8)``) is accepted, as in torchgpipe 0.0.7. A
    bool or a non-number is of the wrong type; a number that is not a
    positive integer (``0``, ``1.5``) is a wrong value.

    Returns:
        int: the number of micro-batches

    Raises:
        TypeError: ``chunks`` is not a number
        ValueError: ``chunks`` is not a positive integer
    """
    value = as_int(chunks)
    if value is not None and value > 0:
        return value
    fix = 'give the number of micro-batches, such as chunks=8'
    if real_number(chunks) is None:
        raise TypeError(describe('chunks must be an int', f'chunks: {chunks!r}', fix))
    raise ValueError(describe('number of chunks must be positive integer',
                              f'chunks: {chunks!r}', fix))


def parse_device(name: str, value: object, fix: str) -> torch.device:
    """Parses a device argument.

    Args:
        name (str): how to name the argument, such as ``'device'`` or
            ``'devices[1]'``
        value: a :class:`torch.device`, a string or a CUDA index
        fix (str): the caller's correct call

    Returns:
        torch.device: the device, as given (a bare ``'cuda'`` keeps no index)

    Raises:
        TypeError: ``value`` is none of the accepted types
        ValueError: ``value`` is not a device
    """
    if isinstance(value, bool) or not isinstance(value, (torch.device, int, str)):
        raise TypeError(describe(f'{name} must be a torch.device, a string or a CUDA index',
                                 f'{name}: {value!r}', fix))
    try:
        return torch.device(value)
    except RuntimeError as exc:
        raise ValueError(describe(f'{name} is not a valid device',
                                  f'{name}: {value!r}', fix)) from exc


def check_available(name: str, device: torch.device, no_cuda_fix: str) -> None:
    """Checks that a CUDA device exists here; other devices always pass.

    Args:
        name (str): how to name the argument
        device (torch.device): the parsed device
        no_cuda_fix (str): the fix when CUDA is not available: the caller's
            call on the CPU

    Raises:
        ValueError: CUDA is not available, or the CUDA index is too large
    """
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

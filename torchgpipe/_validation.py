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


def check_chunks(chunks: object) -> None:
    """Checks the number of micro-batches, wherever it is given.

    A bool or a non-number is of the wrong type; a number that is not a
    positive :class:`int` (``0``, ``1.5``) is a wrong value, as in
    torchgpipe 0.0.7.

    Raises:
        TypeError: ``chunks`` is not a number
        ValueError: ``chunks`` is not a positive integer
    """
    if isinstance(chunks, int) and not isinstance(chunks, bool) and chunks > 0:
        return
    fix = 'give the number of micro-batches, such as chunks=8'
    if isinstance(chunks, bool) or not isinstance(chunks, numbers.Real):
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

"""The header of a message between ranks: data only, which a peer's bytes can never make code.

A header (:class:`~torchgpipe.transport.wire.Wire`) is JSON of a message's key, its
tensors' shapes and types, and the message with each tensor replaced by its index; every
value JSON lacks is an object of one tagged entry::

    (x, None, 2.0, 'scale')          {"t": [{"T": 0}, null, 2.0, "scale"]}
    Activation(3, 1)                 {"A": [3, 1]}
    torch.float16                    {"dt": "float16"}

Decoding builds only these values and the library's own message types, and refuses
anything else (:class:`Unreadable`), where ``pickle`` would run what a crafted message names.
"""
from typing import Any, Callable, Dict, List, Sequence, Tuple, Type

import torch
from torch import Tensor

from torchgpipe.engine.mailbox import Activation, ForwardMessage, Gradient, Reply
from torchgpipe.foundation.copy import Ready
from torchgpipe.foundation.microbatch import Batch
from torchgpipe.foundation.nochunk import NoChunk

__all__: List[str] = []

#: The types of tensors a message may hold, by name.
DTYPES: Dict[str, torch.dtype] = {
    str(t).split('.')[-1]: t for t in vars(torch).values() if isinstance(t, torch.dtype)}
#: The name of each type, as a header gives it.
NAMES: Dict[torch.dtype, str] = {t: name for name, t in DTYPES.items()}


class Unreadable(ValueError):
    """A message's header is not one this library writes."""


class Unsendable(TypeError):
    """A message holds a value that a header cannot describe."""


def encode(message: Any, tensors: List[Tensor], inline: bool = False) -> Any:
    """``message`` as JSON data; its tensors appended to ``tensors``, and replaced by their
    index; with ``inline``, a real tensor of one element is its value, exact, and its type.

    Raises:
        Unsendable: it holds a value of another type than those listed above
    """
    if message is None or isinstance(message, (bool, int, float, str)):
        return message
    if isinstance(message, Tensor):
        if inline and message.dim() == 0 and not message.is_complex():
            return {'v': [message.item(), NAMES[message.dtype]]}  # a float64 holds any
        tensors.append(message)
        return {'T': len(tensors) - 1}
    for kind, (tag, parts, _) in TYPES.items():
        if isinstance(message, kind):
            return {tag: encode(parts(message), tensors, inline)}
    if isinstance(message, list):
        return {'l': [encode(x, tensors, inline) for x in message]}
    if isinstance(message, dict):
        return {'d': [[encode(k, tensors, inline), encode(v, tensors, inline)]
                      for k, v in message.items()]}
    if isinstance(message, tuple):  # after the named tuples and torch.Size
        return {'t': [encode(x, tensors, inline) for x in message]}
    raise Unsendable(f'{type(message).__name__} cannot go to another rank: a message holds '
                     'tensors, tuples, lists, dicts, numbers, strings, None, dtypes and devices')


def decode(data: Any, tensors: Sequence[Tensor], device: torch.device) -> Any:
    """The message that :func:`encode` turned into ``data``, its tensors taken from ``tensors``.

    Raises:
        Unreadable: ``data`` is not what :func:`encode` writes
    """
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        raise Unreadable('a bare list, where a list is tagged')
    if not (isinstance(data, dict) and len(data) == 1):
        raise Unreadable(f'{type(data).__name__} where a tagged value was expected')
    (tag, value), = data.items()
    if tag == 'T':
        if not (isinstance(value, int) and 0 <= value < len(tensors)):
            raise Unreadable(f'tensor {value!r} of {len(tensors)}')
        return tensors[value]
    if tag == 'R':
        return Ready(device)  # received tensors are ready on this device's current stream
    if tag == 'v':
        if not (isinstance(value, list) and len(value) == 2 and value[1] in DTYPES and
                isinstance(value[0], (bool, int, float))):
            raise Unreadable(f"'v' of {value!r}"[:200])
        return torch.tensor(value[0], dtype=DTYPES[value[1]], device=device)
    if tag in ('l', 't', 'd'):
        if not isinstance(value, list):
            raise Unreadable(f'{tag!r} of {type(value).__name__}')
        if tag == 'd':
            if not all(isinstance(x, list) and len(x) == 2 for x in value):
                raise Unreadable('a dict whose items are not pairs')
            return {decode(k, tensors, device): decode(v, tensors, device) for k, v in value}
        items = [decode(x, tensors, device) for x in value]
        return items if tag == 'l' else tuple(items)
    build = BUILDERS.get(tag)
    if build is None:
        raise Unreadable(f'unknown tag {tag!r}')
    try:
        return build(decode(value, tensors, device))
    except (TypeError, ValueError, KeyError, RuntimeError) as exc:
        raise Unreadable(f'{tag!r}: {exc}') from exc


#: Each type besides JSON's and containers: its tag, a value standing for it, how to rebuild it.
TYPES: Dict[Type[Any], Tuple[str, Callable[[Any], Any], Callable[[Any], Any]]] = {
    Activation: ('A', lambda k: (k.i, k.j), lambda v: Activation(*v)),
    Gradient: ('G', lambda k: (k.i, k.j), lambda v: Gradient(*v)),
    ForwardMessage: ('P', tuple, lambda v: ForwardMessage(*v)),
    Reply: ('Y', tuple, lambda v: Reply(*v)),
    Batch: ('B', lambda b: b.values, Batch),
    NoChunk: ('N', lambda n: n.tensor, NoChunk),
    Ready: ('R', lambda r: None, lambda v: v),  # decoded apart: it needs the device
    torch.Size: ('S', tuple, torch.Size),
    torch.dtype: ('dt', lambda t: NAMES[t], DTYPES.__getitem__),
    torch.device: ('dv', str, torch.device),
}
BUILDERS = {tag: build for tag, _, build in TYPES.values()}

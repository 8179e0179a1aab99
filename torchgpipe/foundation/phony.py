"""The phony tensor: an empty tensor that carries nothing but a dependency.

Fork, Join, Checkpoint and Recompute pass a phony tensor between autograd
nodes to order them in the backward graph. It is empty so it costs no memory
and no gradient arithmetic (footnote 3 of the paper), and it is cached per
device so creating one in the hot path is free.
"""
from typing import Dict, List, Tuple

import torch

from torchgpipe.foundation.stream import default_stream, use_device, use_stream

__all__: List[str] = []

_phonies: Dict[Tuple[torch.device, bool], torch.Tensor] = {}


def get_phony(device: torch.device, *, requires_grad: bool) -> torch.Tensor:
    """Returns a phony: an empty tensor on the device, shared by every caller.

    Args:
        device (torch.device): the device of the phony
        requires_grad (bool): whether the phony requires grad; a phony that
            requires grad makes the output of an autograd function taking it
            require grad too, so the function gets a backward node

    Returns:
        torch.Tensor: an empty tensor; never modify it

    Example::

        >>> get_phony(torch.device('cpu'), requires_grad=False)
        tensor([])
    """
    key = (device, requires_grad)
    try:
        return _phonies[key]
    except KeyError:
        # Allocate on the default stream: phonies outlive any stream they
        # are used on, and an empty tensor holds no memory to protect.
        with use_device(device), use_stream(default_stream(device)):
            phony = torch.empty(0, device=device, requires_grad=requires_grad)
        return _phonies.setdefault(key, phony)

"""The phony tensor: an empty tensor that carries nothing but a dependency.

Fork, Join, Checkpoint and Recompute pass it between autograd nodes to order
the backward graph. Empty, it costs no memory and no arithmetic (footnote 3
of the paper); cached per device, it costs nothing to make.
"""
from typing import Dict, List, Tuple

import torch

from torchgpipe.foundation.stream import default_stream, use_device, use_stream

__all__: List[str] = []

_phonies: Dict[Tuple[torch.device, bool], torch.Tensor] = {}


def get_phony(device: torch.device, *, requires_grad: bool) -> torch.Tensor:
    """A phony on ``device``, shared by every caller: never modify it. One that
    ``requires_grad`` gives an autograd function taking it a backward node.

    Example::

        >>> get_phony(torch.device('cpu'), requires_grad=False)
        tensor([])
    """
    key = (device, requires_grad)
    try:
        return _phonies[key]
    except KeyError:
        # On the default stream: a phony outlives the streams that use it.
        with use_device(device), use_stream(default_stream(device)):
            phony = torch.empty(0, device=device, requires_grad=requires_grad)
        return _phonies.setdefault(key, phony)

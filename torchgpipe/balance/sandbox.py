"""The sandbox layers are measured in: a copy of each layer, on the detached output of the
one before (skips too), so that its backward pass stays within it and the user's module
and random state stay as they were."""
import copy
import functools
from typing import ContextManager, Dict, Generator, List, Optional, Tuple

import torch
from torch import Tensor, nn

from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, map_tensors
from torchgpipe.foundation.placement import indexed
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.tracker import SkipTracker

__all__: List[str] = []


def layerwise_sandbox(module: nn.Sequential,
                      device: torch.device) -> Generator[nn.Module, None, None]:
    """Yields a deep copy of each layer on ``device``, in training mode, one at a time."""
    for layer in module:
        layer_copy = copy.deepcopy(layer)
        layer_copy.to(device)
        # Profile what training runs, but code captured in one mode runs in no other.
        layer_copy.train()
        for part in layer_copy.modules():
            only = getattr(part, 'only_mode', None)
            if only is not None:
                part.training = only
        yield layer_copy


class SandboxSkipTracker(SkipTracker):
    """A skip tracker whose pops get a detached copy, which the popping layer may change in
    place; stashed tensors are kept for :meth:`take_stashed` (the stashing layer's)."""

    def __init__(self) -> None:
        super().__init__()
        self.stashed: List[Tensor] = []
        #: The address and bytes of each skip's last popped copy (not the copy itself).
        self.popped: Dict[Tuple[Namespace, str], Tuple[int, int]] = {}
        #: If not ``None``, each popped copy's gradient (held, so not to measure memory).
        self.gradients: Optional[Dict[Tuple[Namespace, str], Tensor]] = None

    def save(self, batch: Batch, ns: Namespace, name: str, tensor: Optional[Tensor]) -> None:
        if tensor is not None:
            self.stashed.append(tensor)
            tensor = detach_tensor(tensor)
        super().save(batch, ns, name, tensor)

    def load(self, batch: Batch, ns: Namespace, name: str) -> Optional[Tensor]:
        tensor = super().load(batch, ns, name)
        if tensor is None:
            return None
        # Made as it pops: not the stashing layer's memory.
        copy = tensor.clone()
        self.popped[(ns, name)] = (copy.untyped_storage().data_ptr(),
                                   copy.numel() * copy.element_size())
        if copy.requires_grad and self.gradients is not None:
            note = functools.partial(self.gradients.__setitem__, (ns, name))
            copy.register_hook(note)  # type: ignore[no-untyped-call]
        return copy

    def take_stashed(self) -> List[Tensor]:
        """The tensors stashed since the last call, forgotten."""
        stashed = self.stashed
        self.stashed = []
        return stashed


def refuse_gradients(module: nn.Module) -> None:
    """Refuses a module holding gradients: profiling leaves none, and they are likely stale."""
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError('some parameter already has gradient')


def to_device(values: TensorOrTensors, device: torch.device) -> TensorOrTensors:
    """The sample on ``device``, detached from the user's graph."""
    return map_tensors(lambda x: detach_tensor(x.to(device)), values)


def fresh_input(values: TensorOrTensors) -> TensorOrTensors:
    """A copy of a layer's input, detached from the layer before, requiring grad as it did,
    that an in-place layer may change without touching the sample."""
    return map_tensors(lambda x: detach_tensor(x).clone(), values)


def detach_tensor(tensor: Tensor) -> Tensor:
    """``tensor`` detached, requiring grad as it did."""
    return tensor.detach().requires_grad_(tensor.requires_grad)


def synchronize(device: torch.device) -> None:
    """Waits for the device's kernels, for the clock to count them."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def preserve_rng_state(*devices: torch.device) -> ContextManager[None]:
    """Restores the CPU's random state, and that of each CUDA device of ``devices``, on exit."""
    return torch.random.fork_rng(devices=sorted({indexed(d).index for d in devices
                                                 if d.type == 'cuda'}))

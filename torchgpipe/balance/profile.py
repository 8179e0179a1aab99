"""Per-layer profiling for automatic balancing: the time and the memory of each layer.

Each layer runs as a copy, on the detached output of the previous one (skips too), so
its backward stays within it and the user's module stays as it was.
"""
import copy
import functools
import time
from typing import ContextManager, Dict, Generator, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, check, map_tensors, scatter
from torchgpipe.foundation.placement import indexed
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.tracker import SkipTracker, use_skip_tracker

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


def profile_times(module: nn.Sequential, sample: TensorOrTensors, timeout: float,
                  device: torch.device) -> List[int]:
    """The forward and backward time of each layer, in microseconds summed over whole
    passes repeated until ``timeout`` (after one warm-up pass)."""
    refuse_gradients(module)
    check(sample, 'sample')
    sample = to_device(sample, device)

    elapsed = [0.0] * len(module)
    with preserve_rng_state(device), torch.enable_grad():
        started = time.perf_counter()
        # Not counted: the first pass pays for one-time set-ups (threads, kernels, allocator).
        timed_pass(module, sample, device, [0.0] * len(module))
        while True:
            timed_pass(module, sample, device, elapsed)
            if time.perf_counter() - started >= timeout:
                break

    return [int(seconds * 1_000_000) for seconds in elapsed]


def timed_pass(module: nn.Sequential, sample: TensorOrTensors, device: torch.device,
               elapsed: List[float]) -> None:
    """Runs a training pass on fresh copies, adding each layer's seconds to ``elapsed``."""
    tracker = SandboxSkipTracker()
    values = sample
    with use_skip_tracker(tracker):
        for index, layer in enumerate(layerwise_sandbox(module, device)):
            values = fresh_input(values)

            synchronize(device)
            tick = time.perf_counter()
            output = layer(values)
            check(output, f'the output of layer {index}')
            backward_tensors = [y for y in (*Batch(output), *tracker.take_stashed())
                                if y.requires_grad]
            if backward_tensors:
                # Any gradient of the right shape will do: no allocation.
                torch.autograd.backward(backward_tensors, backward_tensors)
            synchronize(device)
            elapsed[index] += time.perf_counter() - tick

            values = output


def profile_sizes(module: nn.Sequential, input: TensorOrTensors, chunks: int,
                  param_scale: float, device: torch.device) -> List[int]:
    """The bytes each layer needs for training, as ``balance_by_size`` counts them."""
    refuse_gradients(module)
    check(input)
    values = to_device(scatter(input, chunks)[0].plain, device)

    sizes = []
    tracker = SandboxSkipTracker()
    with preserve_rng_state(device), torch.enable_grad(), use_skip_tracker(tracker):
        for index, layer in enumerate(layerwise_sandbox(module, device)):
            # Drops the previous layer's graph before measuring.
            values = fresh_input(values)

            if device.type == 'cuda':
                output, latent_size = allocated_by_forward(layer, values, tracker, device)
            else:
                output, saved, _, _ = kept_by_forward(layer, values, tracker)
                latent_size = sum(saved.values())
            check(output, f'the output of layer {index}')

            param_size = sum(p.numel() * p.element_size() for p in layer.parameters())
            sizes.append(int(latent_size + param_scale * param_size))

            values = output
            del output

    return sizes


def allocated_by_forward(layer: nn.Module, values: TensorOrTensors, tracker: 'SandboxSkipTracker',
                         device: torch.device) -> Tuple[TensorOrTensors, int]:
    """Runs the layer; returns its output and the CUDA memory its forward left allocated."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    output = layer(values)
    tracker.take_stashed()
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    # Popping a skip tensor can free more than the layer allocates.
    return output, max(0, after - before)


def kept_by_forward(layer: nn.Module, values: TensorOrTensors, tracker: 'SandboxSkipTracker'
                    ) -> Tuple[TensorOrTensors, Dict[int, int], Set[int], List[Tensor]]:
    """Runs the layer; returns its output, the bytes of each storage its forward keeps
    (saved, output or stashed; not its input, parameters or buffers) by address, the
    addresses autograd saved (its input's too), and the skips it stashed."""
    storages: Dict[int, int] = {}
    saved: Set[int] = set()

    def record(tensor: Tensor) -> None:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    def pack(tensor: Tensor) -> Tensor:
        record(tensor)
        saved.add(tensor.untyped_storage().data_ptr())
        # Detached: a saved output would hold its own node, a cycle a kept graph keeps alive.
        return tensor.detach()

    with saved_tensors_hooks(pack, lambda tensor: tensor):
        output = layer(values)
    stashed = tracker.take_stashed()
    for tensor in [*Batch(output), *stashed]:
        record(tensor)

    preexisting: Set[int] = {x.untyped_storage().data_ptr() for x in Batch(values)}
    preexisting.update(p.untyped_storage().data_ptr() for p in layer.parameters())
    preexisting.update(b.untyped_storage().data_ptr() for b in layer.buffers())
    return (output, {ptr: n for ptr, n in storages.items() if ptr not in preexisting}, saved,
            stashed)


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

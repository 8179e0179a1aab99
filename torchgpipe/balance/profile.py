"""Per-layer profiling for automatic balancing: the time and the memory of each layer,
each run as a copy in the :mod:`~torchgpipe.balance.sandbox`, a layer at a time."""
import time
from typing import Dict, List, Set, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from torchgpipe.balance.sandbox import (SandboxSkipTracker, fresh_input, layerwise_sandbox,
                                        preserve_rng_state, refuse_gradients, to_device)
from torchgpipe.balance.timing import layer_times_apart
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, check, scatter
from torchgpipe.skip.tracker import use_skip_tracker

__all__: List[str] = []


def profile_times(module: nn.Sequential, sample: TensorOrTensors, timeout: float,
                  device: torch.device) -> List[int]:
    """The forward and backward time of each layer, in microseconds summed over whole
    passes repeated until ``timeout`` (after one warm-up pass), a layer's copy at a time
    (:func:`~torchgpipe.balance.timing.layer_times_apart`)."""
    refuse_gradients(module)
    check(sample, 'sample')
    sample = to_device(sample, device)

    elapsed = [0.0] * len(module)
    with preserve_rng_state(device), torch.enable_grad():
        started = time.perf_counter()
        # Not counted: the first pass pays for one-time set-ups (threads, kernels, allocator).
        layer_times_apart(layerwise_sandbox(module, device), sample, device)
        while True:
            times = layer_times_apart(layerwise_sandbox(module, device), sample, device)
            elapsed = [e + f + b for e, f, b in zip(elapsed, times.forward, times.backward)]
            if time.perf_counter() - started >= timeout:
                break

    return [int(seconds * 1_000_000) for seconds in elapsed]


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


def allocated_by_forward(layer: nn.Module, values: TensorOrTensors, tracker: SandboxSkipTracker,
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


def kept_by_forward(layer: nn.Module, values: TensorOrTensors, tracker: SandboxSkipTracker
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

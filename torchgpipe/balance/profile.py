"""Per-layer profiling for automatic balancing: the time and the memory of each layer.

Every layer runs on a copy (:func:`layerwise_sandbox`), so the user's module
stays as it was, and the random generators are restored afterwards. Layers
run one by one, each on the detached output of the previous, so each backward
stays within its layer; skips travel through a tracker of the profiler's own,
detached the same way.
"""
import copy
import functools
import time
from typing import ContextManager, Dict, Generator, List, Optional, Set, Tuple

import torch
from torch import Tensor, nn
from torch.autograd.graph import saved_tensors_hooks

from torchgpipe.foundation import microbatch
from torchgpipe.foundation.microbatch import Batch, TensorOrTensors, map_tensors
from torchgpipe.skip.namespace import Namespace
from torchgpipe.skip.tracker import SkipTracker, use_skip_tracker

__all__: List[str] = []


def layerwise_sandbox(module: nn.Sequential,
                      device: torch.device) -> Generator[nn.Module, None, None]:
    """Yields a deep copy of each layer, moved to ``device`` and in training mode.

    The copies are made one at a time, as they are asked for, so a model too
    large for ``device`` can still be profiled layer by layer. ``module``
    itself is not modified.
    """
    for layer in module:
        layer_copy = copy.deepcopy(layer)
        layer_copy.to(device)
        # Balancing is for training: profile what training runs (dropout,
        # batch statistics), whatever mode the user's module is in; except
        # in code to_sequential recorded in one mode only, which runs in no other.
        layer_copy.train()
        for part in layer_copy.modules():
            only = getattr(part, 'only_mode', None)
            if only is not None:
                part.training = only
        yield layer_copy


def profile_times(module: nn.Sequential, sample: TensorOrTensors, timeout: float,
                  device: torch.device) -> List[int]:
    """Profiles the forward and backward time of each layer, in microseconds summed
    over whole passes repeated until ``timeout`` (after one warm-up pass).

    Raises:
        ValueError: a parameter of ``module`` already has a gradient
        TypeError: ``sample`` or a layer's output is neither a tensor nor a
            tuple of tensors
    """
    refuse_gradients(module)
    microbatch.check(sample, 'sample')
    sample = to_device(sample, device)

    elapsed = [0.0] * len(module)
    with preserve_rng_state(device), torch.enable_grad():
        started = time.perf_counter()
        # The first pass pays for one-time initializations (the autograd
        # engine's threads, kernel selection, allocator growth) that can
        # take longer than the model itself; it is not counted.
        timed_pass(module, sample, device, [0.0] * len(module))
        while True:
            timed_pass(module, sample, device, elapsed)
            if time.perf_counter() - started >= timeout:
                break

    return [int(seconds * 1_000_000) for seconds in elapsed]


def timed_pass(module: nn.Sequential, sample: TensorOrTensors, device: torch.device,
               elapsed: List[float]) -> None:
    """Runs one forward and backward pass, layer by layer, adding each layer's time to ``elapsed``.

    Times are in seconds.
    """
    # Fresh copies every pass: one layer at a time on the device, and no
    # gradient carried over from the previous pass.
    tracker = SandboxSkipTracker()
    values = sample
    with use_skip_tracker(tracker):
        for index, layer in enumerate(layerwise_sandbox(module, device)):
            values = fresh_input(values)

            synchronize(device)
            tick = time.perf_counter()
            output = layer(values)
            microbatch.check(output, f'the output of layer {index}')
            backward_tensors = [y for y in (*Batch(output), *tracker.take_stashed())
                                if y.requires_grad]
            if backward_tensors:
                # Any gradient of the right shape will do: the tensors
                # themselves save allocating one.
                torch.autograd.backward(backward_tensors, backward_tensors)
            synchronize(device)
            elapsed[index] += time.perf_counter() - tick

            values = output


def profile_sizes(module: nn.Sequential, input: TensorOrTensors, chunks: int,
                  param_scale: float, device: torch.device) -> List[int]:
    """Profiles the memory each layer needs for training, in bytes: what its forward
    keeps for the first micro-batch, plus ``param_scale`` times its parameters'
    bytes (see :func:`~torchgpipe.balance.balance_by_size`).

    Raises:
        ValueError: a parameter of ``module`` already has a gradient, or an
            input tensor has no batch dimension
        TypeError: ``input`` or a layer's output is neither a tensor nor a
            tuple of tensors
    """
    refuse_gradients(module)
    microbatch.check(input)
    values = to_device(microbatch.scatter(input, chunks)[0].plain, device)

    sizes = []
    tracker = SandboxSkipTracker()
    with preserve_rng_state(device), torch.enable_grad(), use_skip_tracker(tracker):
        for index, layer in enumerate(layerwise_sandbox(module, device)):
            # The previous layer's graph is dropped here, before measuring.
            values = fresh_input(values)

            if device.type == 'cuda':
                output, latent_size = allocated_by_forward(layer, values, tracker, device)
            else:
                output, latent_size = saved_by_forward(layer, values, tracker)
            microbatch.check(output, f'the output of layer {index}')

            param_size = sum(p.numel() * p.element_size() for p in layer.parameters())
            sizes.append(int(latent_size + param_scale * param_size))

            values = output
            # Now only `values` holds the graph, to be dropped by fresh_input.
            del output

    return sizes


def allocated_by_forward(layer: nn.Module, values: TensorOrTensors, tracker: 'SandboxSkipTracker',
                         device: torch.device) -> Tuple[TensorOrTensors, int]:
    """Runs the layer, measuring the CUDA memory its forward pass leaves allocated."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    output = layer(values)
    tracker.take_stashed()
    torch.cuda.synchronize(device)
    after = torch.cuda.memory_allocated(device)
    # Popping a skip tensor can free more than the layer allocates.
    return output, max(0, after - before)


def saved_by_forward(layer: nn.Module, values: TensorOrTensors,
                     tracker: 'SandboxSkipTracker') -> Tuple[TensorOrTensors, int]:
    """Runs the layer, measuring the bytes its forward pass keeps alive for training."""
    output, saved, _, _ = kept_by_forward(layer, values, tracker)
    return output, sum(saved.values())


def kept_by_forward(layer: nn.Module, values: TensorOrTensors, tracker: 'SandboxSkipTracker'
                    ) -> Tuple[TensorOrTensors, Dict[int, int], Set[int], List[Tensor]]:
    """Runs the layer; returns its output, the storages its forward pass keeps alive for
    training (what autograd saves, its outputs and stashed skip tensors, but not its input,
    parameters or buffers), by address with their bytes, the addresses of every
    storage autograd saved (its input's among them, if it saved it), and the skip
    tensors it stashed."""
    storages: Dict[int, int] = {}
    saved: Set[int] = set()

    def record(tensor: Tensor) -> None:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()

    def pack(tensor: Tensor) -> Tensor:
        record(tensor)
        saved.add(tensor.untyped_storage().data_ptr())
        # Detached: an output saved as it is would hold its own node, a cycle
        # that keeps both alive after a pass that retains the graph (``I``).
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
    """A skip tracker that hands each pop a detached copy of its tensor, so that the
    popping layer's backward stays within it and it may change the tensor in place.

    The stashed tensors are kept aside until :meth:`take_stashed`: they count for
    the stashing layer.
    """

    def __init__(self) -> None:
        super().__init__()
        self.stashed: List[Tensor] = []
        #: The storage of the copy each pop was last handed (its address and
        #: bytes, not the copy: the tracker keeps no memory alive), by the
        #: skip's namespace and name.
        self.popped: Dict[Tuple[Namespace, str], Tuple[int, int]] = {}
        #: While not ``None``, the gradient each copy handed to a pop gets in a
        #: backward pass, by the skip's namespace and name (held: a pass that
        #: compares gradients, not one that measures memory).
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
        # A copy for the popping layer, made as it pops (not counted in the
        # stashing layer's memory), which that layer may change in place.
        copy = tensor.clone()
        self.popped[(ns, name)] = (copy.untyped_storage().data_ptr(),
                                   copy.numel() * copy.element_size())
        if copy.requires_grad and self.gradients is not None:
            note = functools.partial(self.gradients.__setitem__, (ns, name))
            copy.register_hook(note)  # type: ignore[no-untyped-call]
        return copy

    def take_stashed(self) -> List[Tensor]:
        """Returns the tensors stashed since the last call, and forgets them."""
        stashed = self.stashed
        self.stashed = []
        return stashed


def refuse_gradients(module: nn.Module) -> None:
    """Raises ValueError if a parameter holds a gradient.

    Profiling must leave no gradient behind; refusing a module that already
    has some keeps that promise checkable, and warns of a stale training
    state the user probably did not mean to keep.
    """
    if any(p.grad is not None for p in module.parameters()):
        raise ValueError('some parameter already has gradient')


def to_device(values: TensorOrTensors, device: torch.device) -> TensorOrTensors:
    """Moves the sample to the device, detached from any graph of the user's."""
    return map_tensors(lambda x: detach_tensor(x.to(device)), values)


def fresh_input(values: TensorOrTensors) -> TensorOrTensors:
    """Copies a layer's input, detached from the graph of the layer before.

    The copy keeps whether each tensor requires grad, so the layer's backward
    pass computes the gradient of its input as it would in training. Being a
    copy (not a leaf), it may be modified in place, as by
    ``nn.ReLU(inplace=True)``, without touching the sample for the next pass.
    """
    return map_tensors(lambda x: detach_tensor(x).clone(), values)


def detach_tensor(tensor: Tensor) -> Tensor:
    """Detaches a tensor from its graph, keeping whether it requires grad."""
    return tensor.detach().requires_grad_(tensor.requires_grad)


def synchronize(device: torch.device) -> None:
    """Waits for the device's kernels, so the clock measures them."""
    if device.type == 'cuda':
        torch.cuda.synchronize(device)


def preserve_rng_state(device: torch.device) -> ContextManager[None]:
    """A context restoring the CPU random state, and the device's if it is CUDA."""
    if device.type != 'cuda':
        return torch.random.fork_rng(devices=[])
    index = torch.cuda.current_device() if device.index is None else device.index
    return torch.random.fork_rng(devices=[index])

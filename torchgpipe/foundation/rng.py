"""Random numbers in the pipeline: replayed by recomputations, drawn in one order.

One CPU generator per process, shared by every thread, and one per CUDA
device. Four rules keep results independent of threads:

1. **Replay.** A first pass saves the generators' states; its
   recomputation runs from them and puts the generators back.

2. **One order.** Drawing tasks take turns in issue order
   (:class:`~torchgpipe.runtime.worker.IssueOrder`), a single thread's
   order. Which partitions draw is learned by comparing the generator's
   state around a partition's first run (per setting of its ``training``
   flags). A CUDA generator needs no turns: only its worker draws from it.

3. **One holder at a time, across pipelines.** Every task that may draw
   holds :data:`cpu_generator_lock` while it runs (:func:`cpu_generator_held`),
   else another pipeline could draw between a save and its replay. It takes
   the lock last and waits for nothing while holding it, so no two tasks
   wait for each other; workers take their caller's hold with them
   (:func:`holding_for_caller`), for a GPipe nested in another. A thread
   drawing outside any pipeline is detected by the recomputation
   (:class:`~torchgpipe.runtime.replay.FirstPass`).

4. **No deadlock with the GIL.** ``torch.get_rng_state()`` holds the
   generator's mutex while it allocates, which may run the garbage
   collector and hand the GIL to a thread waiting for the mutex::

       worker A                            worker B
       get_rng_state: mutex ─► allocate    (holds the GIL)
         └► GC ─► finalizer yields GIL ──► get_rng_state: waits for mutex
       waits for the GIL ◄──────────────── holds the GIL: deadlock

   So every state read and write goes through ``state_lock``, a Python lock,
   waited for with the GIL released.
"""
import threading
from contextlib import contextmanager, nullcontext
from typing import Any, Callable, ContextManager, Generator, List, Optional, Tuple, TypeVar, cast

import torch
from torch import Tensor, nn

__all__: List[str] = []

#: The CPU generator's state (if saved), and the CUDA device's if the task runs on one.
RNGStates = Tuple[Optional[Tensor], Optional[Tensor]]

#: Held by every task while it may draw from the CPU generator (see point 3 above).
#: Reentrant: a partition may run a checkpoint of its own inside its task.
cpu_generator_lock = threading.RLock()

#: ``held`` is true in a worker thread started by a thread that held the lock.
_caller = threading.local()

#: Held around every read or write of a generator's state (see point 4 above).
state_lock = threading.Lock()

T = TypeVar('T')


def save_rng_states(device: torch.device, cpu: bool = True) -> RNGStates:
    """Captures the CPU generator's state (if ``cpu``), and the CUDA one if the device is CUDA."""
    with state_lock:
        gpu_rng_state = torch.cuda.get_rng_state(device) if device.type == 'cuda' else None
        return torch.get_rng_state() if cpu else None, gpu_rng_state


def cpu_rng_state() -> Tensor:
    """The CPU generator's state: compared before and after a task, it tells whether it drew."""
    with state_lock:
        return torch.get_rng_state()


def watch(compute: Callable[[], T], probing: bool = True) -> Tuple[T, bool]:
    """Runs ``compute`` holding the generator, and tells whether it drew from the CPU
    generator (point 2); without ``probing``, says it drew nothing."""
    if not probing:
        return compute(), False
    before = cpu_rng_state()
    output = compute()
    return output, not torch.equal(before, cpu_rng_state())


def set_rng_states(device: torch.device, states: RNGStates) -> None:
    """Puts the generators in the given states, each only if a state is given."""
    cpu_state, gpu_state = states
    with state_lock:
        if cpu_state is not None:
            torch.set_rng_state(cpu_state)
        if gpu_state is not None:
            torch.cuda.set_rng_state(gpu_state, device)


@contextmanager
def restore_rng_states(device: torch.device, states: RNGStates, *,
                       exclusive: bool) -> Generator[None, None, None]:
    """Runs the context from the saved ``states``, the generators put back after it.

    ``exclusive``: the context may draw from the CPU generator, so it is
    replayed too, holding :data:`cpu_generator_lock`; otherwise only the
    device's generator is.
    """
    if not exclusive and states[1] is None:
        # Nothing to replay: no device generator, and the CPU one left alone.
        yield
        return
    with cpu_generator_held(exclusive):
        # States saved on a CUDA device come with its generator's state.
        saved, replayed = save_rng_states(device), states
        if not exclusive:
            # The shared CPU state is not swapped without the lock.
            replayed, saved = (None, states[1]), (None, saved[1])
        try:
            # Inside: an interrupt right after it must still put them back.
            set_rng_states(device, replayed)
            yield
        finally:
            set_rng_states(device, saved)


_NO_LOCK = nullcontext()


def cpu_generator_held(may_draw: bool) -> ContextManager[object]:
    """What a task holds while it runs (point 3): :data:`cpu_generator_lock` if ``may_draw``."""
    if not may_draw or getattr(_caller, 'held', False):
        # A worker of a caller holding the lock draws under its hold.
        return _NO_LOCK
    return cpu_generator_lock


def cpu_generator_owned() -> bool:
    """Whether the calling thread holds the CPU generator: its lock, or its caller's hold."""
    return bool(getattr(_caller, 'held', False)) or cast(Any, cpu_generator_lock)._is_owned()


@contextmanager
def holding_for_caller(held: bool) -> Generator[None, None, None]:
    """Runs a worker thread's tasks under its caller's hold of the CPU generator, if ``held``."""
    _caller.held = held
    try:
        yield
    finally:
        _caller.held = False


def training_flags(module: nn.Module) -> Tuple[bool, ...]:
    """The ``training`` flag of every module in ``module``: whether it draws may depend on them."""
    return tuple(m.training for m in module.modules())

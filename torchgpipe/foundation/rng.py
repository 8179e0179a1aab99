"""Random numbers in the pipeline: replayed by recomputations, drawn in one order.

PyTorch has one CPU generator per process, shared by every thread, and one
per CUDA device. Four rules keep results independent of threads:

1. **Replay.** A first pass saves the CPU generator's state (and its CUDA
   device's); its recomputation runs from them and puts the generators back
   as it found them.

2. **One order.** With a worker per device, tasks drawing from the shared
   CPU generator at once would swap numbers. So drawing tasks take turns in
   issue order (:class:`~torchgpipe.runtime.worker.IssueOrder`), the order
   of a single-thread run. Which partitions draw is learned by comparing the
   generator's state around a partition's first run (per setting of its
   ``training`` flags). A CUDA generator needs no turns: only its own
   worker draws from it.

3. **One holder at a time, across pipelines.** Another pipeline drawing
   between a first pass's save and its last draw would make the
   recomputation replay other numbers, silently. So every task that may
   draw holds :data:`cpu_generator_lock` while it runs
   (:func:`cpu_generator_held`): first passes, probes and recomputations
   (on CUDA, autograd runs each device's backward in its own thread). It
   takes the lock last, after its turn and its inputs, and waits for
   nothing while holding it, so no two tasks wait for each other. Tasks
   known to draw nothing take no lock, and keep overlapping. Workers take
   the caller's hold with them (:func:`holding_for_caller`): a GPipe nested
   in a partition of another would otherwise wait for its caller's lock.
   A thread drawing outside any pipeline cannot be ordered: the
   recomputation detects it (:class:`~torchgpipe.runtime.replay.FirstPass`).

4. **No deadlock with the GIL.** ``torch.get_rng_state()`` holds the
   generator's C++ mutex while it allocates a tensor, which may run the
   garbage collector and hand the GIL to a thread that then waits for the
   mutex while holding the GIL::

       worker A                            worker B
       get_rng_state: mutex ─► allocate    (holds the GIL)
         └► GC ─► finalizer yields GIL ──► get_rng_state: waits for mutex
       waits for the GIL ◄──────────────── holds the GIL: deadlock

   So every state read and write here goes through ``state_lock``, a Python
   lock, which a thread waits for with the GIL released. (Kernels that draw
   take the mutex with the GIL released: they cannot close the circle.)
"""
import threading
from contextlib import contextmanager
from typing import Any, Callable, ContextManager, Generator, List, Optional, Tuple, TypeVar, cast

import torch
from torch import Tensor, nn

__all__: List[str] = []

#: The CPU generator's state, and the CUDA device's if the task runs on one.
RNGStates = Tuple[Tensor, Optional[Tensor]]

#: Held by every task while it may draw from the CPU generator (see point 3 above).
#: Reentrant: a partition may run a checkpoint of its own inside its task.
cpu_generator_lock = threading.RLock()

#: ``held`` is true in a worker thread started by a thread that held the lock.
_caller = threading.local()

#: Held around every read or write of a generator's state (see point 4 above).
state_lock = threading.Lock()

T = TypeVar('T')


def save_rng_states(device: torch.device) -> RNGStates:
    """Captures the CPU generator's state, and the CUDA one if the device is CUDA."""
    with state_lock:
        gpu_rng_state = torch.cuda.get_rng_state(device) if device.type == 'cuda' else None
        return torch.get_rng_state(), gpu_rng_state


def cpu_rng_state() -> Tensor:
    """The CPU generator's state: compared before and after a task, it tells whether it drew."""
    with state_lock:
        return torch.get_rng_state()


def watch(compute: Callable[[], T], probing: bool = True) -> Tuple[T, bool]:
    """Runs a task, and tells whether it drew from the CPU generator: the probe of point 2.

    Run it holding the generator (:func:`cpu_generator_held`): a change of
    the generator's state is then the task's doing.

    Args:
        compute: the task
        probing: whether to watch (otherwise, the task runs as it is, and
            is said to have drawn nothing)

    Returns:
        what ``compute`` returned, and whether it drew
    """
    if not probing:
        return compute(), False
    before = cpu_rng_state()
    output = compute()
    return output, not torch.equal(before, cpu_rng_state())


def set_rng_states(device: torch.device,
                   states: Tuple[Optional[Tensor], Optional[Tensor]]) -> None:
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
    """Runs the context from the saved states; the generators are put back after it.

    Args:
        device: the device the states were saved on
        states: what :func:`save_rng_states` returned
        exclusive: the context may draw from the CPU generator: replay it
            too, holding :data:`cpu_generator_lock` throughout. Otherwise the
            CPU generator, which other threads may be drawing from, is left
            alone, and only the device's own generator is replayed
    """
    if not exclusive and states[1] is None:
        # Nothing to replay: no device generator, and the CPU one left alone.
        yield
        return
    with cpu_generator_held(exclusive):
        # States saved on a CUDA device come with its generator's state.
        saved: Tuple[Optional[Tensor], Optional[Tensor]] = save_rng_states(device)
        replayed: Tuple[Optional[Tensor], Optional[Tensor]] = states
        if not exclusive:
            # Swapping the shared CPU state without the lock would hand a
            # thread that draws meanwhile the numbers of this replay.
            replayed, saved = (None, states[1]), (None, saved[1])
        try:
            # Inside: an interrupt right after it must still put them back.
            set_rng_states(device, replayed)
            yield
        finally:
            set_rng_states(device, saved)


class _NoLock:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc_info: object) -> None:
        pass


_NO_LOCK = _NoLock()


def cpu_generator_held(may_draw: bool) -> ContextManager[object]:
    """What a task holds while it runs (point 3 above): :data:`cpu_generator_lock` if
    ``may_draw``, nothing for a partition known to draw nothing."""
    if not may_draw or getattr(_caller, 'held', False):
        # A worker of a caller holding the lock draws under its hold.
        return _NO_LOCK
    return cpu_generator_lock


def cpu_generator_owned() -> bool:
    """Whether the calling thread holds the CPU generator: its lock, or its caller's hold."""
    return bool(getattr(_caller, 'held', False)) or cast(Any, cpu_generator_lock)._is_owned()


@contextmanager
def holding_for_caller(held: bool) -> Generator[None, None, None]:
    """Runs a worker thread's tasks under its caller's hold of the CPU generator, if
    ``held`` (:func:`cpu_generator_owned` in the caller): see point 3 above."""
    _caller.held = held
    try:
        yield
    finally:
        _caller.held = False


def training_flags(module: nn.Module) -> Tuple[bool, ...]:
    """The ``training`` flag of every module in ``module``: whether it draws may depend on them."""
    return tuple(m.training for m in module.modules())

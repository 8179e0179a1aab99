"""Random numbers in the pipeline: replayed by recomputations, drawn in one order.

PyTorch has one CPU generator per process, shared by every thread, and one
generator per CUDA device. Two promises rest on them (1 and 2), kept across
threads by two rules (3 and 4):

1. **Replay.** A recomputation draws exactly the random numbers its first pass
   drew. The first pass saves the CPU generator's state (and its CUDA
   device's); the recomputation runs from those states and puts the
   generators back as it found them, so the random stream of the rest of the
   program is not disturbed.

2. **One order in every execution mode.** On one thread, tasks draw from the
   CPU generator in the order the schedule issues them. With a worker thread
   per device, tasks of different devices run at the same time; if two of
   them drew from the shared CPU generator at once, each would get numbers
   meant for the other, the first pass of a checkpointed task could not be
   replayed, and the results would depend on thread timing. So tasks that
   draw from the CPU generator *take turns*
   (:class:`~torchgpipe.runtime.worker.IssueOrder`): each waits for
   the previous drawing task in issue order, which is the order of the
   single-thread run. Tasks that draw nothing run freely.

   Which partitions draw is learned, not guessed: the first time a partition
   runs (for each setting of its modules' ``training`` flags), its task
   compares the CPU generator's state before and after it, holding the
   generator (point 3). A CUDA device's generator needs no turns: only its
   own worker draws from it, in issue order.

3. **One holder at a time, across pipelines.** IssueOrder order the tasks of one
   pipeline; other pipelines, in other threads, draw from the same CPU
   generator. A recomputation restores the state its first pass saved: if
   another task drew between that save and the first pass's last draw, the
   recomputation replays other numbers (another dropout mask), silently. So
   every task that may draw from the CPU generator holds
   :data:`cpu_generator_lock` while it runs (:func:`cpu_generator_held`),
   on either path and in either engine: a first pass from before it saves
   the state until after its last draw, an uncheckpointed pass, a probe
   that learns whether its partition draws (its look at the state
   included), and a recomputation (on CUDA, the autograd engine runs the
   backward of each device in its own thread, and recomputations of
   different devices could otherwise interleave). It takes the lock last,
   after its turn and after anything it waits for from another task, and
   waits for nothing while holding it: no two tasks can wait for each other.

   Tasks of a partition known to draw nothing take no lock, so they never
   wait for another pipeline: that keeps the worker threads overlapping. A
   recomputation of such a partition leaves the CPU generator alone:
   swapping its state, even for a moment, would change the numbers of a
   task drawing meanwhile.

   A pipeline may run inside a task that holds the lock (a GPipe nested in
   a partition of another): its worker threads would wait for ever for a
   lock their caller holds while it waits for them. So workers take the
   caller's hold with them, as they take its grad mode and autocast state
   (:func:`holding_for_caller`): their tasks draw under it, in the turns of
   their own pipeline, while the caller waits.

   The lock only orders the library's own tasks. A thread that draws from
   the CPU generator outside any pipeline (``torch.randn`` in a data
   loading thread, say) can draw between a first pass's save and its
   draws, and no library can replay that: such a thread should draw from a
   :class:`torch.Generator` of its own. The recomputation finds it out, as
   it ends with the generator elsewhere than its first pass did, and raises
   (:class:`~torchgpipe.runtime.replay.FirstPass`).

4. **No deadlock with the GIL.** PyTorch guards each generator with a C++
   mutex. Reading a state (``torch.get_rng_state()``) holds that mutex while
   it wraps the state in a new Python tensor, which may start the garbage
   collector, which may run Python code and hand the GIL to another thread.
   If that thread then asks for the same mutex *while holding the GIL* (which
   every state read or write does), neither can go on::

       worker A                            worker B
       get_rng_state: mutex ─► allocate    (holds the GIL)
         └► GC ─► finalizer yields GIL ──► get_rng_state: waits for mutex
       waits for the GIL ◄──────────────── holds the GIL: deadlock

   Kernels that draw (dropout) take the mutex with the GIL released, so they
   cannot close such a circle. Every read and write of a generator's state
   here goes through ``state_lock``, a Python lock, which a thread waits
   for with the GIL released: at most one thread is ever inside a state call,
   and the one waiting for it does not hold what that call needs.
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
    """What a task holds while it runs: :data:`cpu_generator_lock`, if it may draw from it.

    Both engines run every task in it, and every recomputation
    (:func:`restore_rng_states`): the one rule of point 3 above. Enter it
    only once the task's turn has come and all it waits for from other
    tasks is there; inside, wait for nothing.

    Args:
        may_draw: whether the task may draw from the CPU generator: false
            only for a partition known to draw nothing, whose task then
            holds nothing and runs beside any other

    Returns:
        the context to run the task in
    """
    if not may_draw or getattr(_caller, 'held', False):
        # A worker of a caller holding the lock draws under its hold.
        return _NO_LOCK
    return cpu_generator_lock


def cpu_generator_owned() -> bool:
    """Whether the calling thread holds the CPU generator: its lock, or its caller's hold.

    Read in the thread that starts worker threads, and given to
    :func:`holding_for_caller` in each of them.
    """
    return bool(getattr(_caller, 'held', False)) or cast(Any, cpu_generator_lock)._is_owned()


@contextmanager
def holding_for_caller(held: bool) -> Generator[None, None, None]:
    """Runs a worker thread's tasks under its caller's hold of the CPU generator, if any.

    The caller waits for its workers while it holds the generator: they
    must not wait for it (see point 3 above).

    Args:
        held: what :func:`cpu_generator_owned` said in the thread that
            started the worker
    """
    _caller.held = held
    try:
        yield
    finally:
        _caller.held = False


def training_flags(module: nn.Module) -> Tuple[bool, ...]:
    """The ``training`` flag of every module in ``module``: whether it draws may depend on them."""
    return tuple(m.training for m in module.modules())

"""Workers: one thread per device, computing the tasks of each clock cycle.

The tasks of one clock cycle are independent (Section 3.2.1), so the devices
can work on them at the same time. Each distinct device gets one thread, fed
through a queue; partitions sharing a device share its thread, so tasks on one
device run in the order they were issued.

Grad mode and autocast are thread-local in PyTorch; a new thread starts with
grad enabled and autocast off. The workers take both from the caller, so
``torch.no_grad()`` and ``torch.autocast()`` around a GPipe call work.
"""
import sys
import threading
from contextlib import contextmanager
from queue import Queue
from types import TracebackType
from typing import (Callable, Dict, Generator, Iterable, List, Optional, Tuple, Type, Union,
                    cast)

import torch

from torchgpipe.checkpoint import AutocastStates, restore_autocast_states, save_autocast_states
from torchgpipe.microbatch import Batch
from torchgpipe.stream import AbstractStream, use_device, use_stream

__all__ = ['Task', 'worker', 'spawn_workers']

ExcInfo = Tuple[Type[BaseException], BaseException, TracebackType]

class Task:
    """A task: a computation for a worker, and a finalization for the scheduler.

    ``compute`` runs in the worker thread. ``finalize`` runs in the thread that
    called the pipeline, after the result came back: it builds autograd nodes
    (the recomputation), which must be created in clock-cycle order.

    Args:
        stream: the stream to compute on
        compute: produces the output batch
        finalize: post-processes the output batch, if given
    """

    def __init__(self, stream: AbstractStream, *, compute: Callable[[], Batch],
                 finalize: Optional[Callable[[Batch], None]]) -> None:
        self.stream = stream
        self._compute = compute
        self._finalize = finalize

    def compute(self) -> Batch:
        with use_stream(self.stream):
            return self._compute()

    def finalize(self, batch: Batch) -> None:
        if self._finalize is None:
            return
        with use_stream(self.stream):
            self._finalize(batch)


# A worker takes tasks (None to stop) and reports (True, (task, output
# batch)) or (False, exc_info) for each.
InQueue = Queue[Optional[Task]]
OutQueue = Queue[Tuple[bool, Union[Tuple[Task, Batch], ExcInfo]]]


def worker(in_queue: InQueue, out_queue: OutQueue, device: torch.device,
           grad_mode: bool, autocast_states: AutocastStates) -> None:
    """The main loop of a worker thread: computes tasks until it gets ``None``."""
    torch.set_grad_enabled(grad_mode)
    with use_device(device), restore_autocast_states(autocast_states):
        while True:
            task = in_queue.get()
            if task is None:
                break
            try:
                batch = task.compute()
            except BaseException:
                # The scheduler re-raises it in the caller's thread.
                out_queue.put((False, cast(ExcInfo, sys.exc_info())))
                continue
            out_queue.put((True, (task, batch)))
            # Do not keep the last task and its tensors alive while idle.
            del task, batch


def _normalize(device: torch.device) -> torch.device:
    # 'cuda' and 'cuda:<current>' are the same device, and so one worker.
    if device == torch.device('cuda'):
        return torch.device('cuda', torch.cuda.current_device())
    return device


@contextmanager
def spawn_workers(devices: Iterable[torch.device],
                  ) -> Generator[Tuple[List[InQueue], List[OutQueue]], None, None]:
    """Starts one worker per distinct device, and stops and joins them on exit.

    Args:
        devices: the device of each partition

    Yields:
        (in_queues, out_queues): the queues of each partition's worker, in
        the order of ``devices``; partitions on the same device share them
    """
    workers: Dict[torch.device, Tuple[InQueue, OutQueue]] = {}
    threads: List[threading.Thread] = []
    in_queues: List[InQueue] = []
    out_queues: List[OutQueue] = []

    grad_mode = torch.is_grad_enabled()
    autocast_states = save_autocast_states()

    try:
        for device in map(_normalize, devices):
            if device not in workers:
                queues: Tuple[InQueue, OutQueue] = (Queue(), Queue())
                thread = threading.Thread(
                    target=worker, args=(*queues, device, grad_mode, autocast_states),
                    name=f'torchgpipe worker ({device})', daemon=True)
                thread.start()
                threads.append(thread)
                workers[device] = queues
            in_queue, out_queue = workers[device]
            in_queues.append(in_queue)
            out_queues.append(out_queue)

        yield in_queues, out_queues
    finally:
        for in_queue, _ in workers.values():
            in_queue.put(None)
        # Joined so that no thread outlives the call, whatever happened.
        for thread in threads:
            thread.join()

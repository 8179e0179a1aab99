"""Stress run of the CPU generator's state calls from many threads, with a deadline.

Two Python threads each train two GPipe models on CPU devices with a worker
thread per device (``cpu:0..3``): one by ``train_step`` (1F1B), one by the
forward path and ``backward()``. Both read and write the CPU generator's state
from several threads at once (checkpoints save it, recomputations replay it,
probes compare it).

PyTorch holds a generator's C++ mutex while it wraps a state in a new Python
tensor; if that allocation starts the garbage collector and a finalizer hands
the GIL to a thread that then asks for the same mutex while holding the GIL,
both threads wait for ever (see :mod:`torchgpipe.foundation.rng`). That interleaving is
rare in real runs; here it is made frequent: a collection every few dozen
allocations, garbage with Python finalizers made inside every partition, and a
switch interval of 10 µs, so a finalizer yields the GIL almost every time.

The run ends with status 0 when every step is done. If it is not done by the
deadline, :mod:`faulthandler` prints every thread's stack and ends the process
with status 1: a hang fails instead of lasting for ever::

    python tests/stress_generator_lock.py --steps 150 --deadline 60
"""
import argparse
import faulthandler
import gc
import sys
import threading
import time
from typing import List

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchgpipe import GPipe


class Finalized:
    """A reference cycle whose finalizer runs Python code: the collector must call it."""

    def __init__(self) -> None:
        self.cycle = self

    def __del__(self) -> None:
        sum(range(50))


class Litter(nn.Module):
    """Tanh that leaves garbage for the collector behind, in whichever thread runs it."""

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(5):
            Finalized()
        return torch.tanh(x)


def model() -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(16, 16), Litter())])


def train(steps: int, errors: List[BaseException], built: threading.Barrier) -> None:
    try:
        devices = ['cpu:0', 'cpu:1', 'cpu:2', 'cpu:3']
        by_step = GPipe(model(), [4] * 4, devices=devices, chunks=8)
        by_forward = GPipe(model(), [4] * 4, devices=devices, chunks=8)
        x, target = torch.randn(32, 16), torch.randn(32, 16)
        # Building draws from the CPU generator: not while the other thread's step runs
        # (its recomputation would rightly refuse draws from outside the pipeline).
        built.wait()
        for _ in range(steps):
            by_step.train_step(x, target, F.mse_loss)
            F.mse_loss(by_forward(x), target).backward()
    except BaseException as exc:
        errors.append(exc)
        built.abort()  # the other thread, if waiting, stops too


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--steps', type=int, default=150, help='steps of each model')
    parser.add_argument('--deadline', type=float, default=60.0,
                        help='seconds before the run counts as hung')
    args = parser.parse_args()

    faulthandler.dump_traceback_later(args.deadline, exit=True)
    torch.set_num_threads(1)
    gc.set_threshold(50, 1, 1)
    sys.setswitchinterval(1e-5)

    errors: List[BaseException] = []
    built = threading.Barrier(2)
    threads = [threading.Thread(target=train, args=(args.steps, errors, built))
               for _ in range(2)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    faulthandler.cancel_dump_traceback_later()
    if errors:
        raise errors[0]
    print(f'{2 * 2 * args.steps} steps in {time.perf_counter() - start:.1f} s')
    return 0


if __name__ == '__main__':
    sys.exit(main())

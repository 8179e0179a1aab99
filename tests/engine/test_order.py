"""Properties 2 and 3: the order of forward, recomputation and backward tasks.

Forward: tasks are issued by clock cycle, micro-batches 0..m-1 on each
partition. Backward: micro-batches m-1..0 on each partition, each
recomputation right before its own backward and after the backward of the
next micro-batch. Both hold with every partition in the calling thread and
with one worker thread per device (the ``threaded`` fixture of conftest.py).
"""
from typing import List, Tuple

import pytest
import torch
from torch import Tensor, nn

from helpers import cpu_devices
from torchgpipe import GPipe, is_recomputing
from torchgpipe.engine.core import forward_only
from torchgpipe.engine.pipeline import clock_cycles
from torchgpipe.engine.schedule import clock_order

Event = Tuple[str, int, int]  # (kind, partition, micro-batch)


class Recorder(nn.Module):
    """Records what runs on partition ``j``; the micro-batch is read off the data.

    Row values encode the micro-batch index (one row per micro-batch), and
    the layer multiplies by a parameter equal to one, so values survive.
    """

    def __init__(self, j: int, events: List[Event]) -> None:
        super().__init__()
        self.j = j
        self.events = events
        self.weight = nn.Parameter(torch.ones(1))

    def forward(self, x: Tensor) -> Tensor:
        i = int(x[0, 0].item())
        self.events.append(('R' if is_recomputing() else 'F', self.j, i))
        y = x * self.weight
        if y.requires_grad:
            # Fires when the gradient of y is computed: the end of B(i, j),
            # as this is the first layer of the partition.
            y.register_hook(lambda grad: self.events.append(('B', self.j, i)) or None)
        return y


def run(n: int, m: int, checkpoint: str, threaded: bool) -> List[Event]:
    events: List[Event] = []
    layers: List[nn.Module] = []
    for j in range(n):
        layers += [Recorder(j, events), nn.Identity()]
    gpipe = GPipe(nn.Sequential(*layers), [2] * n, devices=cpu_devices(n, threaded), chunks=m,
                  checkpoint=checkpoint)
    input = torch.arange(m, dtype=torch.float).unsqueeze(1).repeat(1, 3)
    output = gpipe(input)
    output.sum().backward()
    return events


@pytest.mark.parametrize('n, m', [(1, 4), (3, 1), (3, 4), (4, 8), (2, 5)])
def test_forward_runs_cycle_by_cycle(n: int, m: int, checkpoint: str, threaded: bool) -> None:
    """Every task runs once, never before a task of an earlier clock cycle, and
    each partition takes micro-batches 0..m-1 in order."""
    events = run(n, m, checkpoint, threaded)
    forward = [(j, i) for kind, j, i in events if kind == 'F']
    assert sorted(forward) == [(j, i) for j in range(n) for i in range(m)]
    clocks = [i + j for j, i in forward]
    assert clocks == sorted(clocks)
    for j in range(n):
        assert [i for jj, i in forward if jj == j] == list(range(m))


@pytest.mark.parametrize('n, m', [(1, 4), (3, 1), (3, 4), (4, 8), (2, 5)])
def test_inline_forward_runs_in_schedule_order(n: int, m: int, checkpoint: str) -> None:
    """Single-thread path only: there, tasks also run in the order clock_cycles
    lists them within a cycle. With a thread per device, the tasks of one cycle
    run concurrently and may interleave in any order."""
    events = run(n, m, checkpoint, threaded=False)
    forward = [(j, i) for kind, j, i in events if kind == 'F']
    assert forward == [(j, i) for schedule in clock_cycles(m, n) for i, j in schedule]


@pytest.mark.parametrize('n, m', [(1, 4), (3, 1), (3, 4), (4, 8), (2, 5)])
def test_backward_runs_in_reverse_with_recomputation_right_before(n: int, m: int,
                                                                    checkpoint: str,
                                                                    threaded: bool) -> None:
    events = run(n, m, checkpoint, threaded)
    checkpoint_stop = {'always': m, 'except_last': m - 1, 'never': 0}[checkpoint]
    for j in range(n):
        backward = [(kind, i) for kind, jj, i in events if jj == j and kind != 'F']
        expected: List[Tuple[str, int]] = []
        for i in reversed(range(m)):
            if i < checkpoint_stop:
                expected.append(('R', i))
            expected.append(('B', i))
        assert backward == expected, f'partition {j}'


@pytest.mark.parametrize('m', range(1, 6))
@pytest.mark.parametrize('n', range(1, 6))
def test_clock_cycles_are_the_forward_only_schedule_in_clock_order(m: int, n: int) -> None:
    """What the pipeline runs (any schedule's layout, of the forward-only one) is 0.0.7's cycles."""
    laid_out = [[(a.i, a.j) for a in cycle] for cycle in clock_order(forward_only(m, n).workers, n)]
    assert laid_out == list(clock_cycles(m, n))


def test_clock_cycles() -> None:
    assert list(clock_cycles(1, 1)) == [[(0, 0)]]
    assert list(clock_cycles(3, 2)) == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    for m in range(1, 6):
        for n in range(1, 6):
            cycles = list(clock_cycles(m, n))
            assert len(cycles) == m + n - 1
            tasks = [task for cycle in cycles for task in cycle]
            assert sorted(tasks) == [(i, j) for i in range(m) for j in range(n)]
            for k, cycle in enumerate(cycles):
                assert all(i + j == k for i, j in cycle)

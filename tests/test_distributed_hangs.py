"""No rank left waiting: a rank that stops answering, or runs another step, ends every rank.

A rank stopped mid-step (SIGSTOP: a hung layer, a paused machine) ends the
others within their step timeout, each naming the rank, its partition, and
the message it waited for. Ranks given different mini-batches, chunks or
schedules all refuse the step before any of its messages, and train on
once they agree.
"""
import os
import re
import signal
import time
from datetime import timedelta
from typing import Any, Dict, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from test_distributed import FEATURES
from test_distributed_pipe import CHUNKS, Fault, batch
from torchgpipe.distributed import DistributedGPipe, StepTimeout

pytestmark = pytest.mark.timeout(120)

TIMEOUT = 3.0


def stopped_mid_step(rank: int, world_size: int) -> Dict[str, Any]:
    """Rank 1 of 3 stops in the second step's second micro-batch; the others wait for it."""
    # A store of rank 0's, beside the group: rank 2 says there that it timed
    # out, and only then does rank 0 end rank 1, however late rank 2 runs.
    store = dist.TCPStore('127.0.0.1', 0, None, True, wait_for_workers=False) \
        if rank == 0 else None
    pids: List[Any] = [None] * world_size
    dist.all_gather_object(pids, (os.getpid(), store.port if store else None))
    if store is None:
        store = dist.TCPStore('127.0.0.1', pids[0][1], None, False, wait_for_workers=False)
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(3):
        layers += [nn.Linear(FEATURES, FEATURES).double(), Fault(1, CHUNKS + 1, 'stop')]
    pipe = DistributedGPipe(nn.Sequential(*layers), [2, 2, 2], chunks=CHUNKS,
                            checkpoint='never')
    # The first step, whole, without a step timeout: with its one-time costs,
    # on a loaded machine of two cores, it has taken longer than TIMEOUT.
    pipe.train_step(*batch(0), F.mse_loss)
    pipe.timeout = TIMEOUT  # read by every step
    start = time.monotonic()
    try:
        pipe.train_step(*batch(1), F.mse_loss)
    except StepTimeout as exc:
        result = {'error': str(exc), 'seconds': time.monotonic() - start}
    if rank == 2:
        store.set('rank 2 timed out', '')
    if rank == 0:
        # Rank 2 times out too, before rank 1 is gone (a closed connection
        # would end its wait otherwise): a fixed sleep here was a race.
        store.wait(['rank 2 timed out'], timedelta(seconds=60))
        os.kill(pids[1][0], signal.SIGKILL)
    return result


def test_a_stopped_rank_ends_every_other_within_the_step_timeout() -> None:
    first, stopped, last = run_distributed(stopped_mid_step, world_size=3, timeout=90, dies=[1])
    assert stopped is None
    # Rank 0 waits for the gradient of a micro-batch; rank 2 for the input of
    # micro-batch 1, which rank 1 never sends, or of micro-batch 0, which it
    # sent but gloo's threads had not delivered when it stopped (on a loaded
    # machine); or both for the start of the step, if rank 1 stopped before
    # gloo's threads had sent its first word. Every one is a correct outcome.
    for result, waited in ((first, r'the gradient of the output of micro-batch \d \(action '
                                    r'0B\d, or 0I\d\)'),
                           (last, r'the input of micro-batch (?P<i>[01]) \(action '
                                  r'2F(?P=i)\)')):
        assert re.fullmatch(
            r'rank 1 \(partition 1\) did not answer within the step timeout \(3 s\), while '
            rf'this rank was waiting for ({waited}|the start of the step): it is stopped, '
            r'stuck, or far behind', result['error']), result
    # Not a timing claim: a bound far above the timeout, far below the group's.
    assert first['seconds'] < 10 * TIMEOUT and last['seconds'] < 10 * TIMEOUT


def disagreeing(rank: int, world_size: int) -> List[str]:
    """Steps that the two ranks are called for differently; then one they agree on."""
    errors = []
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Linear(FEATURES, FEATURES)).double()
    pipe = DistributedGPipe(model, [1, 1], chunks=CHUNKS)
    input, target = batch(0)
    calls = [
        lambda: pipe.train_step(input[:12] if rank else input, target[:12] if rank else target,
                                F.mse_loss),
        lambda: pipe.train_step(input, target, F.mse_loss,
                                schedule='fill_drain' if rank else '1f1b'),
        lambda: pipe.eval_step(input, everywhere=rank == 1),
    ]
    for call in calls:
        try:
            call()
        except ValueError as exc:
            errors.append(str(exc))
    pipe.train_step(input, target, F.mse_loss)  # the pipeline is whole
    return errors


def test_ranks_called_for_different_steps_refuse_them_and_train_on() -> None:
    ranks = run_distributed(disagreeing, timeout=60)
    assert ranks[0] == ranks[1]
    sizes, schedules, evaluations = ranks[0]
    assert sizes.startswith("the ranks of the pipeline run different steps (rank 0: {'step': "
                            "'train_step', 'micro-batches': [4, 4, 4, 4], 'schedule': '1f1b ")
    assert "rank 1: {'step': 'train_step', 'micro-batches': [3, 3, 3, 3]" in sizes
    assert sizes.endswith('give every rank the same mini-batch, chunks and schedule')
    assert "'schedule': 'fill_drain (" in schedules and "'schedule': '1f1b (" in schedules
    assert "'everywhere': False" in evaluations and "'everywhere': True" in evaluations

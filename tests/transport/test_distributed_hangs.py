"""No rank left waiting: a rank that stops answering, or runs another step, ends every rank.

A rank stopped mid-step (SIGSTOP: a hung layer, a paused machine) ends the
others within their step timeout, each naming the rank, its partition, and
the message it waited for; a rank that waited for another, itself waiting
for the stopped one, names the stopped one too, wherever it stands in the
pipeline, in a forward or a backward pass, under every schedule. Ranks
given different mini-batches, chunks or schedules, or no data where it is
needed, or that one rank refuses (its data, its arguments, a layer that
cannot run in its mode, a layer left on the meta device), all refuse the step
before any of its messages,
and train on once they agree; ranks that would lay out the layers
differently, or of which one cannot build the pipeline, all refuse to build it. A
rank that fails is named as failed, not lost, when its connection closes after its word.
"""
import copy
import os
import re
import signal
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import OnBackward
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from test_distributed import FEATURES
from test_distributed_pipe import CHUNKS, Fault, batch
from test_distributed_pipe import model as model_named
from torchgpipe import to_sequential
from torchgpipe.distributed import DistributedGPipe, PeerFailed, StepTimeout
from torchgpipe.engine.generators import check_schedule
from torchgpipe.engine.step import split_given, weighted
from torchgpipe.foundation.validation import check_balance, check_chunks
from torchgpipe.transport.channels import Received
from torchgpipe.transport.faults import Disconnected, TimedOut
from torchgpipe.transport.wire import Wire

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]

TIMEOUT = 3.0
# For the many stops of test_every_rank_names_the_stopped_one: each costs
# the timeout and its grace, with steps of a few milliseconds to time out.
SHORT = 1.5


def warm_up(world_size: int) -> None:
    """A process's first step takes seconds on a loaded machine (first calls,
    first connections): taken without a timeout."""
    torch.manual_seed(0)
    layers = [nn.Linear(FEATURES, FEATURES).double() for _ in range(world_size)]
    DistributedGPipe(nn.Sequential(*layers), [1] * world_size, chunks=CHUNKS).train_step(
        *batch(0), F.mse_loss)


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


def stop() -> None:
    os.kill(os.getpid(), signal.SIGSTOP)



class Stop(nn.Module):
    """Once armed, stops rank ``rank`` (SIGSTOP) in the forward or the backward
    pass of its second micro-batch; the identity elsewhere."""

    def __init__(self, rank: int, direction: str) -> None:
        super().__init__()
        self.rank, self.direction = rank, direction
        self.armed = False
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        if not self.armed or dist.get_rank() != self.rank:
            return x
        self.calls += 1
        if self.calls != 2:
            return x
        if self.direction == 'forward':
            stop()
            return x
        return OnBackward.apply(x, stop)


#: A case: the rank stopped, the pass it stops in, the schedule.
Case = Tuple[int, str, str]
SCHEDULES = ['fill_drain', '1f1b', 'zb_h1']
# Every position in both passes, the schedule turning with the case, on 3
# ranks (first, middle and last, each waited for directly by a neighbour and
# through it by the rank beyond) and on 4, where the waiting may pass through
# two ranks before reaching the stopped one. The turns are offset so that,
# over both, every schedule meets the stop at an end and in the middle, in a
# forward and in a backward pass.
THREE: List[Case] = [(r, d, SCHEDULES[(2 * r + k + 1) % 3]) for r in range(3)
                     for k, d in enumerate(('forward', 'backward'))]
FOUR: List[Case] = [(r, d, SCHEDULES[(2 * r + k) % 3]) for r in range(4)
                    for k, d in enumerate(('forward', 'backward'))]


def stopped_anywhere(rank: int, world_size: int, cases: List[Case],
                     ) -> List[Optional[Dict[str, Any]]]:
    """For each case, a fresh pipeline of a layer per rank, whose second step
    stops a rank; returns what each other rank raised, and when.

    The stopped rank is resumed (SIGCONT) once every other has raised, and
    ends its step as it may; then the ranks go on to the next case, with new
    connections (a process group of its own).
    """
    pids: List[Any] = [None] * world_size
    dist.all_gather_object(pids, os.getpid())
    # Made by every rank alike, in the same order, before any stop.
    survivors = [dist.new_group([r for r in range(world_size) if r != s])
                 for s in range(world_size)]
    warm_up(world_size)
    results: List[Optional[Dict[str, Any]]] = []
    for stopped, direction, schedule in cases:
        group = dist.new_group()
        torch.manual_seed(0)
        stops = [Stop(stopped, direction) for _ in range(world_size)]
        layers: List[nn.Module] = []
        for s in stops:
            layers += [nn.Linear(FEATURES, FEATURES).double(), s]
        pipe = DistributedGPipe(nn.Sequential(*layers), [2] * world_size, chunks=CHUNKS,
                                checkpoint='never', group=group)
        # The rank stopped before may still be ending its step.
        dist.barrier()
        # Connects the ranks, without a deadline: on a loaded machine a first
        # step over new connections may take longer than the short timeout.
        pipe.train_step(*batch(0), F.mse_loss, schedule=schedule)
        pipe.timeout = SHORT
        for s in stops:
            s.armed = True
        start = time.monotonic()
        if rank == stopped:
            try:
                pipe.train_step(*batch(1), F.mse_loss, schedule=schedule)
            except Exception:  # resumed: the others are gone
                pass
            results.append(None)
            continue
        try:
            pipe.train_step(*batch(1), F.mse_loss, schedule=schedule)
        except PeerFailed as exc:
            results.append({'type': type(exc).__name__, 'error': str(exc),
                            'rank': getattr(exc, 'rank', None),
                            'seconds': time.monotonic() - start})
        dist.barrier(group=survivors[stopped])  # every other rank has raised
        if rank == min(r for r in range(world_size) if r != stopped):
            os.kill(pids[stopped], signal.SIGCONT)
    return results


def check_blame(cases: List[Case], ranks: List[List[Optional[Dict[str, Any]]]]) -> None:
    """Every other rank raised StepTimeout naming the stopped rank first."""
    wrong = []
    for k, (stopped, direction, schedule) in enumerate(cases):
        for rank, results in enumerate(ranks):
            result = results[k]
            if rank == stopped or result is not None and result['type'] == 'StepTimeout' and \
                    re.fullmatch(
                        rf'rank {stopped} \(partition {stopped}\) did not answer within the '
                        rf'step timeout \({SHORT:g} s\), while this rank was waiting for '
                        r'.+: it is stopped, stuck, or far behind', result['error']) and \
                    result['rank'] == stopped and \
                    result['seconds'] < 10 * SHORT:  # far above the timeout and its grace
                continue
            wrong.append(f'rank {stopped} stopped in a {direction} pass under {schedule}: '
                         f'rank {rank} raised {result}')
    assert not wrong, f'{len(wrong)} of {len(cases) * (len(ranks) - 1)}:\n' + '\n'.join(wrong)


@pytest.mark.timeout(600)
@pytest.mark.parametrize('world_size, cases, groups', [(3, THREE, 2), (4, FOUR, 2)],
                         ids=['3', '4'])
def test_every_rank_names_the_stopped_one(world_size: int, cases: List[Case],
                                          groups: int) -> None:
    # A case mostly waits, for the timeout and its grace: several groups of
    # ranks, each of its own, run their shares of the cases side by side.
    shares = [cases[k::groups] for k in range(groups)]
    with ThreadPoolExecutor(groups) as pool:
        runs = [pool.submit(run_distributed, stopped_anywhere, share, world_size=world_size,
                            timeout=60 + 10 * SHORT * len(share)) for share in shares]
        for share, run in zip(shares, runs):
            check_blame(share, run.result())


class TrainingOnly(nn.Module):
    """Calls a layer in training mode only: captured in evaluation mode, it
    becomes a child with no code for training."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.extra, self.last = (nn.Linear(FEATURES, FEATURES).double()
                                             for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        if self.training:
            h = self.extra(h)
        return self.last(h)


def disagreeing(rank: int, world_size: int) -> Dict[str, Any]:
    """Steps that the two ranks are called for differently, or without the data they
    need, or that one refuses; pipelines they build differently, or that one cannot
    build; then a step they agree on, after each."""
    def refused(attempts: List[Any], then: Any) -> List[str]:
        errors = []
        for attempt in attempts:
            try:
                attempt()
            except Exception as exc:
                errors.append(f'{type(exc).__name__}: {exc}')
            then()  # the pipeline is whole, the ranks in step
        return errors

    def linear(features: int = FEATURES) -> nn.Module:
        return nn.Linear(FEATURES, features).double()

    torch.manual_seed(0)
    model = nn.Sequential(linear(), linear())
    pipe = DistributedGPipe(model, [1, 1], chunks=CHUNKS)
    input, target = batch(0)

    def agreed() -> None:
        pipe.train_step(input, target, F.mse_loss)

    def built() -> None:
        DistributedGPipe(model, [1, 1], chunks=CHUNKS).train_step(input, target, F.mse_loss)

    # Rank 1's own layer on the meta device (rank 0 never places it).
    with torch.device('meta' if rank else 'cpu'):
        half_meta = nn.Sequential(linear(), linear())
    half_meta[0] = model[0]
    # A child captured in evaluation mode, on rank 0, asked to train.
    torch.manual_seed(0)  # the same on both ranks (layers on the meta device draw nothing)
    captured = TrainingOnly()
    unwrapped = copy.deepcopy(captured).eval()
    F.mse_loss(unwrapped(input), target).backward()
    pipe_of_captured = DistributedGPipe(
        to_sequential(captured.eval(), example_inputs=input[:2]), [1, 1], chunks=CHUNKS)

    def train_captured() -> None:
        pipe_of_captured.train().train_step(input, target, F.mse_loss)

    def captured_in_its_mode() -> Dict[str, Any]:
        """Nothing changed by the refused step; then a step in evaluation mode, as the
        unwrapped model's: the names of the parameters here whose gradients are its."""
        untouched = all(p.grad is None for p in captured.parameters())
        pipe_of_captured.eval().train_step(input, target, F.mse_loss)
        return {'untouched': untouched, 'as unwrapped': sorted(
            name for name, p in captured.named_parameters() if p.grad is not None and
            torch.allclose(p.grad, unwrapped.get_parameter(name).grad, rtol=1e-12))}

    def wire_fails() -> bool:
        """A step whose wire cannot be built refused; True if the gradients of a
        weight tied across the ranks stay as they were."""
        tied = DistributedGPipe(model_named('tied'), [3, 3], chunks=CHUNKS)
        tied.train_step(input, target, F.mse_loss)
        before = [p.grad.clone() for p in tied.parameters() if p.grad is not None]
        with mock.patch('torchgpipe.processes.core.Wire', side_effect=OSError('no wire')):
            with pytest.raises(OSError):
                tied.train_step(input, target, F.mse_loss)
        after = [p.grad for p in tied.parameters() if p.grad is not None]
        return len(after) == len(before) and all(map(torch.equal, after, before))
    return {
        'gradients kept': wire_fails(),
        'steps': refused([
            lambda: pipe.train_step(input[:12] if rank else input,
                                    target[:12] if rank else target, F.mse_loss),
            lambda: pipe.train_step(input, target, F.mse_loss,
                                    schedule='fill_drain' if rank else '1f1b'),
            lambda: pipe.eval_step(input, everywhere=rank == 1),
            # One schedule spelled two ways: its label agrees, no error.
            lambda: pipe.train_step(input, target, F.mse_loss,
                                    schedule='ZB-H1' if rank else 'zb_h1'),
        ], agreed),
        # Rank 0 holds the first partition, rank 1 the last.
        'data': refused([
            lambda: pipe.train_step(input if rank else None, target, F.mse_loss),
            lambda: pipe.train_step(input, None if rank else target, F.mse_loss),
            lambda: pipe.eval_step(input, None if rank else target, F.mse_loss),
        ], agreed),
        # One rank's own arguments fail; the other is given nothing wrong.
        'one refuses a step': refused([
            lambda: pipe.train_step(None if rank else {'x': input},  # type: ignore[arg-type]
                                    target if rank else None, F.mse_loss),
            lambda: pipe.train_step(input[:0] if rank else input,
                                    target[:0] if rank else target, F.mse_loss),
            lambda: pipe.train_step(input, target, F.mse_loss,
                                    schedule='1f1b' if rank else '0F0 0X0'),
            train_captured,
            # Rank 1 has not materialized its layer.
            lambda: DistributedGPipe(half_meta, [1, 1]).train_step(input, target, F.mse_loss),
        ], agreed),
        'captured': captured_in_its_mode(),  # after train_captured
        'layouts': refused([
            lambda: DistributedGPipe(model, [1, 1], checkpoint='never' if rank else 'always'),
            lambda: DistributedGPipe(nn.Sequential(*(linear() for _ in range(4))),
                                     [1, 3] if rank else [3, 1]),
            lambda: DistributedGPipe(nn.Sequential(*(linear() for _ in range(4))),
                                     [1, 1, 1, 1], placement='v' if rank else 'loop'),
            lambda: DistributedGPipe(nn.Sequential(*(linear() for _ in range(2 + rank))),
                                     [2, 1] if rank else [1, 1]),
            lambda: DistributedGPipe(nn.Sequential(linear(), linear(FEATURES + rank)), [1, 1]),
            lambda: DistributedGPipe(model, [1, 1], deferred_batch_norm=rank == 1),
            lambda: DistributedGPipe(nn.Sequential(linear(), nn.ReLU() if rank else nn.Tanh()),
                                     [1, 1]),
        ], built),
        'one cannot build': refused([
            lambda: DistributedGPipe(nn.Sequential(*(linear() for _ in range(4))),
                                     [3, 2] if rank else [2, 2]),
            lambda: DistributedGPipe(model, [1, 1], chunks=0 if rank else 1),
        ], built),
    }


@pytest.fixture(scope='module')
def disagreements() -> List[Dict[str, Any]]:
    return run_distributed(disagreeing, timeout=60)


def test_ranks_called_for_different_steps_refuse_them_and_train_on(
        disagreements: List[Dict[str, Any]]) -> None:
    assert disagreements[0]['steps'] == disagreements[1]['steps']
    sizes, schedules, evaluations = disagreements[0]['steps']
    assert sizes.startswith("Mismatch: the ranks of the pipeline run different steps (rank "
                            "0: {'step': 'train_step', 'micro-batches': [4, 4, 4, 4], "
                            "'schedule': '1f1b'}")
    assert "rank 1: {'step': 'train_step', 'micro-batches': [3, 3, 3, 3]" in sizes
    assert sizes.endswith('give every rank the same mini-batch, chunks and schedule')
    assert "'schedule': 'fill_drain'" in schedules and "'schedule': '1f1b'" in schedules
    assert "'everywhere': False" in evaluations and "'everywhere': True" in evaluations


def test_a_rank_given_no_data_it_needs_makes_every_rank_refuse_the_step(
        disagreements: List[Dict[str, Any]]) -> None:
    assert disagreements[0]['data'] == disagreements[1]['data']
    fix = ("the first partition's rank needs the input, the last one's the target, and the "
           'others may pass None')
    assert disagreements[0]['data'] == [
        f'Mismatch: rank 0 holds the first partition and needs the input (input: None); '
        f'pass it on rank 0: {fix}'] + [
        f'Mismatch: rank 1 holds the last partition and needs the target (target: None); '
        f'pass it on rank 1: {fix}'] * 2


def test_ranks_that_lay_out_the_layers_differently_all_refuse_to_build(
        disagreements: List[Dict[str, Any]]) -> None:
    assert disagreements[0]['layouts'] == disagreements[1]['layouts']
    fix = ('build the pipeline alike on every rank: the same module, and one balance, '
           'placement, checkpoint and deferred_batch_norm for all (such as plan.kwargs of '
           'torchgpipe.plan(..., group=...), the same on every rank)')
    layer = "['Linear', 'weight ({}, 4) torch.float64', 'bias ({},) torch.float64']"
    assert disagreements[0]['layouts'] == [
        f'Mismatch: the ranks of the pipeline lay out its layers differently ({ranks}); {fix}'
        for ranks in [
            "rank 0: {'checkpoint': 'always'}; rank 1: {'checkpoint': 'never'}",
            "rank 0: {'balance': [3, 1]}; rank 1: {'balance': [1, 3]}",
            "rank 0: {'placement': 'loop'}; rank 1: {'placement': 'v'}",
            "rank 0: {'balance': [1, 1], 'layers': 2}; rank 1: {'balance': [2, 1], 'layers': 3}",
            f"rank 0: {{'layer 1': {layer.format(4, 4)}}}; "
            f"rank 1: {{'layer 1': {layer.format(5, 5)}}}",
            "rank 0: {'deferred_batch_norm': False}; rank 1: {'deferred_batch_norm': True}",
            "rank 0: {'layer 1': ['Tanh']}; rank 1: {'layer 1': ['ReLU']}"]]


def error_of(check: Callable[[], Any]) -> str:
    """What ``check()`` raises, as the ranks report it."""
    with pytest.raises(Exception) as info:
        check()
    return f'{type(info.value).__name__}: {info.value}'


def assert_refused_by(rank: int, own: str, said: str, refusals: List[str]) -> None:
    """``rank`` raised its own error, unchanged; the other rank a Mismatch naming it."""
    assert refusals[rank] == own
    assert refusals[1 - rank] == f'Mismatch: rank {rank} cannot {said}: {own}'


def test_a_rank_that_refuses_a_step_makes_every_rank_refuse_it(
        disagreements: List[Dict[str, Any]]) -> None:
    input, target = batch(0)
    cpu = torch.device('cpu')
    refusals = list(zip(*(d['one refuses a step'] for d in disagreements)))
    assert len(refusals) == 5
    dictionary, empty, schedule, captured, on_meta = refusals
    assert_refused_by(0, error_of(lambda: split_given({'x': input}, None, CHUNKS, cpu)),
                      'run the step', list(dictionary))
    assert_refused_by(1, error_of(lambda: weighted([0] * CHUNKS, 'mean')), 'run the step',
                      list(empty))
    assert_refused_by(0, error_of(lambda: check_schedule('0F0 0X0')), 'run the step',
                      list(schedule))
    assert re.fullmatch(r'RuntimeError: this part of the sequential was captured in evaluation '
                        r'mode and cannot run in training mode: .*', captured[0])
    assert_refused_by(0, captured[0], 'run the step', list(captured))
    assert_refused_by(1, "ValueError: the layers must hold data to run a step ('1.weight' on "
                      "the meta device); materialize this rank's layers first: "
                      'pipe.to_empty(), then initialize them (reset_parameters(), or load a '
                      'state dict or a DCP checkpoint)', 'run the step', list(on_meta))


def test_a_refused_step_of_a_captured_child_leaves_the_pipeline_whole(
        disagreements: List[Dict[str, Any]]) -> None:
    # Rank 0 holds the generated child of 'first', rank 1 'last'.
    assert [d['captured'] for d in disagreements] == [
        {'untouched': True, 'as unwrapped': [f'{layer}.{name}' for name in ('bias', 'weight')]}
        for layer in ('first', 'last')]


def test_a_step_whose_wire_fails_keeps_the_gradients_of_tied_weights(
        disagreements: List[Dict[str, Any]]) -> None:
    assert [d['gradients kept'] for d in disagreements] == [True, True]


def test_a_rank_that_cannot_build_the_pipeline_makes_every_rank_refuse(
        disagreements: List[Dict[str, Any]]) -> None:
    def linear() -> nn.Module:
        return nn.Linear(FEATURES, FEATURES)
    balance, chunks = zip(*(d['one cannot build'] for d in disagreements))
    assert_refused_by(1, error_of(lambda: check_balance(
        nn.Sequential(*(linear() for _ in range(4))), [3, 2])), 'build the pipeline',
        list(balance))
    assert_refused_by(1, error_of(lambda: check_chunks(0)), 'build the pipeline',
                      list(chunks))


class ScriptedChannels:
    """Channels of rank 1 whose words from rank 0 the watchers report in the order
    ``events`` gives, as their threads may: the word rank 0 sent before its connection
    broke, after the break. A wait for tensors breaks; one for a word's send ends."""

    device = torch.device('cpu')

    def __init__(self, events: List[Tuple[str, int, Any]]) -> None:
        self.events = events
        self.sends: List[Received] = []
        self.waited: List[Received] = []

    def expects_word(self, rank: int) -> bool:
        return any(kind == 'word' and source == rank for kind, source, _ in self.events)

    def next_event(self, until: Optional[float]) -> Tuple[str, int, Any]:
        if not self.events:
            raise TimedOut('nothing by the deadline')
        return self.events.pop(0)

    def send_word(self, rank: int, word: Any) -> Received:
        self.sends.append(Received([], [mock.Mock()]))
        return self.sends[-1]

    def wait(self, received: Received, until: Optional[float], words: bool = False) -> None:
        if received not in self.sends:
            raise Disconnected('reset')
        self.waited.append(received)

    def post_words(self, rank: int, n: int) -> None:
        pass


FAILURE = {'error': 'Boom: boom in forward', 'rank': 0}


@pytest.mark.parametrize('reported', [['word', 'lost'], ['lost', 'word']])
def test_a_rank_that_failed_is_named_even_if_its_break_is_reported_first(
        reported: List[str]) -> None:
    events = {'word': ('word', 0, FAILURE), 'lost': ('lost', 0, RuntimeError('reset'))}
    channels = ScriptedChannels([events[kind] for kind in reported])
    wire = Wire(channels, [0, 1], 1, {}, OrderedDict(), TIMEOUT)  # type: ignore[arg-type]
    with pytest.raises(PeerFailed, match=re.escape('rank 0 (partition 0) failed: Boom: ')):
        wire.wait(Received([], [mock.Mock()]), 0, 0, 'waiting for the input of micro-batch 0')


def test_a_rank_stopped_by_another_ones_failure_names_it_as_the_one_at_fault() -> None:
    """Rank 0 stopped because rank 2 failed: rank 1, waiting for rank 0, says so."""
    told = {'error': 'PeerFailed: rank 2 (partition 2) failed: Boom: boom in forward', 'rank': 2}
    channels = ScriptedChannels([('lost', 0, RuntimeError('reset')), ('word', 0, told)])
    wire = Wire(channels, [0, 1, 2], 1, {}, OrderedDict(), TIMEOUT)  # type: ignore[arg-type]
    with pytest.raises(PeerFailed, match=re.escape(
            'rank 0 (partition 0) stopped, as another rank failed: PeerFailed: rank 2 '
            '(partition 2) failed: Boom: ')) as raised:
        wire.wait(Received([], [mock.Mock()]), 0, 0, 'waiting for the input of micro-batch 0')
    assert raised.value.rank == 2


def test_a_connection_closed_by_a_timed_out_wait_blames_whom_its_rank_waited_for() -> None:
    """Rank 0's wait for rank 2 timed out, which closed its connection to rank 1."""
    channels = ScriptedChannels([('word', 0, {'waiting': [2, 2]})])
    wire = Wire(channels, [0, 1, 2], 1, {}, OrderedDict(), TIMEOUT)  # type: ignore[arg-type]
    with pytest.raises(StepTimeout, match=re.escape(
            'rank 2 (partition 2) did not answer within the step timeout (3 s), while this '
            'rank was waiting for the input of micro-batch 0 from rank 0 (partition 0), '
            'which was waiting for rank 2 (partition 2)')):
        wire.wait(Received([], [mock.Mock()]), 0, 0, 'waiting for the input of micro-batch 0')


def test_a_chain_of_waiting_ranks_names_the_failure_reported_after_its_break() -> None:
    """Rank 1 follows rank 0's word to rank 2, whose failure word is reported after its break."""
    channels = ScriptedChannels([('word', 0, {'waiting': [2, 2]}),
                                 ('lost', 2, RuntimeError('reset')),
                                 ('word', 2, {'error': 'Boom: boom in forward', 'rank': 2})])
    wire = Wire(channels, [0, 1, 2], 1, {}, OrderedDict(), TIMEOUT)  # type: ignore[arg-type]
    with pytest.raises(PeerFailed, match=re.escape('rank 2 (partition 2) failed, while this ')):
        wire.wait(Received([], [mock.Mock()]), 0, 0, 'waiting for the input of micro-batch 0')


def test_a_rank_that_fails_returns_once_the_others_took_its_word() -> None:
    """Its connections close next: a word not yet taken would be lost with them."""
    channels = ScriptedChannels([])
    wire = Wire(channels, [0, 1], 0, {}, OrderedDict(), TIMEOUT)  # type: ignore[arg-type]
    wire.fail(RuntimeError('boom'))
    assert channels.waited == channels.sends

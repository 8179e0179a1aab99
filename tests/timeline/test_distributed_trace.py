"""torchgpipe.trace on a DistributedGPipe: one timeline of every rank, on every rank.

Each rank traces one training step of every built-in schedule, on 2 ranks
and on 3, of a model whose skips cross ranks. The file one rank saves must
hold, for each rank, exactly the tasks that rank's partitions run in the
schedule (each action, and the recomputation of each checkpointed
micro-batch), every message between ranks as a flow from its sender to its
receiver, and be what every other rank's timeline gives too.
"""
from collections import Counter
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
import torch.nn.functional as F
from torch import nn

import torchgpipe
import torchgpipe.distributed
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from test_distributed_pipe import CHUNKS, Config, batch, model, pipeline
from torchgpipe.engine.generators import expected_bubble, resolve
from torchgpipe.engine.schedule import Kind, notation
from torchgpipe.skip.layout import inspect_skip_layout

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

# The skips of unet cross ranks in every layout below.
CONFIGS = {
    2: [Config('unet', (5, 5), s, 'except_last') for s in ('fill_drain', '1f1b', 'zb_h1')] + [
        Config('unet', (3, 2, 2, 3), 'interleaved_1f1b', 'except_last'),
        Config('unet', (3, 2, 2, 3), 'zbv', 'except_last', 'v')],
    3: [Config('unet', (3, 2, 5), s, 'except_last') for s in ('fill_drain', '1f1b', 'zb_h1')] + [
        Config('unet', (2, 2, 2, 1, 1, 2), 'interleaved_1f1b', 'except_last'),
        Config('unet', (2, 2, 2, 1, 1, 2), 'zbv', 'except_last', 'v')],
}
COMPUTE = ('forward', 'recompute', 'backward', 'input', 'weight')


def trace_steps(rank: int, world_size: int, folder: str) -> Dict[str, Any]:
    """A traced training step of each configuration; rank 0 saves each file."""
    results = {}
    for config in CONFIGS[world_size]:
        pipe = pipeline(config)
        with torchgpipe.trace(pipe) as timeline:
            pipe.train_step(*batch(0), F.mse_loss, schedule=config.schedule)
        if rank == 0:
            timeline.save(Path(folder) / f'{config.id}.json')
            if config.schedule == 'zbv':  # a chart too: every kind of event has a colour
                timeline.plot(Path(folder) / f'{config.id}.png')
        summary = timeline.summary()
        results[config.id] = {'trace': timeline.chrome_trace(),
                              'devices': [d.device for d in summary.devices],
                              'busy': [d.busy for d in summary.devices],
                              'formula': summary.formula, 'partitions': summary.partitions}
    return results


def expected_tasks(config: Config, world_size: int) -> Dict[int, Counter[str]]:
    """What each rank runs in a step: its partitions' actions, and their recomputations."""
    n = len(config.balance)
    ranks = config.ranks(world_size)
    schedule = resolve(config.schedule, CHUNKS, n, ranks)
    tasks: Dict[int, Counter[str]] = {r: Counter() for r in range(world_size)}
    for actions in schedule.workers:
        for a in actions:
            tasks[ranks[a.j]][str(a)] += 1
            # 'except_last': every micro-batch but the last is recomputed by its B or I.
            if a.kind in (Kind.B, Kind.I) and a.i < CHUNKS - 1:
                tasks[ranks[a.j]][notation(a.j, "F'", a.i)] += 1
    return tasks


def crossing_messages(config: Config, world_size: int) -> int:
    """The messages between ranks in a step: both ways across each boundary and skip."""
    ranks = config.ranks(world_size)
    children = list(model(config.model).children())
    partitions, start = [], 0
    for size in config.balance:
        partitions.append(nn.Sequential(*children[start:start + size]))
        start += size
    routes = inspect_skip_layout(partitions).by_ns_name.values()
    crossings = sum(ranks[j - 1] != ranks[j] for j in range(1, len(ranks)))
    crossings += sum(ranks[a] != ranks[b] for a, b in routes)
    return 2 * CHUNKS * crossings


@pytest.mark.parametrize('world_size', [2, 3])
def test_one_file_holds_what_every_rank_ran(world_size: int, tmp_path: Path) -> None:
    results = run_distributed(trace_steps, str(tmp_path), world_size=world_size)
    for config in CONFIGS[world_size]:
        saved = json.loads((tmp_path / f'{config.id}.json').read_text())
        # Every rank's timeline is the whole pipeline's: the same trace.
        for result in results:
            assert result[config.id]['trace'] == saved, config.id
        events = saved['traceEvents']
        names = {e['pid']: e['args']['name'] for e in events if e['name'] == 'process_name'}
        assert names == {r: f'rank {r}' for r in range(world_size)}

        ran: Dict[int, Counter[str]] = {r: Counter() for r in range(world_size)}
        for e in events:
            if e['ph'] == 'X' and e['cat'] in COMPUTE:
                assert e['args']['rank'] == e['pid']
                ran[e['pid']][e['name']] += 1
        assert ran == expected_tasks(config, world_size), config.id

        slices = {(e['pid'], e['args']['detail']): e for e in events
                  if e['ph'] == 'X' and e['cat'] in ('send', 'receive')}
        starts = [e for e in events if e['ph'] == 's']
        ends = {e['id']: e for e in events if e['ph'] == 'f'}
        assert len(starts) == len(ends) == crossing_messages(config, world_size), config.id
        ranks = config.ranks(world_size)
        for start in starts:
            end = ends[start['id']]
            # "... partition a to b": from a's rank to b's.
            a, b = (int(j) for j in start['name'].rsplit('partition ', 1)[1].split(' to '))
            assert (start['pid'], end['pid']) == (ranks[a], ranks[b]), start['name']
            assert slices[ranks[a], start['name']]['cat'] == 'send'
            assert slices[ranks[b], start['name']]['cat'] == 'receive'

        result = results[0][config.id]
        assert result['devices'] == [f'rank {r}' for r in range(world_size)]
        assert all(busy > 0 for busy in result['busy'])
        assert result['partitions'] == len(config.balance)
        schedule = resolve(config.schedule, CHUNKS, len(config.balance), ranks)
        assert result['formula'] == expected_bubble(schedule, len(config.balance))[0]
    assert (tmp_path / f'{CONFIGS[world_size][-1].id}.png').stat().st_size > 0


def broken_loss(output: Any, target: Any) -> Any:
    raise ZeroDivisionError('a loss that fails')


def trace_failing_step(rank: int, world_size: int) -> List[str]:
    """A step that fails (the loss, on the last rank) inside a trace."""
    config = CONFIGS[2][1]
    pipe = pipeline(config)
    # The last rank raises the loss's error; the others PeerFailed.
    with pytest.raises(ZeroDivisionError if rank == 1 else torchgpipe.distributed.PeerFailed):
        with torchgpipe.trace(pipe) as timeline:
            pipe.train_step(*batch(0), broken_loss, schedule=config.schedule)
    return sorted({str(e.rank) for e in timeline.events})


def test_a_failed_step_leaves_each_rank_its_own_events() -> None:
    # Ranks exchange nothing after a failure: each rank's timeline is its own.
    assert run_distributed(trace_failing_step) == [['0'], ['1']]

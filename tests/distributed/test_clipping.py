"""clip_grad_norm_ of GPipe and DistributedGPipe: the unwrapped model's clipping, on every path.

One process: on both execution paths and after every schedule, the norm
and the clipped gradients are torch's on the unwrapped model. Across
processes: every rank returns the same norm, bit for bit that of
:func:`torch.nn.utils.clip_grad_norm_` over the gradients of every rank
put together in the unwrapped model's order (a weight tied across ranks
counted once), and scales its gradients as torch scales them; under DDP,
the norm of the averaged gradients.
"""
import math
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

import torchgpipe.distributed
from helpers import cpu_devices
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from test_distributed import TOLERANCE
from test_distributed_pipe import BATCH, CHUNKS, Config, batch, model
from torchgpipe import GPipe
from torchgpipe.distributed import DistributedGPipe
from torchgpipe.processes.tied import total_norm

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

NORM_TYPES = [2.0, 1.0, math.inf]
#: Far below every norm of these gradients (all clipped), and far above (none).
MAX_NORMS = [1e-3, 1e3]
SCHEDULES = ['fill_drain', '1f1b', 'zb_h1', 'interleaved_1f1b', 'zbv']


def layout(schedule: str, threaded: bool) -> Tuple[List[int], List[str]]:
    """The tied model's balance and devices for ``schedule``: two workers, four partitions
    where the schedule has several per worker (in a loop, or in a V for ZBV)."""
    if schedule not in ('interleaved_1f1b', 'zbv'):
        return [3, 3], cpu_devices(2, threaded)
    workers = [0, 1, 0, 1] if schedule == 'interleaved_1f1b' else [0, 1, 1, 0]
    return [2, 1, 1, 2], [f'cpu:{w}' if threaded else 'cpu' for w in workers]


def torch_clipped(grads: List[Optional[Tensor]], max_norm: float,
                  norm_type: float) -> Tuple[Tensor, List[Optional[Tensor]]]:
    """What torch.nn.utils.clip_grad_norm_ gives parameters with these gradients."""
    parameters = []
    for grad in grads:
        p = nn.Parameter(torch.zeros(()) if grad is None else torch.zeros_like(grad))
        p.grad = None if grad is None else grad.clone()
        parameters.append(p)
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)
    return norm, [p.grad for p in parameters]


@pytest.mark.parametrize('max_norm', MAX_NORMS)
@pytest.mark.parametrize('norm_type', NORM_TYPES, ids=['2', '1', 'inf'])
@pytest.mark.parametrize('schedule', SCHEDULES)
def test_clipping_a_pipeline_is_clipping_the_unwrapped_model(
        threaded: bool, schedule: str, norm_type: float, max_norm: float) -> None:
    balance, devices = layout(schedule, threaded)
    plain = model('tied')
    gpipe = GPipe(model('tied'), balance, devices=devices, chunks=CHUNKS)
    input, target = batch(0)
    F.mse_loss(plain(input), target).backward()
    gpipe.train_step(input, target, F.mse_loss, schedule=schedule)

    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
    # The gradients before clipping, given to torch's own function: the very same norm.
    same, _ = torch_clipped([p.grad for p in gpipe.parameters()], max_norm, norm_type)
    actual = gpipe.clip_grad_norm_(max_norm, norm_type)
    assert torch.equal(actual, same)
    torch.testing.assert_close(actual, expected, **TOLERANCE)
    assert (actual > max_norm) == (max_norm < 1)  # clipped, or not, as the test means
    # The tied weight is one parameter: clipped once, like the unwrapped model's.
    named = dict(gpipe.named_parameters())
    for name, p in plain.named_parameters():
        torch.testing.assert_close(named[f'partitions.{gpipe_index(balance, name)}'].grad,
                                   p.grad, **TOLERANCE)


def gpipe_index(balance: List[int], name: str) -> str:
    """``'4.weight'`` of the unwrapped model as ``'<partition>.4.weight'`` in a GPipe."""
    layer = int(name.split('.')[0])
    j = next(j for j in range(len(balance)) if layer < sum(balance[:j + 1]))
    return f'{j}.{name}'


def test_a_non_finite_norm_is_torchs(threaded: bool) -> None:
    gpipe = GPipe(model('tied'), [3, 3], devices=cpu_devices(2, threaded), chunks=CHUNKS)
    gpipe.train_step(*batch(0), F.mse_loss)
    gpipe[2].weight.grad[0, 0] = math.inf
    with pytest.raises(RuntimeError, match='non-finite'):
        gpipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    assert gpipe[2].weight.grad[0, 0] == math.inf  # nothing clipped
    before = [p.grad.clone() for p in gpipe.parameters()]
    expected_norm, expected = torch_clipped(before, 1.0, 2.0)
    assert gpipe.clip_grad_norm_(1.0).isinf() and expected_norm.isinf()
    for p, e in zip(gpipe.parameters(), expected):
        torch.testing.assert_close(p.grad, e, equal_nan=True, rtol=0, atol=0)


# --- across processes ------------------------------------------------------------------

CONFIGS = [
    Config('tied', (3, 3), '1f1b', 'except_last'),                    # tied across ranks
    Config('mlp', (3, 2), 'zb_h1', 'always'),
    Config('tied', (2, 1, 1, 2), 'interleaved_1f1b', 'never'),        # 2 partitions per rank
    Config('tied', (2, 1, 1, 2), 'zbv', 'except_last', 'v'),          # tied within rank 0
]
CASES = [(c, n, m) for c in CONFIGS for n in NORM_TYPES for m in MAX_NORMS]


def case_id(config: Config, norm_type: float, max_norm: float) -> str:
    return f'{config.id}-{norm_type}-{max_norm}'


def grads_by_name(module: nn.Module) -> Dict[str, Optional[List[Any]]]:
    return {name: None if p.grad is None else p.grad.tolist()
            for name, p in module.named_parameters()}


def clip_on_ranks(rank: int, world_size: int) -> Dict[str, Any]:
    results: Dict[str, Any] = {}
    for config, norm_type, max_norm in CASES:
        pipe = DistributedGPipe(model(config.model), config.balance, chunks=CHUNKS,
                                checkpoint=config.checkpoint, placement=config.placement)
        pipe.train_step(*batch(0), F.mse_loss, schedule=config.schedule)
        before = grads_by_name(pipe)
        norm = pipe.clip_grad_norm_(max_norm, norm_type)
        results[case_id(config, norm_type, max_norm)] = (before, norm.item(),
                                                         grads_by_name(pipe))
    # A non-finite gradient on rank 1 only: every rank raises, or scales by it.
    pipe = DistributedGPipe(model('tied'), [3, 3], chunks=CHUNKS)
    pipe.train_step(*batch(0), F.mse_loss)
    if rank == 1:
        dict(pipe.named_parameters())['4.weight'].grad[0, 0] = math.inf
    raised = ''
    try:
        pipe.clip_grad_norm_(1.0, error_if_nonfinite=True)
    except RuntimeError as exc:
        raised = str(exc)
    results['nonfinite'] = (raised, grads_by_name(pipe), pipe.clip_grad_norm_(1.0).item(),
                            grads_by_name(pipe))
    # Gradients of several dtypes, each rank alone: stacked as torch stacks them.
    alone = [dist.new_group([r]) for r in range(world_size)][rank]
    gen = torch.Generator().manual_seed(rank)
    grads = [torch.randn(5, generator=gen, dtype=dtype)
             for dtype in (torch.float32, torch.float64, torch.float32, torch.bfloat16)]
    results['dtypes'] = [(total_norm(list(enumerate(grads)), len(grads), p, torch.device('cpu'),
                                     alone).item(),
                          torch_clipped(list(grads), 1.0, p)[0].item()) for p in NORM_TYPES]
    return results


@pytest.fixture(scope='module')
def clipped_on_ranks() -> List[Dict[str, Any]]:
    return run_distributed(clip_on_ranks, timeout=150)


def slot_names(config: Config) -> Dict[str, str]:
    """Each name of a parameter of the unwrapped model, and the name it is counted under."""
    named = list(model(config.model).named_parameters(remove_duplicate=False))
    first = {id(p): name for name, p in reversed(named)}
    return {name: first[id(p)] for name, p in named}


def assert_clipped_as_torch(ranks: List[Tuple[Any, ...]], names: Dict[str, str],
                            max_norm: float, norm_type: float) -> float:
    """The ranks' norms are one value, torch's over their gradients put together, and
    each rank's gradients are torch's clipped ones; returns the norm."""
    before: Dict[str, Any] = {}
    for grads, *_ in ranks:
        before.update(grads)
    order = list(dict.fromkeys(names.values()))
    grads = [None if before[n] is None else torch.tensor(before[n], dtype=torch.float64)
             for n in order]
    expected_norm, expected = torch_clipped(grads, max_norm, norm_type)
    norms = [norm for _, norm, _ in ranks]
    assert norms == [norms[0]] * len(ranks)
    assert math.isclose(norms[0], expected_norm.item(), rel_tol=0, abs_tol=0) or \
        (math.isnan(norms[0]) and math.isnan(expected_norm.item()))
    for _, _, after in ranks:
        for name, grad in after.items():
            e = expected[order.index(names[name])]
            assert (grad is None) == (e is None), name
            if e is not None:
                torch.testing.assert_close(torch.tensor(grad, dtype=torch.float64), e,
                                           rtol=0, atol=0, equal_nan=True,
                                           msg=lambda m, name=name: f'{name}: {m}')
    return norms[0]


@pytest.mark.parametrize('config, norm_type, max_norm', CASES,
                         ids=[case_id(*case) for case in CASES])
def test_every_rank_clips_by_the_norm_of_the_whole_model(
        clipped_on_ranks: List[Dict[str, Any]], config: Config, norm_type: float,
        max_norm: float) -> None:
    ranks = [r[case_id(config, norm_type, max_norm)] for r in clipped_on_ranks]
    norm = assert_clipped_as_torch(ranks, slot_names(config), max_norm, norm_type)
    plain = model(config.model)
    F.mse_loss(plain(batch(0)[0]), batch(0)[1]).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), max_norm, norm_type)
    assert math.isclose(norm, expected.item(), rel_tol=1e-10)
    assert (norm > max_norm) == (max_norm < 1)


def test_a_non_finite_norm_on_one_rank_is_every_ranks(
        clipped_on_ranks: List[Dict[str, Any]]) -> None:
    raised = [r['nonfinite'][0] for r in clipped_on_ranks]
    assert all('non-finite' in message or 'inf' in message for message in raised), raised
    assert all(message for message in raised)
    # Raising clipped nothing: the gradients are those the step gave.
    ranks = [r['nonfinite'][1:] for r in clipped_on_ranks]
    assert math.isinf(assert_clipped_as_torch(ranks, slot_names(CONFIGS[0]), 1.0, 2.0))


def clip_replicated_pipelines(rank: int, world_size: int) -> Tuple[Any, ...]:
    """Ranks 0-1 and 2-3 are two pipelines of the tied model; 0-2 and 1-3 the replicas."""
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipe = DistributedGPipe(model('tied'), [3, 3], chunks=CHUNKS, group=pipelines[rank // 2])
    ddp = DistributedDataParallel(pipe, process_group=replicas[rank % 2])
    shard = slice((rank // 2) * BATCH, (rank // 2 + 1) * BATCH)
    input, target = batch(0, 2 * BATCH)
    torchgpipe.distributed.train_step(ddp, input[shard], target[shard], F.mse_loss)
    before = grads_by_name(pipe)
    return before, pipe.clip_grad_norm_(1e-3).item(), grads_by_name(pipe)


def test_replicated_pipelines_clip_by_the_norm_of_the_averaged_gradients() -> None:
    ranks = run_distributed(clip_replicated_pipelines, world_size=4, timeout=150)
    names = slot_names(CONFIGS[0])
    norms = [assert_clipped_as_torch(ranks[k:k + 2], names, 1e-3, 2.0) for k in (0, 2)]
    plain = model('tied')
    F.mse_loss(plain(batch(0, 2 * BATCH)[0]), batch(0, 2 * BATCH)[1]).backward()
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e-3).item()
    for norm in norms:
        assert math.isclose(norm, expected, rel_tol=1e-10)


def test_norms_of_several_dtypes_are_stacked_as_torch_stacks_them(
        clipped_on_ranks: List[Dict[str, Any]]) -> None:
    for rank in clipped_on_ranks:
        for ours, torchs in rank['dtypes']:
            assert ours == torchs

"""Loss scaling: the unwrapped model's steps, skipped where its are, on every path.

In one process, torch's own :class:`torch.amp.GradScaler` sees every
partition's gradients. Across processes, :class:`torchgpipe.distributed.GradScaler`
makes every rank skip a step when any rank's gradients hold an infinity:
with one injected on rank 1 only, both ranks skip, halve their scale, and
then step again alike, as the unwrapped model with torch's scaler does.
"""
import math
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import torchgpipe.distributed
from helpers import cpu_devices
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from test_distributed import TOLERANCE
from test_distributed_pipe import CHUNKS, batch, model
from torchgpipe import GPipe
from torchgpipe.distributed import DistributedGPipe

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

STEPS = 4
#: The step whose gradients get an infinity, in the parameter named here.
INFINITE_AT, INFINITE_IN = 1, '4.weight'
MAX_NORM = 0.05


def train(parameters: Dict[str, nn.Parameter], scaler: torch.amp.GradScaler,
          step_fn: Callable[[Tensor, Tensor, Any], None],
          clip: Callable[[], Any]) -> List[Dict[str, Any]]:
    """Steps of SGD under ``scaler``, unscaled and clipped; after each, the parameters
    (under the unwrapped model's names) and the scale.

    ``parameters``: this process's, under every name of the unwrapped model. The
    gradient of ``INFINITE_IN``, where it is here, gets an infinity at
    step ``INFINITE_AT``.
    """
    unique = list({id(p): p for p in parameters.values()}.values())
    optimizer = torch.optim.SGD(unique, lr=0.1, momentum=0.9)
    history = []
    for step in range(STEPS):
        optimizer.zero_grad()
        step_fn(*batch(step), lambda output, target: scaler.scale(F.mse_loss(output, target)))
        if step == INFINITE_AT and INFINITE_IN in parameters:
            parameters[INFINITE_IN].grad[0, 0] = math.inf
        scaler.unscale_(optimizer)
        clip()
        scaler.step(optimizer)
        scaler.update()
        history.append({'scale': scaler.get_scale(),
                        'params': {n: p.tolist() for n, p in parameters.items()}})
    return history


def unwrapped() -> List[Dict[str, Any]]:
    plain = model('tied')

    def step(input: Tensor, target: Tensor, loss_fn: Any) -> None:
        loss_fn(plain(input), target).backward()
    return train(dict(plain.named_parameters(remove_duplicate=False)),
                 scaler(torch.amp.GradScaler), step,
                 lambda: torch.nn.utils.clip_grad_norm_(plain.parameters(), MAX_NORM))


def scaler(kind: Any) -> Any:
    # A power of two: scaling and unscaling are exact, so the steps are the
    # unwrapped model's as without scaling, to rounding.
    return kind('cpu', init_scale=2.0 ** 10, growth_interval=2)


def assert_trains_as_unwrapped(history: List[Dict[str, Any]]) -> None:
    expected = unwrapped()
    assert [h['scale'] for h in expected] == [2.0 ** 10, 2.0 ** 9, 2.0 ** 9, 2.0 ** 10]
    for step, (actual, wanted) in enumerate(zip(history, expected)):
        assert actual['scale'] == wanted['scale'], step
        for name, value in actual['params'].items():
            torch.testing.assert_close(torch.tensor(value), torch.tensor(wanted['params'][name]),
                                       **TOLERANCE, msg=lambda m, n=name: f'{step} {n}: {m}')
    # The step with an infinity was skipped everywhere: nothing changed.
    assert history[INFINITE_AT]['params'] == history[INFINITE_AT - 1]['params']


@pytest.mark.parametrize('schedule', ['1f1b', 'zb_h1', 'fill_drain'])
def test_torchs_scaler_sees_every_partition_in_one_process(threaded: bool,
                                                            schedule: str) -> None:
    gpipe = GPipe(model('tied'), [3, 3], devices=cpu_devices(2, threaded), chunks=CHUNKS)
    parameters = {name.split('.', 2)[2]: p
                  for name, p in gpipe.named_parameters(remove_duplicate=False)}

    def step(input: Tensor, target: Tensor, loss_fn: Any) -> None:
        gpipe.train_step(input, target, loss_fn, schedule=schedule)
    assert_trains_as_unwrapped(train(parameters, scaler(torch.amp.GradScaler), step,
                                     lambda: gpipe.clip_grad_norm_(MAX_NORM)))


def train_on_ranks(rank: int, world_size: int, schedule: str) -> List[Dict[str, Any]]:
    pipe = DistributedGPipe(model('tied'), [3, 3], chunks=CHUNKS)

    def step(input: Tensor, target: Tensor, loss_fn: Any) -> None:
        pipe.train_step(input, target, loss_fn, schedule=schedule)
    return train(dict(pipe.named_parameters(remove_duplicate=False)),
                 scaler(torchgpipe.distributed.GradScaler),
                 step, lambda: pipe.clip_grad_norm_(MAX_NORM))


@pytest.mark.parametrize('schedule', ['1f1b', 'zb_h1'])
def test_every_rank_skips_the_step_an_infinity_on_one_rank_spoils(schedule: str) -> None:
    ranks = run_distributed(train_on_ranks, schedule, timeout=150)
    for step in range(STEPS):  # one scale
        assert ranks[0][step]['scale'] == ranks[1][step]['scale']
    merged = [{'scale': r0['scale'], 'params': {**r0['params'], **r1['params']}}
              for r0, r1 in zip(*ranks)]
    assert INFINITE_IN in ranks[1][0]['params'] and INFINITE_IN not in ranks[0][0]['params']
    assert_trains_as_unwrapped(merged)


def test_a_disabled_scaler_communicates_nothing() -> None:
    # Not enabled, it is torch's: no process group needed.
    scaler = torchgpipe.distributed.GradScaler('cpu', enabled=False)
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.full((2,), math.inf)
    optimizer = torch.optim.SGD([p], lr=1.0)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    assert p.isinf().all()  # stepped with the infinity, as torch's disabled scaler does

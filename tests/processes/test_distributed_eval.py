"""DistributedGPipe.eval_step: evaluation across ranks, as one process evaluates.

Each configuration trains a step (so that BatchNorm has statistics of its
own), then evaluates: the output on the last partition's rank, the output on
every rank, the loss on every rank. Compared with GPipe.eval_step in one
process after the same step (equal, bit for bit) and with the unwrapped model
in evaluation mode under ``torch.no_grad()`` (equal up to rounding).
"""
from typing import Any, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from test_distributed import TOLERANCE
from test_distributed_pipe import CHUNKS, Config, Result, batch, model, pipeline, where_used
from torchgpipe import GPipe

pytestmark = [pytest.mark.timeout(180), pytest.mark.slow]

TWO_RANKS = [Config('mlp', (3, 2), '1f1b', 'except_last'),
             Config('unet', (5, 5), '1f1b', 'always'),
             Config('batchnorm', (3, 4), '1f1b', 'never'),
             Config('packed', (2, 2), 'fill_drain', 'except_last'),
             Config('tied', (3, 3), '1f1b', 'except_last')]
# Given only what they use, with a loss and without: the middle rank None
# for both; the last rank the target alone, and without a loss nothing.
THREE_RANKS = [Config('unet', (3, 2, 5), '1f1b', 'except_last'),
               Config('unet', (3, 2, 5), '1f1b', 'except_last', only_where_used=True)]
VIRTUAL = [Config('unet', (3, 2, 2, 3), 'interleaved_1f1b', 'except_last'),
           Config('batchnorm', (2, 2, 2, 1), 'zbv', 'never', 'v'),
           Config('batchnorm', (2, 2, 2, 1), 'zbv', 'never', 'v', only_where_used=True)]


def evaluate(pipe: nn.Module, eval_step: Any) -> Result:
    """After a training step: the three evaluations, and what they left."""
    modes = [m.training for m in pipe.modules()]
    before = [t.tolist() for t in pipe.state_dict().values()]
    input, target = batch(7)
    output = eval_step(input)
    result = {
        'output': None if output is None else output.tolist(),
        'everywhere': eval_step(input, everywhere=True).tolist(),
        'loss': float(eval_step(input, target, F.mse_loss)),
        'untouched': [t.tolist() for t in pipe.state_dict().values()] == before,
        'modes': [m.training for m in pipe.modules()] == modes,
        'no grad': all(p.grad is None for p in pipe.parameters()),
    }
    return result


def train_then_evaluate(pipe: nn.Module, config: Config, train_step: Any,
                        eval_step: Any) -> Result:
    train_step(*batch(0), F.mse_loss, schedule=config.schedule)
    pipe.zero_grad(set_to_none=True)
    return evaluate(pipe, eval_step)


def evaluate_pipelines(rank: int, world_size: int, configs: List[Config]) -> Dict[str, Result]:
    results = {}
    for config in configs:
        pipe = pipeline(config)
        results[config.id] = train_then_evaluate(
            pipe, config, where_used(pipe.train_step, config, rank, world_size),
            where_used(pipe.eval_step, config, rank, world_size))
    return results


def one_process(config: Config, threads: bool, ranks: int) -> Result:
    devices = [f'cpu:{w}' if threads else 'cpu' for w in config.ranks(ranks)]
    gpipe = GPipe(model(config.model), list(config.balance), devices=devices, chunks=CHUNKS,
                  checkpoint=config.checkpoint, deferred_batch_norm=config.model == 'batchnorm')

    def eval_step(*args: Any, everywhere: bool = False) -> Any:
        return gpipe.eval_step(*args)
    return train_then_evaluate(gpipe, config, gpipe.train_step, eval_step)


def unwrapped(config: Config) -> Dict[str, Any]:
    """The unwrapped model's output and loss, in eval mode, after the one process's step."""
    plain = model(config.model)
    gpipe = GPipe(plain, list(config.balance), devices=['cpu'] * len(config.balance),
                  chunks=CHUNKS, deferred_batch_norm=config.model == 'batchnorm')
    gpipe.train_step(*batch(0), F.mse_loss, schedule=config.schedule)
    plain.eval()
    input, target = batch(7)
    with torch.no_grad():
        output = plain(input)
    return {'output': output, 'loss': F.mse_loss(output, target)}


@pytest.fixture(scope='module')
def ranks(backend: str) -> Dict[int, List[Dict[str, Result]]]:
    return {2: run_distributed(evaluate_pipelines, TWO_RANKS + VIRTUAL, timeout=150,
                               backend=backend),
            3: run_distributed(evaluate_pipelines, THREE_RANKS, world_size=3, timeout=150,
                               backend=backend)}


@pytest.mark.parametrize('config', TWO_RANKS + THREE_RANKS + VIRTUAL, ids=lambda c: c.id)
def test_evaluation_across_ranks_is_evaluation_in_one_process(
        ranks: Dict[int, List[Dict[str, Result]]], config: Config, backend: str) -> None:
    results = [r[config.id] for r in ranks[3 if config in THREE_RANKS else 2]]
    size = len(results)
    last = config.ranks(size)[-1]
    expected = one_process(config, False, size)
    assert one_process(config, True, size) == expected
    plain = unwrapped(config)
    # Bit for bit on the CPU; GPUs round as the CPU does not.
    exact = {'rtol': 0, 'atol': 0} if backend == 'gloo' else TOLERANCE
    for rank, result in enumerate(results):
        assert result['untouched'] and result['modes'] and result['no grad'], rank
        torch.testing.assert_close(result['loss'], expected['loss'], **exact)  # on every rank
        torch.testing.assert_close(result['everywhere'], expected['output'], **exact)
        # Without everywhere=True, on the last partition's rank only.
        torch.testing.assert_close(result['output'],
                                   expected['output'] if rank == last else None, **exact)
    torch.testing.assert_close(torch.tensor(expected['output'], dtype=torch.float64),
                               plain['output'], **TOLERANCE)
    torch.testing.assert_close(torch.tensor(expected['loss'], dtype=torch.float64),
                               plain['loss'], **TOLERANCE)

"""DistributedGPipe with a parameter tied across ranks: a copy on each, equal at every step.

Language models tie their token embedding (first rank) to their output head
(last rank). Each rank keeps a copy, and the step sums the copies'
gradients over the ranks, so that training equals one process. The
generic grid (a linear first and last layer sharing a weight, every
schedule and checkpoint mode) is in ``test_distributed_pipe.py``; here are
real models, gradient accumulation and data parallelism over the pipelines.
"""
import copy
import functools
import itertools
import pickle
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import CHECKPOINT_MODES, captured, cpu_devices
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import rank_device, run_distributed
from test_distributed import TOLERANCE
from test_distributed_pipe import (CHUNKS, STEPS, Config, Result, assert_equal,
                                   assert_grid_trains_as_unwrapped, batch, merge, model,
                                   snapshot, train_grid)
from test_tied import dropout_step, tied_dropout_model
from torchgpipe import GPipe
from torchgpipe.distributed import DistributedGPipe
from torchgpipe.processes.core import ranks_of_partitions

# Language models, whose lines the smaller tests measure: untraced, at a third of the time.
pytestmark = [pytest.mark.timeout(240), pytest.mark.unmeasured, pytest.mark.slow]

transformers = pytest.importorskip('transformers')

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for benchmarks.models.zoo, here and in the ranks

LANGUAGE_MODELS = ['gpt2', 'bert']


def language_model(name: str, dtype: torch.dtype = torch.float64
                   ) -> Tuple[nn.Module, nn.Sequential]:
    """A tiny model of ``name`` (the zoo's) in ``dtype``, and its flattening."""
    return captured(name, dtype)


def tokens(step: int) -> Tuple[Tensor, Tensor]:
    """A batch of token ids and of labels for every token, on this rank's device."""
    from benchmarks.models.zoo import B, T, V
    gen = torch.Generator().manual_seed(3000 + step)
    return (torch.randint(0, V, (B, T), generator=gen).to(rank_device()),
            torch.randint(0, V, (B, T), generator=gen).to(rank_device()))


def token_loss(seq: nn.Sequential) -> Any:
    """Cross-entropy of the logits of the flattened model's output, every token."""
    def loss_fn(output: Any, labels: Tensor) -> Tensor:
        logits = seq.interface.outputs(output).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())
    return loss_fn


def even(n: int, parts: int) -> List[int]:
    return [n // parts + (k < n % parts) for k in range(parts)]


def train_language_model(pipe: nn.Module, seq: nn.Sequential, step_fn: Any,
                         prefix: int = 0) -> Result:
    """Two steps of SGD with momentum; the losses and the snapshots under the seq's names."""
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    losses, snapshots = [], []
    for step in range(STEPS):
        optimizer.zero_grad()
        ids, labels = tokens(step)
        losses.append(float(step_fn(seq.interface.inputs(input_ids=ids), labels,
                                    token_loss(seq))))
        snapshots.append(snapshot(pipe, prefix))
        optimizer.step()
    return {'losses': losses, 'snapshots': snapshots}


DTYPES = {'float64': torch.float64, 'float32': torch.float32}


def train_language_models(rank: int, world_size: int, models: bytes) -> Dict[str, Result]:
    """Trains each model of the pickled dict ``models`` (captured once, by the test).

    Pickled to bytes by the test: as an argument of the spawn, each tensor would
    come through shared memory, one storage for every rank to update in turn.
    """
    results = {}
    for key, (user, seq) in pickle.loads(models).items():
        keys = list(user.state_dict())
        registered = [(n, id(p)) for n, p in user.named_parameters(remove_duplicate=False)]
        pipe = DistributedGPipe(seq, even(len(seq), world_size), chunks=CHUNKS,
                                device=rank_device())
        results[key] = train_language_model(pipe, seq, pipe.train_step)
        # The user's model is as it was, and holds what this rank trained.
        mine = {id(p) for p in pipe.parameters()}
        results[key]['user'] = {
            'kept': list(user.state_dict()) == keys and registered == [
                (n, id(p)) for n, p in user.named_parameters(remove_duplicate=False)],
            'trained here': sum(id(p) in mine for p in user.parameters()),
            'parameters here': len(mine)}
    return results


def one_process_language_model(name: str, parts: int, dtype: str = 'float64',
                               threads: bool = False) -> Result:
    _, seq = language_model(name, DTYPES[dtype])
    gpipe = GPipe(seq, even(len(seq), parts), devices=cpu_devices(parts, threads),
                  chunks=CHUNKS)
    return train_language_model(gpipe, seq, gpipe.train_step, prefix=2)


@functools.lru_cache(maxsize=None)  # the same for 2 and 3 ranks
def unwrapped_language_model(name: str) -> Result:
    """The original model, with its snapshots under the flattened model's names."""
    original, seq = language_model(name)

    def step(input: Any, labels: Tensor, loss_fn: Any) -> Tensor:
        loss = loss_fn(seq(input), labels)  # seq holds the original's own layers
        loss.backward()
        return loss.detach()
    result = train_language_model(seq, seq, step)
    # The flattened model's state dict has every key of the original's.
    assert set(seq.state_dict_map.values()) <= set(result['snapshots'][0]['params'])
    return result


@pytest.fixture(scope='module', params=[2, 3], ids=lambda n: f'{n} ranks')
def language_model_ranks(request: pytest.FixtureRequest,
                         backend: str) -> Tuple[int, List[Dict[str, Result]]]:
    # Not measured: the tied grid of test_distributed_pipe.py runs the same code.
    # float32 on 2 ranks of gloo only: the order of additions is the point (bit for bit
    # as one process on the CPU), not the layout.
    float32 = request.param == 2 and backend == 'gloo'
    models = pickle.dumps({f'{name}-{dtype}': language_model(name, DTYPES[dtype])
                           for name in LANGUAGE_MODELS
                           for dtype in (DTYPES if float32 else ['float64'])})
    return request.param, run_distributed(train_language_models, models,
                                          world_size=request.param, timeout=200, measured=False,
                                          backend=backend)


@pytest.mark.parametrize('dtype', list(DTYPES))
@pytest.mark.parametrize('name', LANGUAGE_MODELS)
def test_a_language_model_with_tied_embeddings_trains_as_one_process(
        language_model_ranks: Tuple[int, List[Dict[str, Result]]], name: str,
        dtype: str, backend: str) -> None:
    parts, ranks = language_model_ranks
    if f'{name}-{dtype}' not in ranks[0]:
        pytest.skip(f'{dtype} runs on 2 ranks of gloo only')
    for rank in ranks:  # the pipeline trains the user's own parameters, left registered
        user = rank[f'{name}-{dtype}'].pop('user')
        assert user['kept'] and user['trained here'] == user['parameters here'] > 0, user
    actual = merge([r[f'{name}-{dtype}'] for r in ranks])
    original, seq = language_model(name)
    embedding, head = (seq.state_dict_map[k] for k in ('transformer.wte.weight', 'lm_head.weight')
                       ) if name == 'gpt2' else (
        seq.state_dict_map[k] for k in ('bert.embeddings.word_embeddings.weight',
                                        'cls.predictions.decoder.weight'))
    assert seq.state_dict(keep_vars=True)[embedding] is seq.state_dict(keep_vars=True)[head]
    for step in actual['snapshots']:  # on the first rank and the last, one parameter
        for kind in ('grads', 'params'):
            assert step[kind][embedding] == step[kind][head]
    # One process adds the tied gradient in the same order, on both paths:
    # the same bits (torchgpipe.foundation.tied.shares_apart), on the CPU.
    for threads in (False, True):
        assert_equal(actual, one_process_language_model(name, parts, dtype, threads),
                     exact=backend == 'gloo')
    if dtype == 'float64':
        assert_equal(actual, unwrapped_language_model(name), exact=False)


# --- accumulation and data parallelism ------------------------------------------------------

TIED = Config('tied', (3, 3), '1f1b', 'except_last')


def accumulate(rank: int, world_size: int) -> Result:
    """Two steps without zero_grad() between them: the gradients add up."""
    pipe = DistributedGPipe(model(TIED.model), TIED.balance, chunks=CHUNKS, device=rank_device())
    for step in range(STEPS):
        pipe.train_step(*batch(step), F.mse_loss)
    return snapshot(pipe)


def test_gradients_accumulated_over_steps_are_summed_over_the_ranks_once(backend: str) -> None:
    ranks = run_distributed(accumulate, timeout=150, backend=backend)
    plain = model(TIED.model)
    for step in range(STEPS):
        F.mse_loss(plain(batch(step)[0]), batch(step)[1]).backward()
    expected = snapshot(plain)['grads']
    actual = {name: grad for r in ranks for name, grad in r['grads'].items()}
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        torch.testing.assert_close(torch.tensor(actual[name]), torch.tensor(grad), **TOLERANCE,
                                   msg=lambda m, name=name: f'{name}: {m}')


def test_tied_pipelines_replicated_over_a_second_dimension_of_ranks(backend: str) -> None:
    """Ranks 0-1 and 2-3 are two pipelines of the tied model; 0-2 and 1-3 the replicas."""
    ranks = run_distributed(train_grid, TIED, world_size=4, timeout=150, backend=backend)
    assert_grid_trains_as_unwrapped(ranks, TIED)
    # Every copy of the tied weight, on the four ranks, is the same.
    copies = [r['snapshots'][-1]['params'].get(k) for r in ranks for k in ('0.weight', '5.weight')]
    assert [c for c in copies if c is not None] == [copies[0]] * 4


def unequal_copies(rank: int, world_size: int) -> List[str]:
    """Each rank builds the tied model with its own weights, then loads one state, then two."""
    errors = []
    unseeded = model(TIED.model)
    with torch.no_grad():  # model() seeds itself: a rank's own weights, as if it had not
        unseeded[0].weight.normal_(generator=torch.Generator().manual_seed(rank))
    pipe = DistributedGPipe(unseeded, TIED.balance, chunks=CHUNKS, device=rank_device())
    try:
        pipe.train_step(*batch(0), F.mse_loss)
    except ValueError as exc:
        errors.append(str(exc))
    # Refused when the step is over on every rank: the pipeline is whole,
    # and trains once every rank loads the same state ...
    pipe.load_state_dict(model(TIED.model).state_dict())
    pipe.train_step(*batch(0), F.mse_loss)
    # ... but not after a load of another on one rank.
    state = model(TIED.model).state_dict()
    if rank == 1:
        state['5.weight'] = state['5.weight'] + 1
    pipe.load_state_dict(state)
    try:
        pipe.train_step(*batch(1), F.mse_loss)
    except ValueError as exc:
        errors.append(str(exc))
    # Nor after a load on one rank alone: the other, which sent no copy, compares.
    pipe.load_state_dict(model(TIED.model).state_dict())
    pipe.train_step(*batch(0), F.mse_loss)
    if rank == 1:
        pipe.load_state_dict(state)
    try:
        pipe.train_step(*batch(1), F.mse_loss)
    except ValueError as exc:
        errors.append(str(exc))
    return errors


def test_copies_that_differ_are_refused_at_the_first_step_and_after_a_load(backend: str) -> None:
    for rank, errors in enumerate(run_distributed(unequal_copies, timeout=150, backend=backend)):
        other = 1 - rank
        assert errors == [
            'the copies of a parameter tied across ranks must be equal '
            f"('{['0', '5'][rank]}.weight' of rank {rank} differs from its copy on rank "
            f"{other}); "
            'build the module alike on every rank (seed torch.manual_seed alike before '
            'building it) and load the same state dict on every rank'] * (3 - rank)


# --- dropout, and two partitions of one rank -----------------------------------------------

#: The partitions of each schedule on two ranks: one each, or two each in a loop or a V
#: (whose rank 0 holds both the embedding and the head).
ON_TWO_RANKS = {'fill_drain': 2, '1f1b': 2, 'zb_h1': 2, 'interleaved_1f1b': 4, 'zbv': 4}


def placement(schedule: str) -> str:
    return 'v' if schedule == 'zbv' else 'loop'


def tied_dropout_steps(rank: int, world_size: int) -> Dict[str, Result]:
    """A step of the tied model with dropout, for every schedule and checkpoint mode.

    Dropout follows the embedding only: each rank draws from its own
    generator, and rank 0's draws are one process's only if no other rank draws.
    """
    results = {}
    for (schedule, n), checkpoint in itertools.product(ON_TWO_RANKS.items(), CHECKPOINT_MODES):
        model, balance = tied_dropout_model(n, dropout_everywhere=False)
        pipe = DistributedGPipe(model, balance, chunks=CHUNKS, checkpoint=checkpoint,
                                placement=placement(schedule))
        loss = dropout_step(pipe, schedule)[0]
        results[f'{schedule}-{checkpoint}'] = {'losses': [float(loss)],
                                               'snapshots': [snapshot(pipe)]}
    return results


def test_tied_gradient_with_dropout_bit_for_bit_on_two_ranks() -> None:
    """Two ranks give the tied gradient of one process, bit for bit, for every
    schedule and checkpoint mode: partitions 0 and 3 of a V, on one rank,
    keep their gradients apart as two partitions of one process do."""
    ranks = run_distributed(tied_dropout_steps, timeout=150)
    for (schedule, n), checkpoint in itertools.product(ON_TWO_RANKS.items(), CHECKPOINT_MODES):
        actual = merge([r[f'{schedule}-{checkpoint}'] for r in ranks])
        model, balance = tied_dropout_model(n, dropout_everywhere=False)
        workers = ranks_of_partitions(balance, 2, placement(schedule))
        for threads in (False, True):
            gpipe = GPipe(copy.deepcopy(model), balance, chunks=CHUNKS, checkpoint=checkpoint,
                          devices=[f'cpu:{w}' if threads else 'cpu' for w in workers])
            loss = dropout_step(gpipe, schedule)[0]
            assert_equal(actual, {'losses': [float(loss)], 'snapshots': [snapshot(gpipe, 2)]},
                         exact=True)

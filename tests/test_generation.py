"""generate: greedy decoding with a pipelined causal language model.

Tiny GPT-2 and Llama models (the zoo's, in float64) are flattened by
to_sequential, pipelined by GPipe on both execution paths, and by
DistributedGPipe on 2 ranks; their tokens must be those of Hugging Face's
``generate(do_sample=False)`` on the unwrapped model.
"""
import functools
import sys
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
import torch
from torch import Tensor, nn

from helpers import cpu_devices
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from torchgpipe import GPipe, generate, to_sequential

pytestmark = pytest.mark.timeout(240)

transformers = pytest.importorskip('transformers')

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for benchmarks.models.zoo, here and in the ranks

NEW = 6
MODELS = ['gpt2', 'llama']


def language_model(name: str) -> Tuple[nn.Module, nn.Sequential]:
    from benchmarks.models.zoo import MODELS as ZOO
    torch.manual_seed(0)
    original = ZOO[name].factory().double().eval()
    return original, to_sequential(original)


def prompts(batch: int = 6, length: int = 5) -> Tensor:
    from benchmarks.models.zoo import V
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(7))


@functools.lru_cache(maxsize=None)
def expected(name: str, eos: Optional[int] = None) -> Tensor:
    """Hugging Face's greedy tokens on the unwrapped model."""
    original, _ = language_model(name)
    ids = prompts()
    options = {} if eos is None else {'eos_token_id': eos}
    return original.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=NEW, pad_token_id=0, **options)


def even(n: int, parts: int) -> List[int]:
    return [n // parts + (k < n % parts) for k in range(parts)]


@pytest.mark.parametrize('name', MODELS)
def test_greedy_tokens_are_the_unwrapped_models(name: str, threaded: bool) -> None:
    _, seq = language_model(name)
    pipe = GPipe(seq, even(len(seq), 3), devices=cpu_devices(3, threaded), chunks=3)
    tokens = generate(pipe, prompts(), NEW, interface=seq.interface)
    assert torch.equal(tokens, expected(name))
    assert pipe.training  # as it was


def test_a_sequence_that_ends_is_padded_and_generation_stops_when_all_have() -> None:
    want = expected('gpt2')
    # The token one sequence generates first ends it; the others go on.
    eos = int(want[0, 5])
    _, seq = language_model('gpt2')
    pipe = GPipe(seq, even(len(seq), 2), devices=['cpu', 'cpu'], chunks=2)
    tokens = generate(pipe, prompts(), NEW, interface=seq.interface, eos_token_id=eos,
                      pad_token_id=0)
    assert torch.equal(tokens, expected('gpt2', eos))
    assert tokens[0, 6:].eq(0).all()  # padded after its end
    one = generate(pipe, prompts()[:1], NEW, interface=seq.interface, eos_token_id=eos)
    assert one.shape == (1, 6)  # stopped as soon as its only sequence ended


def test_bad_arguments_are_refused_before_any_work() -> None:
    _, seq = language_model('gpt2')
    pipe = GPipe(seq, even(len(seq), 2), devices=['cpu', 'cpu'])
    with pytest.raises(TypeError, match=r'model must be a GPipe or a DistributedGPipe \(model: '
                                        r'Sequential\); wrap the language model'):
        generate(seq, prompts(), 2)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r'input_ids must be a 2-D tensor of token ids '
                                        r'\(input_ids: a tensor of 1 dimensions, torch.int64\)'):
        generate(pipe, prompts()[0], 2)
    with pytest.raises(ValueError, match=r'max_new_tokens must be an integer, 0 or more '
                                         r'\(max_new_tokens: -1\)'):
        generate(pipe, prompts(), -1)
    assert torch.equal(generate(pipe, prompts(), 0, interface=seq.interface), prompts())


def generate_across(rank: int, world_size: int) -> Dict[str, List[List[int]]]:
    from torchgpipe.distributed import DistributedGPipe
    results = {}
    for name in MODELS:
        _, seq = language_model(name)
        pipe = DistributedGPipe(seq, even(len(seq), world_size), chunks=3)
        results[name] = generate(pipe, prompts(), NEW, interface=seq.interface).tolist()
    return results


def test_across_ranks_every_rank_gets_the_unwrapped_models_tokens() -> None:
    # Not measured: test_distributed_eval.py runs the same code.
    ranks = run_distributed(generate_across, timeout=200, measured=False)
    for name in MODELS:
        want = expected(name).tolist()
        assert [r[name] for r in ranks] == [want, want]

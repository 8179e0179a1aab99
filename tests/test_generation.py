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

from helpers import captured, cpu_devices
from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from torchgpipe import GPipe, generate, to_sequential

# Language models, whose lines the smaller tests measure: untraced, at a third of the time.
pytestmark = [pytest.mark.timeout(240), pytest.mark.unmeasured, pytest.mark.slow]

transformers = pytest.importorskip('transformers')

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # for benchmarks.models.zoo, here and in the ranks

NEW = 6
MODELS = ['gpt2', 'llama']
#: Across ranks, one: the other's layers differ, not the way ranks generate
#: (its ties across ranks are test_distributed_tied.py's).
ACROSS = ['llama']


def language_model(name: str) -> Tuple[nn.Module, nn.Sequential]:
    return captured(name, evaluate=True)


def prompts(batch: int = 6, length: int = 5) -> Tensor:
    from benchmarks.models.zoo import V
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(7))


@functools.lru_cache(maxsize=None)
def expected(name: str, eos: Optional[int] = None, new: int = NEW) -> Tensor:
    """Hugging Face's greedy tokens on the unwrapped model."""
    original, _ = language_model(name)
    ids = prompts()
    options = {} if eos is None else {'eos_token_id': eos}
    return original.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=new, pad_token_id=0, **options)


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


def lm_loss(output: Tensor, labels: Tensor) -> Tensor:
    return torch.nn.functional.cross_entropy(output.reshape(-1, output.size(-1)),
                                             labels.reshape(-1))


def batch(seed: int) -> Tuple[Tensor, Tensor]:
    from benchmarks.models.zoo import V
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (6, 5), generator=generator), \
        torch.randint(0, V, (6, 5), generator=generator)


def fresh_across(rank: int, world_size: int) -> Dict[str, Dict[str, object]]:
    """The generation example of docs/scaling_out.rst, as written, on a model fresh from
    its constructor (training mode), between training steps and evaluation steps."""
    import torchgpipe
    from benchmarks.models.zoo import MODELS as ZOO
    from helpers import literal_block, run_snippet
    from torchgpipe.distributed import DistributedGPipe

    example = literal_block((ROOT / 'docs' / 'scaling_out.rst').read_text(),
                            'For a model flattened by')
    results: Dict[str, Dict[str, object]] = {}
    for name in ACROSS:
        torch.manual_seed(0)
        model = ZOO[name].factory().double()
        namespace = {'model': model, 'to_sequential': to_sequential, 'torchgpipe': torchgpipe,
                     'DistributedGPipe': DistributedGPipe, 'input_ids': prompts()}
        run_snippet(example, namespace,
                    {'balance': lambda ns: even(len(ns['seq']), world_size)})
        seq, pipe = namespace['seq'], namespace['pipe']

        def loss_fn(output: object, labels: Tensor) -> Tensor:
            return lm_loss(seq.interface.outputs(output).logits, labels)

        got: Dict[str, object] = {'tokens': namespace['tokens'].tolist()}
        for step, seed in [('train', 1), ('eval', 2), ('train again', 3)]:
            x, labels = batch(seed)
            input = seq.interface.inputs(input_ids=x)
            if step == 'eval':
                got[step] = pipe.eval_step(input, labels, loss_fn).item()
                continue
            # Plain numbers: a tensor would go back through shared memory.
            got[step] = pipe.train_step(input, labels, loss_fn).item()
            got[step + ' grads'] = {k: p.grad.tolist() for k, p in model.named_parameters()
                                    if p.grad is not None}
            model.zero_grad(set_to_none=True)
        got['modes'] = [m.training for m in model.modules()]
        results[name] = got
    return results


def test_across_ranks_a_fresh_model_generates_evaluates_and_trains() -> None:
    """Every rank gets the unwrapped model's tokens, as docs/scaling_out.rst generates
    them; training and evaluation steps before and after are the unwrapped model's."""
    from benchmarks.models.zoo import MODELS as ZOO
    # Not measured: test_distributed_eval.py runs the same code.
    ranks = run_distributed(fresh_across, timeout=200, measured=False)
    for name in ACROSS:
        want = expected(name, new=20).tolist()
        assert [r[name]['tokens'] for r in ranks] == [want, want]
        torch.manual_seed(0)
        model = ZOO[name].factory().double()
        for r in ranks:
            assert r[name]['modes'] == [m.training for m in model.modules()]
        for step, seed in [('train', 1), ('eval', 2), ('train again', 3)]:
            x, labels = batch(seed)
            if step == 'eval':
                with torch.no_grad():
                    loss = lm_loss(model.eval()(input_ids=x).logits, labels)
                model.train()
            else:
                loss = lm_loss(model(input_ids=x).logits, labels)
                loss.backward()
            for r in ranks:
                torch.testing.assert_close(r[name][step], loss.item())
            if step == 'eval':
                continue
            grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
            held = [r[name][step + ' grads'] for r in ranks]
            assert set(grads) <= set(held[0]) | set(held[1])
            for key, grad in grads.items():
                for mine in held:
                    if key in mine:
                        torch.testing.assert_close(torch.tensor(mine[key], dtype=grad.dtype),
                                                   grad, msg=key)
            model.zero_grad(set_to_none=True)

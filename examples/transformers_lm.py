"""Pipeline a Hugging Face transformers causal language model with to_sequential and GPipe.

A Llama-style decoder from transformers, with a small random configuration
(nothing is downloaded), goes through :func:`torchgpipe.to_sequential` as it
is: no wrapper, no argument. The model gives ``dummy_inputs``, so the graph
is captured with :func:`torch.export.export`; the sequential holds the
model's own parameters, so the optimizer is built on the model. GPipe runs
it on 4 CPU devices, one worker thread each, with 1F1B
(:meth:`~torchgpipe.GPipe.train_step`).

The data is generated: sequences that repeat a random pattern of 4 tokens,
which the model learns to continue. The loss is the one transformers
computes when given ``labels=input_ids`` (next-token cross-entropy),
computed here from the logits, outside the model, as a pipeline must (see
``docs/any_model.rst``). At every step, the pipeline's loss must equal the
unwrapped model's for the same batch, in float64 (``rtol=1e-9``); the script
exits with status 1 otherwise.

Run it with ``python examples/transformers_lm.py`` (``--help`` lists the
options). It needs transformers, which the ``dev`` extra installs, or
``python -m pip install "transformers>=5,<6"``; the ``examples`` extra of the
demo does not.
"""
import argparse
import copy
import sys
from typing import Any, List, Optional

import torch
import torch.nn.functional as F
import transformers
from torch import Tensor

from torchgpipe import GPipe, to_sequential
from torchgpipe.balance import balance_by_time

PARTITIONS = 4


def causal_lm_loss(logits: Tensor, ids: Tensor) -> Tensor:
    """Next-token prediction: the logits at each position against the next token."""
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def batch_of_patterns(batch_size: int, length: int, vocabulary: int) -> Tensor:
    """Sequences that repeat a random pattern of 4 tokens."""
    pattern = torch.randint(0, vocabulary, (batch_size, 4))
    return pattern.repeat(1, (length + 3) // 4)[:, :length]


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--steps', type=int, default=10, help='training steps')
    parser.add_argument('--batch-size', type=int, default=16, help='sequences per mini-batch')
    parser.add_argument('--length', type=int, default=32, help='tokens per sequence')
    parser.add_argument('--layers', type=int, default=4, help='decoder layers of the model')
    parser.add_argument('--chunks', type=int, default=4, help='micro-batches per mini-batch')
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size, args.length, args.layers, args.chunks) < 1:
        parser.error('--steps, --batch-size, --length, --layers and --chunks must be at least 1')
    torch.manual_seed(0)

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=args.length)
    model = transformers.LlamaForCausalLM(config).double()
    reference = copy.deepcopy(model)  # trained alongside, without GPipe

    seq = to_sequential(model)
    sample = batch_of_patterns(args.batch_size, args.length, config.vocab_size)
    balance = balance_by_time(PARTITIONS, seq, sample, device='cpu')
    pipe = GPipe(seq, balance, devices=[f'cpu:{j}' for j in range(PARTITIONS)],
                 chunks=args.chunks)
    print(f'transformers LlamaForCausalLM ({args.layers} layers, random weights, float64) '
          f'flattened by to_sequential into {len(seq)} children, inputs '
          f'{seq.interface.names}; GPipe on {PARTITIONS} CPU devices, balance {balance}, '
          f'chunks={args.chunks}, train_step with 1F1B; {args.steps} steps of '
          f'{args.batch_size} x {args.length} tokens', flush=True)

    def loss_fn(output: Any, ids: Tensor) -> Tensor:
        # The sequential returns the tensors of the model's output; the
        # interface arranges them back into its CausalLMOutputWithPast.
        return causal_lm_loss(seq.interface.outputs(output).logits, ids)

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for step in range(args.steps):
        ids = batch_of_patterns(args.batch_size, args.length, config.vocab_size)
        loss = pipe.train_step(ids, ids, loss_fn)
        expected = causal_lm_loss(reference(input_ids=ids).logits, ids)
        expected.backward()
        same = torch.allclose(loss, expected.detach(), rtol=1e-9, atol=0)
        print(f'step {step}: loss {loss.item():.6f}, without GPipe {expected.item():.6f}'
              f'{"  OK" if same else "  MISMATCH"}')
        if not same:
            print(f'FAIL: at step {step}, the pipeline\'s loss is not the unwrapped '
                  'model\'s (rtol=1e-9)', file=sys.stderr)
            return 1
        for opt in (optimizer, reference_optimizer):
            opt.step()
            opt.zero_grad()
    print(f'OK: at each of {args.steps} steps, the pipeline\'s loss is the unwrapped '
          f'model\'s (rtol=1e-9); final loss {loss.item():.6f}')
    return 0


if __name__ == '__main__':
    sys.exit(main())

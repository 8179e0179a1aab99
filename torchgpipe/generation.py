"""Greedy generation with a pipelined causal language model, in one process or across ranks.

One token per :meth:`eval_step <torchgpipe.GPipe.eval_step>`; only the next
tokens leave the last partition (``output_fn``), never the logits::

    ids ─► eval_step(ids) ─► last position's argmax ─► ids + token ─► eval_step ...

No key-value cache: each step runs the whole sequence again.
"""
from typing import TYPE_CHECKING, Any, Optional, Union, cast

import torch
from torch import Tensor

from torchgpipe.foundation.microbatch import TensorOrTensors
from torchgpipe.foundation.validation import describe
from torchgpipe.modules.gpipe import GPipe

if TYPE_CHECKING:  # loaded on first use, as torchgpipe.distributed is
    from torchgpipe.distributed import DistributedGPipe

__all__ = ['generate']


def generate(model: Union[GPipe, 'DistributedGPipe'], input_ids: Tensor, max_new_tokens: int, *,
             interface: Any = None, eos_token_id: Optional[int] = None,
             pad_token_id: Optional[int] = None) -> Tensor:
    """Continues each sequence of ``input_ids`` with its most likely tokens, one at a time.

    The tokens of Hugging Face's ``model.generate(input_ids, do_sample=False,
    max_new_tokens=...)`` on the unwrapped model, for prompts of one length. On a
    :class:`~torchgpipe.distributed.DistributedGPipe`, every rank calls it with the
    same ``input_ids`` and gets the result.

    Args:
        model (GPipe or DistributedGPipe): the pipelined causal language model
        input_ids (torch.Tensor): the prompts, ``(batch, length)`` token ids
        max_new_tokens (int): how many tokens to add, at most
        interface: for a model flattened by :func:`~torchgpipe.to_sequential`,
            its ``interface``; without it, the pipeline takes the ids and
            returns the logits
        eos_token_id (int, optional): ends a sequence; generation stops once
            every sequence has ended
        pad_token_id (int, optional): what follows a finished sequence
            (default: ``eos_token_id``)

    Returns:
        torch.Tensor: ``input_ids`` followed by at most ``max_new_tokens`` new
        tokens, on ``input_ids``' device

    Raises:
        TypeError: ``model`` is not a GPipe or a DistributedGPipe, or
            ``input_ids`` not a 2-D integer tensor
        ValueError: ``max_new_tokens`` is negative

    Example::

        seq = to_sequential(GPT2LMHeadModel(config))   # in training mode, as made
        pipe = GPipe(seq, balance, devices=['cpu:0', 'cpu:1'], chunks=4)
        tokens = generate(pipe, input_ids, 20, interface=seq.interface)
    """
    check_generation(model, input_ids, max_new_tokens)

    def next_tokens(output: TensorOrTensors) -> Tensor:
        logits = output if interface is None else interface.outputs(output).logits
        return cast(Tensor, logits)[:, -1].argmax(-1)

    def step(ids: Tensor) -> Tensor:
        input = ids if interface is None else interface.inputs(input_ids=ids)
        if isinstance(model, GPipe):
            tokens = model.eval_step(input, output_fn=next_tokens)
        else:  # every rank needs them, to go on
            tokens = model.eval_step(input, everywhere=True, output_fn=next_tokens)
        return cast(Tensor, tokens).to(ids.device)

    ids = input_ids
    done = torch.zeros(len(ids), dtype=torch.bool, device=ids.device)
    for _ in range(max_new_tokens):
        tokens = step(ids)
        if eos_token_id is not None:
            pad = eos_token_id if pad_token_id is None else pad_token_id
            tokens = torch.where(done, torch.full_like(tokens, pad), tokens)
            done |= tokens == eos_token_id
        ids = torch.cat([ids, tokens[:, None]], dim=1)
        if bool(done.all()):
            break
    return ids


def check_generation(model: object, input_ids: object, max_new_tokens: object) -> None:
    """Refuses what :func:`generate` cannot take, before any work."""
    from torchgpipe.distributed import DistributedGPipe
    if not isinstance(model, (GPipe, DistributedGPipe)):
        raise TypeError(describe('model must be a GPipe or a DistributedGPipe',
                                 f'model: {type(model).__name__}',
                                 'wrap the language model in GPipe (one process) or '
                                 'DistributedGPipe (across processes) first'))
    if not (isinstance(input_ids, Tensor) and input_ids.dim() == 2
            and not input_ids.is_floating_point() and not input_ids.is_complex()):
        got = (f'a tensor of {input_ids.dim()} dimensions, {input_ids.dtype}'
               if isinstance(input_ids, Tensor) else type(input_ids).__name__)
        raise TypeError(describe('input_ids must be a 2-D tensor of token ids',
                                 f'input_ids: {got}',
                                 'give the prompts as (batch, length) integers, of one '
                                 'length'))
    if not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(describe('max_new_tokens must be an integer, 0 or more',
                                  f'max_new_tokens: {max_new_tokens!r}',
                                  'say how many tokens to add'))

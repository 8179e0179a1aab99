"""Pipeline a small GPT, written as a usual nn.Module, with to_sequential and GPipe.

The model is a decoder-only transformer as one writes it without pipelining in
mind: a token embedding tied to the output projection, a learned positional
embedding, residual blocks (LayerNorm, causal self-attention written by hand
with its mask as a registered buffer, an MLP) in an :class:`~torch.nn.ModuleList`,
and dropout. :func:`torchgpipe.to_sequential` traces it into an
:class:`~torch.nn.Sequential`, :func:`torchgpipe.balance.balance_by_time` splits
that into 4 partitions, and :class:`torchgpipe.GPipe` trains it on 4 CPU devices.

The task is generated, nothing is downloaded: character-level lines of
additions such as ``"37+58=95;"``, drawn from ``--seed``. The model learns to
predict each next character; the loss falls from ``log(vocabulary)`` towards
the entropy of the random operands.

Every run starts from the same weights and sees the same batches:

1. without GPipe: the original module;
2. GPipe on ``['cpu'] * 4``: the pipeline runs in the calling thread;
3. GPipe on ``['cpu:0', ..., 'cpu:3']``: one worker thread per device.

These three run with dropout off, and their losses must agree at every step
(``rtol=1e-6``, in float64): with dropout on, each micro-batch draws its own
masks, which the unwrapped model on the full batch does not draw. Then both
GPipe paths train again with dropout on (``--dropout``): GPipe draws the same
random numbers on both paths, so these two must agree with each other. The
script exits with status 1 on any mismatch.

Run it with ``python examples/gpt.py`` (``--help`` lists the options); it needs
the ``examples`` extra (tqdm).
"""
import argparse
import copy
import math
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm import tqdm

from torchgpipe import GPipe, to_sequential
from torchgpipe.balance import balance_by_time

DIGITS = '0123456789+=;'
VOCABULARY = len(DIGITS)
PARTITIONS = 4
DTYPE = torch.float64
RTOL = 1e-6


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int, length: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        # Not learned, not saved: rebuilt by __init__.
        self.register_buffer('mask', torch.tril(torch.ones(length, length)).bool(),
                             persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.shape
        # (3, B, heads, T, head width): queries, keys and values of every head.
        qkv = self.qkv(x).reshape(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        scores = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(C // self.heads))
        weights = F.softmax(scores.masked_fill(~self.mask[:T, :T], float('-inf')), dim=-1)
        y = (self.attn_drop(weights) @ v).transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, length: int, dropout: float) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads, length, dropout)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width), nn.Dropout(dropout))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A decoder-only transformer; the output projection is the token embedding."""

    def __init__(self, layers: int, width: int, heads: int, length: int,
                 dropout: float) -> None:
        super().__init__()
        self.tok_emb = nn.Embedding(VOCABULARY, width)
        # Small, as GPT-2's: the tied head's logits start near 0.
        nn.init.normal_(self.tok_emb.weight, std=0.02)
        self.pos_emb = nn.Parameter(torch.randn(length, width) * 0.02)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(width, heads, length, dropout)
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCABULARY, bias=False)
        self.head.weight = self.tok_emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.drop(self.tok_emb(tokens) + self.pos_emb[:tokens.size(1)])
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def make_text(characters: int, seed: int) -> Tensor:
    """Lines of additions of two 2-digit numbers, ``"37+58=95;"``, as token ids."""
    gen = torch.Generator().manual_seed(seed)
    lines: List[str] = []
    while sum(map(len, lines)) < characters:
        a, b = torch.randint(100, (2,), generator=gen).tolist()
        lines.append(f'{a}+{b}={a + b};')
    text = ''.join(lines)[:characters]
    return torch.tensor([DIGITS.index(c) for c in text])


def make_batches(text: Tensor, steps: int, batch_size: int, length: int,
                 seed: int) -> List[Tuple[Tensor, Tensor]]:
    """Random windows of the text: (input, next characters) for every step."""
    gen = torch.Generator().manual_seed(seed + 1)
    batches = []
    for _ in range(steps):
        starts = torch.randint(len(text) - length - 1, (batch_size,), generator=gen)
        windows = torch.stack([text[s:s + length + 1] for s in starts.tolist()])
        batches.append((windows[:, :-1], windows[:, 1:]))
    return batches


def set_dropout(model: nn.Module, p: float) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = p


def train(model: nn.Module, batches: Sequence[Tuple[Tensor, Tensor]], seed: int,
          desc: str) -> Tuple[List[float], float]:
    """Trains with Adam; returns the loss of every step and the tokens per second."""
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    model.train()
    # The same dropout masks for runs that draw them in the same order.
    torch.manual_seed(seed)
    losses: List[float] = []
    bar = tqdm(batches, desc=desc, unit='step', dynamic_ncols=True)
    start = time.perf_counter()
    for tokens, targets in bar:
        optimizer.zero_grad()
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f'{losses[-1]:.4f}', refresh=False)
    elapsed = time.perf_counter() - start
    bar.close()
    return losses, sum(t.numel() for t, _ in batches) / elapsed


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description='Train a small GPT written as a usual nn.Module through to_sequential '
                    'and GPipe over 4 CPU partitions, and check it trains like the module.')
    parser.add_argument('--steps', type=int, default=40, help='steps per run')
    parser.add_argument('--batch-size', type=int, default=32, help='sequences per batch')
    parser.add_argument('--chunks', type=int, default=4,
                        help='micro-batches per batch')
    parser.add_argument('--layers', type=int, default=4, help='blocks')
    parser.add_argument('--width', type=int, default=64, help='embedding width')
    parser.add_argument('--length', type=int, default=32,
                        help='characters per sequence')
    parser.add_argument('--dropout', type=float, default=0.1,
                        help='dropout of the runs with dropout')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed of the text, the weights and the batches')
    args = parser.parse_args(argv)
    if min(args.steps, args.batch_size, args.chunks, args.layers) < 1:
        parser.error('--steps, --batch-size, --chunks and --layers must be at least 1')
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    # One intra-op thread: the threaded path overlaps partitions with its workers.
    torch.set_num_threads(1)
    text = make_text(20000, args.seed)
    batches = make_batches(text, args.steps, args.batch_size, args.length, args.seed)

    torch.manual_seed(args.seed)
    model = GPT(args.layers, args.width, 4, args.length, args.dropout).to(DTYPE)
    seq = to_sequential(model)
    balance = balance_by_time(PARTITIONS, seq, batches[0][0], timeout=0.5, device='cpu')
    print(f'A GPT of {args.layers} blocks, flattened by to_sequential into {len(seq)} '
          f'children, trained as the module and by GPipe over {PARTITIONS} CPU partitions '
          f'(in one thread and with a worker thread each, without and with dropout); '
          f'balance {balance}, chunks={args.chunks}; {args.steps} steps of '
          f'{args.batch_size} x {args.length} tokens', flush=True)

    paths = {'1 thread': ['cpu'] * PARTITIONS,
             '4 threads': [f'cpu:{j}' for j in range(PARTITIONS)]}
    runs: Dict[str, Tuple[List[float], float]] = {}
    for p in [0.0, args.dropout]:
        suffix = '' if p == 0 else f', dropout {p:g}'
        if p == 0:
            plain = copy.deepcopy(model)
            set_dropout(plain, p)
            runs['without GPipe'] = train(plain, batches, args.seed, 'without GPipe')
        for path, devices in paths.items():
            # A fresh copy of the same weights; to_sequential shares its
            # modules and parameters, so the copy is flattened again.
            original = copy.deepcopy(model)
            set_dropout(original, p)
            gpipe = GPipe(to_sequential(original), balance, devices=devices,
                          chunks=args.chunks)
            name = f'GPipe, {path}{suffix}'
            runs[name] = train(gpipe, batches, args.seed, name)

    pairs = [('GPipe, 1 thread', 'without GPipe'), ('GPipe, 4 threads', 'without GPipe'),
             (f'GPipe, 4 threads, dropout {args.dropout:g}',
              f'GPipe, 1 thread, dropout {args.dropout:g}')]
    width = max(map(len, runs))
    print(f'\n  {"run":<{width}}  first loss  final loss  tokens/s')
    for name, (losses, speed) in runs.items():
        print(f'  {name:<{width}}  {losses[0]:10.6f}  {losses[-1]:10.6f}  {speed:8.0f}')
    failed = False
    for actual, expected in pairs:
        a = torch.tensor(runs[actual][0], dtype=torch.float64)
        e = torch.tensor(runs[expected][0], dtype=torch.float64)
        relative = float(((a - e).abs() / e.abs()).max())
        ok = relative <= RTOL
        failed |= not ok
        print(f'  {"OK" if ok else "FAIL"}: {actual} vs {expected}: '
              f'max relative loss difference {relative:.1e}')
    if failed:
        print(f'FAIL: losses differ by more than rtol={RTOL:g}', file=sys.stderr)
        return 1
    print('OK: GPipe trains the flattened GPT like the module, on both paths')
    return 0


if __name__ == '__main__':
    sys.exit(main())

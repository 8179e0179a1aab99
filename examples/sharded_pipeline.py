"""A Llama-style model no rank builds whole: a pipeline of FSDP2-sharded stages.

Every process runs this same script, on a DeviceMesh of ``pp x dp`` ranks. The
model (an ordinary module: token embedding, decoder blocks with rotary
attention and a SwiGLU MLP, RMSNorm, output head) is built on the meta
device, so no memory is taken for any weight, flattened by
:func:`torchgpipe.to_sequential` (each block one child), and split by
:class:`~torchgpipe.distributed.DistributedGPipe` over the mesh's ``pp``
dimension. Each rank shards its own blocks over ``dp`` with ``fully_shard``
and materializes its shards alone: ``pipe.to_empty()``, then either their
first values (a function of each parameter's name, one layer at a time) or
a DCP checkpoint. Each dp rank reads its own shard of the data through a
DistributedSampler; each step clips the gradients by their norm over every
rank, and a checkpoint of the model and the optimizer is saved at the end.

On CPU, four processes over gloo on one machine::

    torchrun --nproc_per_node 4 examples/sharded_pipeline.py --checkpoint-dir ckpt
    torchrun --nproc_per_node 4 examples/sharded_pipeline.py --checkpoint-dir ckpt --resume

``--verify`` also trains the unwrapped model (in float64, on every rank,
from the same first values and the same global batches) and checks each
step's loss against the pipeline's (``rtol=1e-9``); the script exits with
status 1 otherwise.
"""
import argparse
import math
import os
import sys
import zlib
from typing import NoReturn, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchgpipe import to_sequential
from torchgpipe.balance.blockpartition import solve
from torchgpipe.distributed import DistributedGPipe

VOCABULARY = 64
# Optimizer states under the parameters' names, which any mesh and balance share.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class Attention(nn.Module):
    """Causal self-attention with rotary position embeddings (computed, not stored)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        half = d // self.heads // 2
        frequencies = 10000.0 ** (-torch.arange(half, dtype=x.dtype, device=x.device) / half)
        angles = torch.arange(t, dtype=x.dtype, device=x.device)[:, None] * frequencies
        cos, sin = angles.cos(), angles.sin()

        def rotate(y: Tensor) -> Tensor:
            y1, y2 = y[..., :half], y[..., half:]
            return torch.cat([y1 * cos - y2 * sin, y1 * sin + y2 * cos], dim=-1)
        out = F.scaled_dot_product_attention(rotate(q), rotate(k), v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    """A decoder block: attention and a SwiGLU MLP, each after an RMSNorm, with residuals."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.mlp_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.w1, self.w3 = nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False)
        self.w2 = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x))
        y = self.mlp_norm(h)
        return h + self.w2(F.silu(self.w1(y)) * self.w3(y))


class Llama(nn.Module):
    """Token ids to next-token logits."""

    def __init__(self, layers: int, dim: int, heads: int) -> None:
        super().__init__()
        self.embedding = nn.Embedding(VOCABULARY, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, VOCABULARY, bias=False)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embedding(ids)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def first_value(name: str, like: Tensor) -> Tensor:
    """A parameter's first value, from its name alone: any rank makes any one of them."""
    if 'norm' in name:
        return torch.ones(like.shape, dtype=like.dtype)
    generator = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    return torch.randn(like.shape, generator=generator, dtype=like.dtype) * 0.02


def batches(steps: int, batch_size: int, length: int) -> TensorDataset:
    """Every step's sequences, each repeating a random pattern of 4 tokens."""
    generator = torch.Generator().manual_seed(0)
    pattern = torch.randint(0, VOCABULARY, (steps * batch_size, 4), generator=generator)
    return TensorDataset(pattern.repeat(1, (length + 3) // 4)[:, :length])


def next_token_loss(logits: Tensor, ids: Tensor) -> Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--steps', type=int, default=4, help='training steps of this run')
    parser.add_argument('--pp', type=int, default=2, help='pipeline ranks (the rest: dp)')
    parser.add_argument('--layers', type=int, default=4, help='decoder blocks of the model')
    parser.add_argument('--dim', type=int, default=32, help='width of the model')
    parser.add_argument('--heads', type=int, default=4, help='attention heads')
    parser.add_argument('--batch-size', type=int, default=16, help='global sequences a step')
    parser.add_argument('--length', type=int, default=16, help='tokens per sequence')
    parser.add_argument('--chunks', type=int, default=4, help='micro-batches per dp rank')
    parser.add_argument('--schedule', default='1f1b', help="a built-in schedule's name")
    parser.add_argument('--max-norm', type=float, default=1.0, help='gradient clipping')
    parser.add_argument('--checkpoint-dir', default=None,
                        help='where a checkpoint is saved after the last step (step-N)')
    parser.add_argument('--resume', action='store_true',
                        help="start from --checkpoint-dir's last checkpoint")
    parser.add_argument('--verify', action='store_true',
                        help="check each step's loss against the unwrapped model's")
    return parser.parse_args(argv)


def latest(directory: Optional[str]) -> str:
    """The checkpoint of the last step saved in ``directory`` (one ``step-N`` each)."""
    steps = [int(name[5:]) for name in os.listdir(directory or '.')
             if name.startswith('step-') and name[5:].isdigit()]
    if not directory or not steps:
        raise SystemExit(f'--resume needs a checkpoint in --checkpoint-dir ({directory})')
    return os.path.join(directory, f'step-{max(steps)}')


def end_job(status: int) -> NoReturn:
    """Ends this process once every rank is done, without Python's shutdown (which can
    abort in gloo's threads; see examples/ddp_pipeline.py)."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: Optional[Sequence[str]] = None) -> NoReturn:
    args = parse_args(argv)
    torch.set_default_dtype(torch.float64)
    dist.init_process_group('gloo')
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.pp or args.batch_size % (world // args.pp):
        raise SystemExit(f'--pp {args.pp} must divide the {world} processes, and the dp '
                         f'size {world // args.pp} the batch size {args.batch_size}')
    mesh = init_device_mesh('cpu', (args.pp, world // args.pp), mesh_dim_names=('pp', 'dp'))

    with torch.device('meta'):  # shapes only: no rank holds the model whole
        sequential = to_sequential(Llama(args.layers, args.dim, args.heads),
                                   leaf_modules=[Block])
    names = {seq: plain for plain, seq in sequential.state_dict_map.items()}
    sizes = [sum(p.numel() for p in child.parameters()) for child in sequential.children()]
    balance = [len(part) for part in solve(sizes, args.pp)]
    pipe = DistributedGPipe(sequential, balance, chunks=args.chunks,
                            group=mesh['pp'].get_group())
    for layer in pipe.children():  # this rank's layers, each an FSDP2 unit
        if any(True for _ in layer.parameters()):
            fully_shard(layer, mesh=mesh['dp'], reshard_after_forward=False)
    pipe.to_empty()  # memory for this rank's shards, values to come
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    start = 0
    if args.resume:
        model_state, optimizer_state = get_state_dict(pipe, optimizer, options=OPTIONS)
        state = {'model': model_state, 'optimizer': optimizer_state, 'step': torch.tensor(0)}
        dcp.load(state, checkpoint_id=latest(args.checkpoint_dir))
        set_state_dict(pipe, optimizer, model_state_dict=state['model'],
                       optim_state_dict=state['optimizer'], options=OPTIONS)
        start = int(state['step'])
    else:
        full = StateDictOptions(full_state_dict=True, strict=False)
        for name, layer in pipe.named_children():  # one layer's whole values at a time
            set_model_state_dict(layer, {k: first_value(names[f'{name}.{k}'], p)
                                         for k, p in layer.state_dict().items()}, options=full)
    held = sum(p.to_local().numel() if hasattr(p, 'to_local') else p.numel()
               for p in pipe.parameters())
    line = (f'rank {rank} (pp {mesh.get_local_rank("pp")}, dp {mesh.get_local_rank("dp")}): '
            f'layers {", ".join(dict(pipe.named_children()))}; holds {held:,} of '
            f'{sum(sizes):,} parameters ({held / sum(sizes):.0%})')
    lines = [''] * world
    dist.all_gather_object(lines, line)  # printed by rank 0, in order
    if rank == 0:
        print('\n'.join(lines), flush=True)

    plain = None
    if args.verify:  # the unwrapped model, from the same first values
        plain = Llama(args.layers, args.dim, args.heads)
        plain.load_state_dict({n: first_value(n, p) for n, p in plain.state_dict().items()})
        plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=3e-3)

    data = batches(start + args.steps, args.batch_size, args.length)
    sampler = DistributedSampler(data, num_replicas=mesh['dp'].size(),
                                 rank=mesh.get_local_rank('dp'), shuffle=False)
    loader = DataLoader(data, batch_size=args.batch_size // mesh['dp'].size(), sampler=sampler)
    status, final = 0, float('nan')
    for step, (ids,) in enumerate(loader):
        if plain is not None:  # the global batch: every dp rank's rows of this step
            whole = data.tensors[0][step * args.batch_size:(step + 1) * args.batch_size]
            plain_optimizer.zero_grad()
            plain_loss = next_token_loss(plain(whole), whole)
            plain_loss.backward()
            expected = plain_loss.item()
            nn.utils.clip_grad_norm_(plain.parameters(), args.max_norm)
            plain_optimizer.step()
        if step < start:  # steps the checkpoint has taken
            continue
        optimizer.zero_grad()
        loss = pipe.train_step(ids, ids, next_token_loss, schedule=args.schedule)
        norm = pipe.clip_grad_norm_(args.max_norm)
        optimizer.step()
        dist.all_reduce(loss, group=mesh['dp'].get_group())  # each dp rank's: the mean
        loss /= mesh['dp'].size()
        final = float(loss)
        line = f'step {step + 1}: loss {final:.9f}, gradient norm {float(norm):.6f}'
        if plain is not None:
            same = math.isclose(float(loss), expected, rel_tol=1e-9)
            status = status or int(not same)
            line += f' (unwrapped: {expected:.9f}{"" if same else ", DIFFERENT"})'
        if rank == 0:
            print(line, flush=True)
    if args.checkpoint_dir:
        model_state, optimizer_state = get_state_dict(pipe, optimizer, options=OPTIONS)
        path = os.path.join(args.checkpoint_dir, f'step-{start + args.steps}')
        dcp.save({'model': model_state, 'optimizer': optimizer_state,
                  'step': torch.tensor(start + args.steps)}, checkpoint_id=path)
        if rank == 0:
            print(f'saved after step {start + args.steps} in {path}', flush=True)
    failed = torch.tensor(status)
    dist.all_reduce(failed)  # any rank's difference fails every rank
    ran = (f'{args.steps} steps from step {start} of DistributedGPipe x FSDP2 on pp {args.pp} '
           f'x dp {mesh["dp"].size()}, built on the meta device, schedule {args.schedule!r}, '
           f'final loss {final:.6f}')
    if rank == 0:
        print(f'FAILED: a loss differs from the unwrapped model\'s ({ran})' if failed else
              f"OK: the losses are the unwrapped model's ({ran})" if args.verify else
              f'Done: {ran}', flush=True)
    end_job(int(bool(failed)))


if __name__ == '__main__':
    main()

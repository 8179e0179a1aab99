"""A pipeline whose partitions are processes: DistributedGPipe under torchrun.

Every process runs this same script. It builds the same model (same seed),
keeps its own partition of it (rank ``r`` holds partition ``r``), and trains
the whole pipeline with :meth:`~torchgpipe.distributed.DistributedGPipe.train_step`:
activations go forward and gradients back between the processes by
torch.distributed's point-to-point operations, micro-batch by micro-batch,
in the order of a schedule: ``--schedule`` takes every built-in one, written
as you like (``1F1B``, ``fill-drain``, ``ZB-H1``, ``interleaved_1f1b``,
``zbv``). The last two give each rank two partitions: in a loop (rank ``r``
holds ``r`` and ``r + size``) for interleaved 1F1B, in a V (``r`` and
``2 size - 1 - r``, ``--placement v``, which ``zbv`` implies) for ZBV. Every
rank reads the same batches.
Then it evaluates the model on held-out batches with
:meth:`~torchgpipe.distributed.DistributedGPipe.eval_step`: the loss on
every rank, the logits on the last rank. With ``--generate N``, it also
trains a tiny causal language model, whose token embedding and output head
share their weight across the first rank and the last, to count, and lets
it continue prompts by ``N`` tokens with :func:`torchgpipe.generate`.

On CPU, two processes over gloo on one machine::

    torchrun --nproc_per_node 2 examples/distributed_pipeline.py

On GPUs (one per process, NCCL)::

    torchrun --nproc_per_node 4 examples/distributed_pipeline.py --gpus

A checkpoint is saved every ``--save-every`` steps in ``--checkpoint-dir``
(one file per rank, with the keys of the unwrapped model); a restarted job
resumes from it, as ``torchrun --max-restarts 3`` restarts one after a rank
fails. ``--verify`` also trains the unwrapped model on rank 0 (in float64)
and checks that its losses and its evaluation (and the generated tokens)
are the pipeline's.
"""
import argparse
import functools
import os
import sys
from pathlib import Path
from typing import Callable, Dict, List, NoReturn, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from torchgpipe import generate
from torchgpipe.distributed import DistributedGPipe
from torchgpipe.schedules import NAMES, built_in

FEATURES = 32
CLASSES = 4
VOCABULARY = 16
LM_STEPS = 40
PROMPTS = torch.tensor([[3, 4, 5], [10, 11, 12]])


def say(line: str) -> None:
    """Print one line in one write: ranks share torchrun's stdout, and print()
    writes a line and its newline apart when Python runs unbuffered
    (``python -u``, PYTHONUNBUFFERED), so another rank's line could land in
    between."""
    sys.stdout.write(line + '\n')
    sys.stdout.flush()


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or '').splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument('--steps', type=int, default=20, help='training steps')
    parser.add_argument('--batch-size', type=int, default=64,
                        help='mini-batch size, the same batch on every rank')
    parser.add_argument('--chunks', type=int, default=8, help='micro-batches per mini-batch')
    parser.add_argument('--schedule', choices=NAMES, default='1f1b',
                        type=lambda text: built_in(text) or text,
                        help='order of the forward and backward passes (case, - and _ do '
                        "not count: '1F1B', 'ZB-H1')")
    parser.add_argument('--placement', choices=['loop', 'v'],
                        help="how the ranks hold their partitions; unset, as --schedule "
                        "implies: 'v' (two per rank, in a "
                        "V) for zbv, which implies it, 'loop' for the others (two per rank "
                        'for interleaved_1f1b, else one)')
    parser.add_argument('--checkpoint', choices=['always', 'except_last', 'never'],
                        default='except_last', help='which micro-batches are recomputed')
    parser.add_argument('--checkpoint-dir', type=Path,
                        help='where to save and resume from; unset, nothing is saved')
    parser.add_argument('--save-every', type=int, default=10,
                        help='save a checkpoint every this many steps')
    parser.add_argument('--gpus', action='store_true', help='one GPU per process, NCCL')
    parser.add_argument('--verify', action='store_true',
                        help='compare the losses with the unwrapped model (float64)')
    parser.add_argument('--generate', type=int, default=0, metavar='N',
                        help='also train a tiny language model, and generate N tokens')
    args = parser.parse_args(argv)
    implied = 'v' if args.schedule == 'zbv' else 'loop'
    if args.placement not in (None, implied):
        parser.error(f'--placement {args.placement} does not fit --schedule {args.schedule}: '
                     f"'zbv' runs its two partitions per rank in a V (--placement v), the "
                     f"others in a loop (--placement loop); leave --placement out")
    args.placement = implied
    return args


def partitions_per_rank(schedule: str) -> int:
    """Interleaved 1F1B and ZBV run two partitions per rank; the others one."""
    return 2 if schedule in ('interleaved_1f1b', 'zbv') else 1


def held(placement: str, per_rank: int, world_size: int) -> str:
    """Which partitions rank ``r`` holds, in words."""
    if per_rank == 1:
        return 'rank r holds partition r'
    if placement == 'v':
        return f'rank r holds partitions r and {2 * world_size - 1} - r, a V'
    return f'rank r holds partitions r and r + {world_size}, a loop'


def make_model(layers: int) -> nn.Sequential:
    """``layers`` blocks, then a classifier: the same weights on every rank."""
    torch.manual_seed(0)
    blocks: List[nn.Module] = [nn.Linear(FEATURES, FEATURES)]
    for _ in range(layers - 2):
        blocks += [nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh())]
    blocks.append(nn.Linear(FEATURES, CLASSES))
    return nn.Sequential(*blocks)


class CausalBlock(nn.Module):
    """A Transformer layer whose positions see only the ones before them."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=0.0,
                                                batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(x.size(1), dtype=x.dtype)
        return self.layer(x, src_mask=mask, is_causal=True)


def make_language_model(blocks: int) -> nn.Sequential:
    """Token ids to logits; the head shares its weight with the embedding."""
    torch.manual_seed(0)
    embedding, head = nn.Embedding(VOCABULARY, FEATURES), nn.Linear(FEATURES, VOCABULARY)
    head.weight = embedding.weight  # tied, across the first rank and the last
    return nn.Sequential(embedding, *[CausalBlock(FEATURES) for _ in range(blocks)], head)


def counting(step: int, size: int, length: int = 8) -> Tensor:
    """Sequences that count up, modulo the vocabulary: the next token is the last plus one."""
    start = torch.randint(0, VOCABULARY, (size, 1), generator=torch.Generator().manual_seed(step))
    return (start + torch.arange(length)) % VOCABULARY


def greedy(model: nn.Module, ids: Tensor, new: int) -> Tensor:
    """The unwrapped model's greedy continuation, for --verify."""
    model.eval()
    with torch.no_grad():
        for _ in range(new):
            ids = torch.cat([ids, model(ids)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids


def token_loss(logits: Tensor, target: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def train_language_model(model: nn.Module, step_fn: Callable[..., Tensor],
                         size: int) -> List[float]:
    """Trains to count; returns the losses."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for step in range(LM_STEPS):
        ids = counting(step, size)
        optimizer.zero_grad()
        losses.append(float(step_fn(ids[:, :-1], ids[:, 1:], token_loss)))
        optimizer.step()
    return losses


def language_model_part(args: argparse.Namespace, rank: int, world_size: int,
                        device: torch.device, dtype: torch.dtype) -> bool:
    """Trains the language model over the ranks, then generates; False if --verify fails."""
    per_rank = partitions_per_rank(args.schedule)
    balance = [2 // per_rank] * (world_size * per_rank)
    balance[0] += 1   # the embedding
    balance[-1] += 1  # the head
    pipe = DistributedGPipe(make_language_model(2 * world_size).to(dtype), balance,
                            chunks=args.chunks, checkpoint=args.checkpoint, device=device,
                            placement=args.placement)
    losses = train_language_model(pipe, functools.partial(
        pipe.train_step, schedule=args.schedule), args.batch_size)
    tokens = generate(pipe, PROMPTS, args.generate)  # every rank gets them
    if rank != 0:
        return True
    for row in tokens.tolist():
        say(f'generated: {" ".join(map(str, row[:PROMPTS.size(1)]))} -> '
            f'{" ".join(map(str, row[PROMPTS.size(1):]))} (language model loss '
            f'{losses[0]:.3f} -> {losses[-1]:.3f})')
    if not args.verify:
        return True
    plain = make_language_model(2 * world_size).to(dtype)

    def plain_step(input: Tensor, target: Tensor, loss_fn: Callable[..., Tensor]) -> Tensor:
        loss = loss_fn(plain(input), target)
        loss.backward()
        return loss.detach()
    same = torch.allclose(torch.tensor(losses),
                          torch.tensor(train_language_model(plain, plain_step, args.batch_size)),
                          rtol=1e-9) and torch.equal(tokens, greedy(plain, PROMPTS, args.generate))
    say(f"{'OK' if same else 'FAILED'}: the language model's {LM_STEPS} losses and "
        f"generated tokens are {'' if same else 'not '}the unwrapped model's")
    return same


def batch(step: int, size: int) -> List[Tensor]:
    """The step's batch: the same on every rank."""
    gen = torch.Generator().manual_seed(step)
    input = torch.randn(size, FEATURES, generator=gen)
    return [input, (input[:, :CLASSES].sum(1) > 0).long() + 2 * (input[:, 0] > 1).long()]


def end_job(status: int) -> NoReturn:
    """Ends the process once every rank is done (see "Ending a job" in the docs)."""
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    if args.gpus and not torch.cuda.is_available():
        print('--gpus needs CUDA, but no CUDA device is visible', file=sys.stderr)
        return 2
    local_rank = int(os.environ.get('LOCAL_RANK', 0))
    if args.gpus:
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(1)  # the processes share the CPU cores
    dist.init_process_group('nccl' if args.gpus else 'gloo')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank) if args.gpus else torch.device('cpu')

    layers = 2 * world_size + 2
    per_rank = partitions_per_rank(args.schedule)
    balance = [2 // per_rank] * (world_size * per_rank)
    balance[-1] += 2
    dtype = torch.float64 if args.verify else torch.float32
    pipe = DistributedGPipe(make_model(layers).to(dtype), balance, chunks=args.chunks,
                            checkpoint=args.checkpoint, device=device,
                            placement=args.placement)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    if rank == 0:
        backend = 'NCCL, one GPU each' if args.gpus else 'gloo, on CPU'
        say(f'DistributedGPipe over {world_size} processes ({backend}): a model of '
            f'{layers} layers, balance {balance} '
            f'({held(args.placement, per_rank, world_size)}), '
            f'chunks={args.chunks}, schedule {args.schedule!r}, '
            f'checkpoint={args.checkpoint!r}; {args.steps} steps of batch '
            f'{args.batch_size}')

    start = 0
    resumed: Dict[str, Tensor] = {}
    saved: Optional[Path] = None
    if args.checkpoint_dir is not None:
        saved = args.checkpoint_dir / f'rank{rank}.pt'
    if saved is not None and saved.exists():
        state = torch.load(saved)
        pipe.load_state_dict(state['model'])
        optimizer.load_state_dict(state['optimizer'])
        start = state['step']
        if rank == 0:
            say(f'resumed from step {start}')
            # The checkpoints of all ranks together: the unwrapped model's state dict.
            for path in sorted(saved.parent.glob('rank*.pt')):
                resumed.update(torch.load(path)['model'])

    losses = []
    for step in range(start, args.steps):
        input, target = batch(step, args.batch_size)
        optimizer.zero_grad()
        loss = pipe.train_step(input.to(dtype), target, F.cross_entropy,
                               schedule=args.schedule)
        optimizer.step()
        losses.append(float(loss))
        if rank == 0:
            say(f'step {step}: loss {float(loss):.4f}')
        if saved is not None and (step + 1) % args.save_every == 0:
            saved.parent.mkdir(parents=True, exist_ok=True)
            torch.save({'model': pipe.state_dict(), 'optimizer': optimizer.state_dict(),
                        'step': step + 1}, saved)

    # Evaluation: forward only, in eval mode, on every rank. The loss comes
    # back on every rank; the logits on the last partition's rank alone.
    val_input, val_target = batch(-1, args.batch_size)
    val_input = val_input.to(dtype)
    val_loss = pipe.eval_step(val_input, val_target, F.cross_entropy)
    logits = pipe.eval_step(val_input)
    if logits is not None:
        accuracy = (logits.argmax(1) == val_target.to(logits.device)).float().mean()
        say(f'rank {rank} (the last partition): held-out loss {float(val_loss):.4f}, '
            f'accuracy {float(accuracy):.1%}')

    status = 0
    if args.generate and not language_model_part(args, rank, world_size, device, dtype):
        status = 1
    if rank == 0:
        ran = (f'{len(losses)} steps of DistributedGPipe over {world_size} processes, '
               f'schedule {args.schedule!r}, final loss {losses[-1]:.4f}' if losses else
               f'no step to run (the checkpoint is at step {start} of {args.steps})')
    if args.verify:
        pipe_logits = pipe.eval_step(val_input, everywhere=True)
    if args.verify and rank == 0:
        plain = make_model(layers).to(dtype)
        if resumed:
            plain.load_state_dict(resumed)
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=0.1)
        expected = []
        for step in range(start, args.steps):
            input, target = batch(step, args.batch_size)
            plain_optimizer.zero_grad()
            loss = F.cross_entropy(plain(input.to(dtype)), target)
            loss.backward()
            plain_optimizer.step()
            expected.append(loss.item())
        plain.eval()
        with torch.no_grad():
            plain_logits = plain(val_input)
        expected.append(F.cross_entropy(plain_logits, val_target).item())
        losses.append(float(val_loss))
        # With everywhere=True every rank gets the logits: compared here, on rank 0.
        same = torch.allclose(torch.tensor(losses), torch.tensor(expected), rtol=1e-9) and \
            torch.allclose(pipe_logits, plain_logits, rtol=1e-9)
        say(f"{'OK' if same else 'FAILED'}: the losses of {len(losses) - 1} steps and the "
            f"evaluation are {'' if same else 'not '}the unwrapped model's ({ran})")
        status = status if same else 1
    elif rank == 0:
        say(f'Done: {ran}; --verify compares the losses with the unwrapped model')
    end_job(status)


if __name__ == '__main__':
    sys.exit(main())

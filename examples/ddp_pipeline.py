"""Data-parallel replicas of a GPipe pipeline: DistributedDataParallel over GPipe.

Each process holds one replica of the whole model, split by :class:`torchgpipe.GPipe`
into a pipeline of partitions; :class:`~torch.nn.parallel.DistributedDataParallel`
averages the gradients of the replicas, so they all stay identical. Every replica trains
on its own shard of the data (:class:`~torch.utils.data.DistributedSampler`), so the
global batch is ``--batch-size`` times the number of processes, and each replica splits
its batch into ``--chunks`` micro-batches.

On CPU (the default), every replica is a pipeline of ``--partitions`` partitions on
``devices=['cpu'] * partitions`` and the processes talk over gloo::

    torchrun --nproc_per_node 2 examples/ddp_pipeline.py

On GPUs, give each replica ``--gpus-per-replica N`` devices: the process with local rank
``r`` owns ``cuda:r*N`` to ``cuda:r*N+N-1`` (one partition per GPU) and the processes talk
over NCCL. Two replicas of a 4-GPU pipeline on one 8-GPU machine::

    torchrun --nproc_per_node 2 examples/ddp_pipeline.py --gpus-per-replica 4

The same on two such machines (four replicas), run on each machine with its own
``--node_rank``::

    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 2 \\
        --master_addr 10.0.0.1 --master_port 29500 \\
        examples/ddp_pipeline.py --gpus-per-replica 4

Run without torchrun (``python examples/ddp_pipeline.py``), it trains a single replica.
The data is synthetic: ``CLASSES`` overlapping Gaussian blobs. Rank 0 prints the training
loss averaged over all replicas and the last ``--log-interval`` steps, and at the end the
test accuracy and whether the replicas' parameters are still identical.
"""
import argparse
import os
import socket
import sys
import time
from typing import List, NoReturn, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from torchgpipe import GPipe

FEATURES = 32
HIDDEN = 128
CLASSES = 10
BLOCKS = 4            # Linear + BatchNorm1d + ReLU blocks before the classifier
TRAIN_SAMPLES = 16384
TEST_SAMPLES = 2048
NOISE = 1.5


def make_dataset(seed: int) -> Tuple[TensorDataset, TensorDataset]:
    """Synthetic classification data, the same in every process (generated from ``seed``).

    Each class is a Gaussian blob around its own random centre; the blobs overlap, so
    the test accuracy stays below 100%.
    """
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=gen)

    def sample(count: int) -> TensorDataset:
        y = torch.randint(0, CLASSES, (count,), generator=gen)
        x = centres[y] + NOISE * torch.randn(count, FEATURES, generator=gen)
        return TensorDataset(x, y)

    return sample(TRAIN_SAMPLES), sample(TEST_SAMPLES)


def make_model() -> nn.Sequential:
    """A flat MLP: ``BLOCKS`` × (Linear, BatchNorm1d, ReLU), then a Linear classifier."""
    layers: List[nn.Module] = []
    width = FEATURES
    for _ in range(BLOCKS):
        layers += [nn.Linear(width, HIDDEN), nn.BatchNorm1d(HIDDEN), nn.ReLU()]
        width = HIDDEN
    layers.append(nn.Linear(width, CLASSES))
    return nn.Sequential(*layers)


def even_balance(layers: int, partitions: int) -> List[int]:
    """Splits ``layers`` layers into ``partitions`` contiguous, nearly equal parts."""
    if not 1 <= partitions <= layers:
        raise ValueError(f'cannot split {layers} layers into {partitions} partitions')
    base, extra = divmod(layers, partitions)
    return [base + (1 if j < extra else 0) for j in range(partitions)]


def replica_devices(args: argparse.Namespace, local_rank: int) -> List[torch.device]:
    """The devices of this process's pipeline: one per partition.

    On GPUs, local rank ``r`` owns ``cuda:r*N`` to ``cuda:r*N+N-1`` for ``N`` GPUs per
    replica; the processes of one machine must not share a GPU.
    """
    if args.gpus_per_replica == 0:
        return [torch.device('cpu')] * args.partitions
    n = args.gpus_per_replica
    needed = (local_rank + 1) * n
    available = torch.cuda.device_count()
    if available < needed:
        raise RuntimeError(f'local rank {local_rank} needs cuda:{local_rank * n} to '
                           f'cuda:{needed - 1}, but {available} CUDA devices are visible: '
                           f'run at most {available // n} processes per machine '
                           f'(--nproc_per_node) with --gpus-per-replica {n}')
    return [torch.device('cuda', local_rank * n + k) for k in range(n)]


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a single process run without torchrun."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(('127.0.0.1', 0))
        port: int = sock.getsockname()[1]
        return port


def init_distributed(backend: str) -> Tuple[int, int]:
    """Joins the process group torchrun describes; returns ``(rank, world size)``.

    Without torchrun's environment variables, this is a group of one process.
    """
    if 'RANK' not in os.environ:
        dist.init_process_group(backend, init_method=f'tcp://127.0.0.1:{free_port()}',
                                rank=0, world_size=1)
        return 0, 1
    dist.init_process_group(backend)  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    return dist.get_rank(), dist.get_world_size()


def global_mean(value: Tensor, device: torch.device) -> float:
    """The mean of a scalar over all replicas."""
    total = value.detach().reshape(1).to(device, torch.float64)
    dist.all_reduce(total)
    return float(total) / dist.get_world_size()


def replicas_identical(model: nn.Module, device: torch.device) -> bool:
    """Whether every parameter is bitwise the same on every replica (via max == min)."""
    flat = torch.cat([p.detach().reshape(-1).to(device, torch.float64)
                      for p in model.parameters()])
    high, low = flat.clone(), flat.clone()
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    return torch.equal(high, low)


@torch.no_grad()
def accuracy(model: GPipe, dataset: TensorDataset) -> float:
    """Accuracy of this replica on ``dataset``, in eval mode (running BatchNorm statistics)."""
    model.eval()
    x, y = dataset.tensors
    correct = 0
    for start in range(0, len(x), 512):
        output = model(x[start:start + 512].to(model.devices[0]))
        correct += int((output.argmax(dim=1).cpu() == y[start:start + 512]).sum())
    model.train()
    return correct / len(x)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line."""
    parser = argparse.ArgumentParser(
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description='Train data-parallel replicas of a GPipe pipeline with '
                    'DistributedDataParallel. Launch with torchrun, e.g. '
                    '"torchrun --nproc_per_node 2 examples/ddp_pipeline.py".')
    parser.add_argument('--steps', type=int, default=300,
                        help='training steps')
    parser.add_argument('--batch-size', type=int, default=64,
                        help='mini-batch size per replica; the global batch is this times '
                             'the number of processes')
    parser.add_argument('--chunks', type=int, default=4,
                        help='micro-batches per replica mini-batch')
    parser.add_argument('--checkpoint', choices=['always', 'except_last', 'never'],
                        default='except_last',
                        help='GPipe checkpoint mode')
    parser.add_argument('--gpus-per-replica', type=int, default=0, metavar='N',
                        help='CUDA devices per pipeline replica, one partition each, over '
                             'NCCL; local rank r uses cuda:r*N..r*N+N-1; 0 trains on CPU '
                             'over gloo')
    parser.add_argument('--partitions', type=int, default=2,
                        help='partitions of each replica on CPU; with '
                             '--gpus-per-replica N there are N')
    parser.add_argument('--lr', type=float, default=0.05,
                        help='SGD learning rate')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed of the data, the weights and the shuffling')
    parser.add_argument('--log-interval', type=int, default=50,
                        help='print the loss every this many steps')
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error('--steps must be at least 1')
    if not 1 <= args.batch_size <= TRAIN_SAMPLES // 2:
        parser.error(f'--batch-size must be between 1 and {TRAIN_SAMPLES // 2}')
    if args.chunks < 1:
        parser.error('--chunks must be at least 1')
    if args.gpus_per_replica < 0:
        parser.error('--gpus-per-replica must not be negative')
    if args.gpus_per_replica > 0:
        args.partitions = args.gpus_per_replica
    if not 1 <= args.partitions <= 3 * BLOCKS + 1:
        parser.error(f'--partitions must be between 1 and {3 * BLOCKS + 1} (the layers)')
    if args.log_interval < 1:
        parser.error('--log-interval must be at least 1')
    return args


def train(args: argparse.Namespace, devices: List[torch.device], rank: int,
          world_size: int) -> bool:
    """Trains this process's replica; returns whether all replicas ended identical."""
    train_set, test_set = make_dataset(args.seed)

    # The same initial weights everywhere (DDP also broadcasts rank 0's at creation).
    torch.manual_seed(args.seed)
    model = make_model()
    balance = even_balance(len(model), len(devices))
    gpipe = GPipe(model, balance, devices=devices, chunks=args.chunks,
                  checkpoint=args.checkpoint, deferred_batch_norm=True)
    # A pipeline spans several devices: DDP must not be given device_ids.
    ddp = DistributedDataParallel(gpipe)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr, momentum=0.9)

    sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank,
                                 shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler,
                        drop_last=True)
    in_device, out_device = gpipe.devices[0], gpipe.devices[-1]
    comm_device = devices[0]

    # One write per line: the processes share the terminal.
    sys.stdout.write(f'rank {rank}/{world_size}: devices '
                     f'{[str(d) for d in gpipe.devices]}, balance {gpipe.balance}\n')
    sys.stdout.flush()
    if rank == 0:
        print(f'{world_size} replica(s) x batch {args.batch_size} = global batch '
              f'{world_size * args.batch_size}; chunks={args.chunks} '
              f'(micro-batch {-(-args.batch_size // args.chunks)}), '
              f'checkpoint={args.checkpoint!r}, {args.steps} steps', flush=True)

    step = 0
    epoch = 0
    running_loss = torch.zeros((), device=out_device)
    since_log = 0
    start = time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)  # a different shuffle every epoch, agreed by all ranks
        for x, y in loader:
            x = x.to(in_device, non_blocking=True)
            y = y.to(out_device, non_blocking=True)

            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()  # DDP all-reduces the gradients during the backward pass
            optimizer.step()

            step += 1
            running_loss += loss.detach()
            since_log += 1
            if step % args.log_interval == 0 or step == args.steps:
                mean_loss = global_mean(running_loss / since_log, comm_device)
                running_loss.zero_()
                since_log = 0
                if rank == 0:
                    print(f'step {step:4d}/{args.steps}  epoch {epoch}  '
                          f'loss {mean_loss:.4f}', flush=True)
            if step == args.steps:
                break
        epoch += 1
    elapsed = time.perf_counter() - start

    identical = replicas_identical(gpipe, comm_device)
    if rank == 0:
        samples = args.steps * args.batch_size * world_size
        print(f"{'OK' if identical else 'FAIL'}: {world_size} replica(s) of a "
              f'{len(gpipe.partitions)}-partition GPipe pipeline trained {args.steps} steps '
              "under DistributedDataParallel and their parameters are "
              f"{'' if identical else 'not '}"
              f'identical; test accuracy {accuracy(gpipe, test_set):.2%} (rank 0), '
              f'{samples / elapsed:.0f} samples/s over all replicas', flush=True)
    return identical


def end_job(status: int) -> NoReturn:
    """Ends this process with exit status ``status``, once every rank is done.

    Returning from ``main`` and letting Python exit fails in a few runs out of a
    hundred, after the work is done: the rank dies of SIGABRT ("terminate called
    without an active exception") or hangs. A gloo thread may still be freeing the
    last all-reduce of the backward pass, and that needs the GIL (PyTorch's
    backward stores a Python object in every collective it launches). If Python is
    shutting down by then, it ends the thread inside a C++ destructor: SIGABRT. If
    the DDP model, holding the last reference to the process group (after
    ``destroy_process_group``), is freed by then, the group's destructor joins
    gloo's threads while holding the GIL: a hang. ``os._exit`` waits for no
    thread and frees nothing, so this ending does not destroy the group either.
    """
    dist.barrier()  # every rank is past its last collective
    # os._exit skips Python's shutdown: flush what the process wrote.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Trains this process's replica and ends the process (see :func:`end_job`).

    Returns:
        an exit status, only on an error found before joining the process group
    """
    args = parse_args(argv)
    on_gpu = args.gpus_per_replica > 0
    if on_gpu and not torch.cuda.is_available():
        print('--gpus-per-replica needs CUDA, but no CUDA device is visible', file=sys.stderr)
        return 2
    # torchrun numbers the processes of each machine 0, 1, ... in LOCAL_RANK.
    devices = replica_devices(args, int(os.environ.get('LOCAL_RANK', 0)))
    if on_gpu:
        # NCCL works on the current device: make it this replica's first GPU.
        torch.cuda.set_device(devices[0])
    else:
        # The processes share the CPU cores: one intra-op thread each.
        torch.set_num_threads(1)

    rank, world_size = init_distributed('nccl' if on_gpu else 'gloo')
    try:
        identical = train(args, devices, rank, world_size)
    except BaseException:
        # The error ends the job anyway (torchrun stops the other ranks, stuck in a
        # collective): leave the usual way, with the traceback.
        dist.destroy_process_group()
        raise
    end_job(0 if identical else 1)


if __name__ == '__main__':
    sys.exit(main())

"""Train a small CNN with GPipe on CPU and check it matches plain PyTorch.

The demo generates a synthetic 10-class image dataset from a fixed seed (each class
has its own spatial colour pattern, drawn with random shifts and Gaussian noise), then
trains the same convolutional network twice with plain SGD:

1. wrapped in :class:`torchgpipe.GPipe` over four CPU partitions (``devices=['cpu'] * 4``)
   with the mini-batch split into micro-batches (``--chunks``, default 8), and
2. unwrapped, as the original :class:`~torch.nn.Sequential`, from a deep copy of the
   same initial weights, on the same mini-batches in the same order.

GPipe is transparent: both runs must produce the same loss at every step. The demo
prints a small comparison table and exits with status 1 if the losses differ by more
than a tight tolerance (``rtol=1e-5``, ``atol=1e-6``).

Everything runs in float64. The forward pass of a micro-batch is the forward pass of
those samples, but GPipe accumulates each parameter's gradient micro-batch by
micro-batch, so the gradient is summed in a different order than in one full-batch
backward. In float32 that rounding difference (about 1e-7 relative) is amplified by a
few hundred steps of training to well above the tolerance; in float64 it stays near
1e-15, so any visible difference would be a real bug.

Run it with ``python examples/demo.py`` (``--help`` lists the options). Progress is
shown with tqdm when it is installed, otherwise as plain lines.
"""
import argparse
import copy
import sys
import time
from typing import Callable, Iterable, Iterator, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchgpipe import GPipe

NUM_CLASSES = 10
IMAGE_SIZE = 32
TRAIN_SAMPLES = 4096
TEST_SAMPLES = 1024
PARTITIONS = 4
BALANCE = [3, 3, 3, 2]  # 11 layers over 4 partitions
NOISE = 6.0
DTYPE = torch.float64
LEARNING_RATE = 0.01
MOMENTUM = 0.9
RTOL = 1e-5
ATOL = 1e-6


def make_dataset(seed: int) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Generates ``(train_x, train_y, test_x, test_y)`` deterministically from ``seed``.

    Every class owns a random low-frequency colour pattern. A sample is its class
    pattern, rolled by a random shift of up to four pixels each way, plus Gaussian
    noise, so the class is learnable but not trivially so.
    """
    gen = torch.Generator().manual_seed(seed)
    coarse = torch.randn(NUM_CLASSES, 3, 4, 4, generator=gen)
    patterns = F.interpolate(coarse, size=(IMAGE_SIZE, IMAGE_SIZE), mode='bilinear',
                             align_corners=False)

    def sample(count: int) -> Tuple[Tensor, Tensor]:
        labels = torch.randint(0, NUM_CLASSES, (count,), generator=gen)
        shifts = torch.randint(-4, 5, (count, 2), generator=gen)
        images = torch.empty(count, 3, IMAGE_SIZE, IMAGE_SIZE)
        for k in range(count):
            dy, dx = int(shifts[k, 0]), int(shifts[k, 1])
            images[k] = patterns[labels[k]].roll(shifts=(dy, dx), dims=(1, 2))
        images += NOISE * torch.randn(images.shape, generator=gen)
        return images.to(DTYPE), labels

    train_x, train_y = sample(TRAIN_SAMPLES)
    test_x, test_y = sample(TEST_SAMPLES)
    return train_x, train_y, test_x, test_y


def make_model() -> nn.Sequential:
    """A flat sequential CNN: three Conv/ReLU/MaxPool blocks, then Flatten and Linear.

    No dropout and no BatchNorm, so the pipelined and plain runs can agree exactly.
    """
    return nn.Sequential(
        nn.Conv2d(3, 16, kernel_size=3, padding=1),   # 32x32
        nn.ReLU(),
        nn.MaxPool2d(2),                              # 16x16
        nn.Conv2d(16, 32, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),                              # 8x8
        nn.Conv2d(32, 64, kernel_size=3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),                              # 4x4
        nn.Flatten(),
        nn.Linear(64 * (IMAGE_SIZE // 8) ** 2, NUM_CLASSES),
    )


def batch_order(steps: int, batch_size: int, seed: int) -> List[Tensor]:
    """Index tensors of the training mini-batches: reshuffled every epoch, from ``seed``."""
    gen = torch.Generator().manual_seed(seed + 1)
    per_epoch = TRAIN_SAMPLES // batch_size
    order: List[Tensor] = []
    while len(order) < steps:
        perm = torch.randperm(TRAIN_SAMPLES, generator=gen)
        for b in range(per_epoch):
            order.append(perm[b * batch_size:(b + 1) * batch_size])
    return order[:steps]


def progress(iterable: Sequence[Tensor], desc: str) -> Tuple[Iterable[Tensor],
                                                             Callable[[int, float], None]]:
    """Wraps ``iterable`` with a progress display.

    Returns the iterable to loop over and a callback ``report(step, loss)``. Uses
    tqdm when available; otherwise prints a line every tenth of the run.
    """
    try:
        from tqdm import tqdm
    except ImportError:
        total = len(iterable)
        every = max(1, total // 10)

        def report_plain(step: int, loss: float) -> None:
            if (step + 1) % every == 0 or step + 1 == total:
                print(f'{desc}: step {step + 1}/{total} loss {loss:.4f}', flush=True)

        return iterable, report_plain

    bar = tqdm(iterable, desc=desc, unit='step', leave=True, dynamic_ncols=True)

    def report_bar(step: int, loss: float) -> None:
        if step % 10 == 0 or step + 1 == len(iterable):
            bar.set_postfix(loss=f'{loss:.4f}', refresh=False)

    return bar, report_bar


def train(model: nn.Module, batches: Sequence[Tensor], train_x: Tensor, train_y: Tensor,
          in_device: torch.device, out_device: torch.device,
          desc: str) -> Tuple[List[float], float]:
    """Trains ``model`` with SGD on the given mini-batches.

    Returns the loss of every step and the training throughput in samples per second.
    """
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE, momentum=MOMENTUM)
    model.train()
    losses: List[float] = []
    samples = 0
    iterator, report = progress(batches, desc)

    start = time.perf_counter()
    for step, index in enumerate(iterator):
        input = train_x[index].to(in_device)
        target = train_y[index].to(out_device, non_blocking=True)

        optimizer.zero_grad()
        output = model(input)
        loss = F.cross_entropy(output, target)
        loss.backward()
        optimizer.step()

        losses.append(loss.item())
        samples += len(index)
        report(step, losses[-1])
    elapsed = time.perf_counter() - start
    close = getattr(iterator, 'close', None)
    if close is not None:
        close()

    return losses, samples / elapsed


@torch.no_grad()
def evaluate(model: nn.Module, test_x: Tensor, test_y: Tensor,
             in_device: torch.device, out_device: torch.device) -> float:
    """Accuracy of ``model`` on the held-out set, in eval mode."""
    model.eval()
    correct = 0
    for start in range(0, len(test_x), 256):
        input = test_x[start:start + 256].to(in_device)
        target = test_y[start:start + 256].to(out_device)
        prediction = model(input).argmax(dim=1)
        correct += int((prediction == target).sum())
    return correct / len(test_x)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    """Parses the command line."""
    parser = argparse.ArgumentParser(
        description='Train a small CNN with torchgpipe.GPipe over 4 CPU partitions and '
                    'check that it matches the same model trained without GPipe.')
    parser.add_argument('--steps', type=int, default=300,
                        help='SGD steps for each run (default: 300)')
    parser.add_argument('--batch-size', type=int, default=64,
                        help='mini-batch size (default: 64)')
    parser.add_argument('--chunks', type=int, default=8,
                        help='micro-batches per mini-batch for GPipe (default: 8)')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed for the data, the weights and the batch order (default: 0)')
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error('--steps must be at least 1')
    if not 1 <= args.batch_size <= TRAIN_SAMPLES:
        parser.error(f'--batch-size must be between 1 and {TRAIN_SAMPLES}')
    if args.chunks < 1:
        parser.error('--chunks must be at least 1')
    return args


def iter_rows(rows: Sequence[Tuple[str, str, str]]) -> Iterator[str]:
    """Formats a three-column table."""
    widths = [max(len(row[c]) for row in rows) for c in range(3)]
    for n, row in enumerate(rows):
        yield f'  {row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}'
        if n == 0:
            yield '  ' + '  '.join('-' * w for w in widths)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the demo; returns the process exit status."""
    args = parse_args(argv)
    # One intra-op thread: both runs use the same kernels, and timings stay steady on
    # a small, possibly shared machine. The four CPU partitions share one device, and
    # GPipe runs one worker thread per device, so more threads would not overlap them.
    torch.set_num_threads(1)

    train_x, train_y, test_x, test_y = make_dataset(args.seed)
    batches = batch_order(args.steps, args.batch_size, args.seed)

    torch.manual_seed(args.seed)
    model = make_model().to(DTYPE)
    reference = copy.deepcopy(model)  # the same initial weights, trained without GPipe

    gpipe = GPipe(model, balance=BALANCE, devices=['cpu'] * PARTITIONS, chunks=args.chunks)
    in_device, out_device = gpipe.devices[0], gpipe.devices[-1]
    print(f'GPipe: {len(gpipe)} layers, balance {gpipe.balance}, '
          f'{len(gpipe.devices)} CPU partitions, chunks={gpipe.chunks}, '
          f'checkpoint={gpipe.checkpoint!r}; {args.steps} steps of batch {args.batch_size}',
          flush=True)

    gpipe_losses, gpipe_speed = train(gpipe, batches, train_x, train_y,
                                      in_device, out_device, 'with GPipe   ')
    gpipe_accuracy = evaluate(gpipe, test_x, test_y, in_device, out_device)

    cpu = torch.device('cpu')
    plain_losses, plain_speed = train(reference, batches, train_x, train_y,
                                      cpu, cpu, 'without GPipe')
    plain_accuracy = evaluate(reference, test_x, test_y, cpu, cpu)

    with_gpipe = torch.tensor(gpipe_losses, dtype=torch.float64)
    without_gpipe = torch.tensor(plain_losses, dtype=torch.float64)
    max_diff = float((with_gpipe - without_gpipe).abs().max())
    match = torch.allclose(with_gpipe, without_gpipe, rtol=RTOL, atol=ATOL)

    rows = [
        ('', 'with GPipe', 'without GPipe'),
        ('final loss', f'{gpipe_losses[-1]:.6f}', f'{plain_losses[-1]:.6f}'),
        ('test accuracy', f'{gpipe_accuracy:.2%}', f'{plain_accuracy:.2%}'),
        ('samples/s', f'{gpipe_speed:.0f}', f'{plain_speed:.0f}'),
    ]
    print()
    for line in iter_rows(rows):
        print(line)
    print(f'\n  max |loss difference| over {args.steps} steps: {max_diff:.3e}')
    print('  (all partitions share the CPU, so GPipe adds scheduling and recomputation\n'
          '   here; its speed-up needs one device per partition)')

    if not match:
        print(f'FAIL: the losses with and without GPipe differ '
              f'(rtol={RTOL:g}, atol={ATOL:g})', file=sys.stderr)
        return 1
    print(f'OK: GPipe matches the unwrapped model at every step (rtol={RTOL:g}, atol={ATOL:g})')
    return 0


if __name__ == '__main__':
    sys.exit(main())

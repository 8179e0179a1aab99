"""Train a small CNN with GPipe on CPU and check it matches plain PyTorch.

The demo generates a synthetic 10-class image dataset from a fixed seed (each class
has its own spatial colour pattern, drawn with random shifts and Gaussian noise), then
trains the same convolutional network three times with plain SGD, each from a copy of
the same initial weights, on the same mini-batches in the same order:

1. wrapped in :class:`torchgpipe.GPipe` over four partitions on one CPU device
   (``devices=['cpu'] * 4``): the pipeline runs in the calling thread;
2. wrapped in GPipe over four CPU devices (``devices=['cpu:0', ..., 'cpu:3']``): one
   worker thread per device, the partitions computing at the same time;
3. unwrapped, as the original :class:`~torch.nn.Sequential`.

GPipe splits each mini-batch into micro-batches (``--chunks``, default 8). It is
transparent: on both paths, every step must produce the loss of the unwrapped model.
The demo prints a small comparison table and exits with status 1 if a loss differs by
more than a tight tolerance (``rtol=1e-5``, ``atol=1e-6``).

Everything runs in float64. The forward pass of a micro-batch is the forward pass of
those samples, but GPipe accumulates each parameter's gradient micro-batch by
micro-batch, so the gradient is summed in a different order than in one full-batch
backward. In float32 that rounding difference (about 1e-7 relative) is amplified by a
few hundred steps of training to well above the tolerance; in float64 it stays near
1e-15, so any visible difference would be a real bug.

Run it with ``python examples/demo.py`` (``--help`` lists the options). Progress is
shown with tqdm in a terminal when it is installed, otherwise as a line per epoch.
"""
import argparse
import copy
import sys
import time
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

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
# The two execution paths of GPipe: all partitions on one device run in the calling
# thread; distinct devices get a worker thread each.
PATHS = {
    'GPipe, 1 thread': ['cpu'] * PARTITIONS,
    'GPipe, 4 threads': [f'cpu:{j}' for j in range(PARTITIONS)],
}
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


def progress(iterable: Sequence[Tensor], desc: str, every: int,
             ) -> Tuple[Iterable[Tensor], Callable[[int, float], None]]:
    """Wraps ``iterable`` with a progress display.

    Returns the iterable to loop over and a callback ``report(step, loss)``. In
    a terminal, a tqdm bar when tqdm is installed; elsewhere (a log, a pipe), or
    without tqdm, a line every ``every`` steps (an epoch) and at the end, as a
    bar redrawn there would leave every redraw in the log.
    """
    total = len(iterable)

    def report_plain(step: int, loss: float) -> None:
        if (step + 1) % every == 0 or step + 1 == total:
            print(f'{desc}: step {step + 1}/{total} loss {loss:.4f}', flush=True)

    if not sys.stderr.isatty():
        return iterable, report_plain
    try:
        from tqdm import tqdm
    except ImportError:
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
    iterator, report = progress(batches, desc, max(1, TRAIN_SAMPLES // len(batches[0])))

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
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description='Train a small CNN with torchgpipe.GPipe over 4 CPU partitions, in one '
                    'thread and with a worker thread per device, and check that both match '
                    'the same model trained without GPipe.')
    parser.add_argument('--steps', type=int, default=64,
                        help='SGD steps for each run (64 are one epoch at batch 64)')
    parser.add_argument('--batch-size', type=int, default=64,
                        help='mini-batch size')
    parser.add_argument('--chunks', type=int, default=8,
                        help='micro-batches per mini-batch for GPipe')
    parser.add_argument('--seed', type=int, default=0,
                        help='seed for the data, the weights and the batch order')
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error('--steps must be at least 1')
    if not 1 <= args.batch_size <= TRAIN_SAMPLES:
        parser.error(f'--batch-size must be between 1 and {TRAIN_SAMPLES}')
    if args.chunks < 1:
        parser.error('--chunks must be at least 1')
    return args


def iter_rows(rows: Sequence[Sequence[str]]) -> Iterator[str]:
    """Formats a table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    for n, row in enumerate(rows):
        cells = [row[0].ljust(widths[0])] + [cell.rjust(w) for cell, w in zip(row[1:], widths[1:])]
        yield '  ' + '  '.join(cells)
        if n == 0:
            yield '  ' + '  '.join('-' * w for w in widths)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the demo; returns the process exit status."""
    args = parse_args(argv)
    # One intra-op thread per worker: every run uses the same kernels, and timings stay
    # steady on a small, possibly shared machine; the threaded path overlaps partitions
    # through its worker threads instead.
    torch.set_num_threads(1)

    train_x, train_y, test_x, test_y = make_dataset(args.seed)
    batches = batch_order(args.steps, args.batch_size, args.seed)

    torch.manual_seed(args.seed)
    model = make_model().to(DTYPE)
    print(f'A CNN of {len(model)} layers trained three times: with GPipe over '
          f'{PARTITIONS} CPU partitions in one thread, with GPipe and a worker thread per '
          f'device, and without GPipe; balance {BALANCE}, chunks={args.chunks}, '
          f"checkpoint='except_last'; {args.steps} steps of batch {args.batch_size}",
          flush=True)

    runs: Dict[str, Tuple[List[float], float, float]] = {}  # losses, samples/s, accuracy
    width = max(len(name) for name in PATHS)  # progress bars aligned
    for name, devices in PATHS.items():
        # Each run starts from a copy of the same initial weights.
        gpipe = GPipe(copy.deepcopy(model), balance=BALANCE, devices=devices,
                      chunks=args.chunks)
        in_device, out_device = gpipe.devices[0], gpipe.devices[-1]
        losses, speed = train(gpipe, batches, train_x, train_y, in_device, out_device,
                              name.ljust(width))
        runs[name] = losses, speed, evaluate(gpipe, test_x, test_y, in_device, out_device)

    cpu = torch.device('cpu')
    plain = 'without GPipe'
    reference = copy.deepcopy(model)
    losses, speed = train(reference, batches, train_x, train_y, cpu, cpu, plain.ljust(width))
    runs[plain] = losses, speed, evaluate(reference, test_x, test_y, cpu, cpu)

    expected = torch.tensor(runs[plain][0], dtype=torch.float64)
    differences: Dict[str, float] = {}
    mismatched: List[str] = []
    for name in PATHS:
        actual = torch.tensor(runs[name][0], dtype=torch.float64)
        differences[name] = float((actual - expected).abs().max())
        if not torch.allclose(actual, expected, rtol=RTOL, atol=ATOL):
            mismatched.append(name)

    rows = [
        [''] + list(runs),
        ['final loss'] + [f'{losses[-1]:.6f}' for losses, _, _ in runs.values()],
        ['test accuracy'] + [f'{accuracy:.2%}' for _, _, accuracy in runs.values()],
        ['samples/s'] + [f'{speed:.0f}' for _, speed, _ in runs.values()],
        ['max |loss diff|'] + [f'{differences[name]:.1e}' for name in PATHS] + ['-'],
    ]
    print()
    for line in iter_rows(rows):
        print(line)
    print('\n  max |loss diff|: the largest difference from the loss without GPipe, over\n'
          f'  all {args.steps} steps. All partitions share the CPU here, so GPipe adds\n'
          '  scheduling and recomputation; its speed-up needs one device per partition.')

    if mismatched:
        names = ' and '.join(repr(name) for name in mismatched)
        print(f'FAIL: the losses of {names} differ from those without GPipe '
              f'(rtol={RTOL:g}, atol={ATOL:g})', file=sys.stderr)
        return 1
    print(f'OK: on both paths, GPipe matches the unwrapped model at every step '
          f'(rtol={RTOL:g}, atol={ATOL:g})')
    return 0


if __name__ == '__main__':
    sys.exit(main())

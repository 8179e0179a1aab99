"""Trains a small U-Net with long skips on GPipe over CPU devices, next to the unwrapped model.

Run from the repository root::

    python -m benchmarks.unet_example --steps 20

It prints the largest loss difference between the two runs (expected 0 up to
float rounding) and, from the pipeline's skip layout, how many copies each
micro-batch's skip tensors take with portals compared with carrying them
through every partition in between. Speed is measured by the benchmarks.
"""
import argparse
import copy
from typing import List, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.models.unet import unet
from torchgpipe import GPipe


def even_balance(num_layers: int, partitions: int) -> List[int]:
    """Splits layers into partitions of nearly equal counts."""
    base, extra = divmod(num_layers, partitions)
    return [base + (j < extra) for j in range(partitions)]


def train(model: nn.Module, images: Sequence[torch.Tensor], masks: Sequence[torch.Tensor],
          output_device: torch.device) -> List[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for image, mask in zip(images, masks):
        optimizer.zero_grad()
        output = model(image)
        loss = F.binary_cross_entropy_with_logits(output, mask.to(output_device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--steps', type=int, default=20)
    parser.add_argument('--batch-size', type=int, default=16)
    parser.add_argument('--chunks', type=int, default=4)
    parser.add_argument('--partitions', type=int, default=4)
    parser.add_argument('--checkpoint', default='except_last',
                        choices=['always', 'except_last', 'never'])
    parser.add_argument('--size', type=int, default=32, help='image height and width')
    args = parser.parse_args()

    torch.manual_seed(0)
    model = unet(depth=5, num_convs=1, base_channels=8)
    reference = copy.deepcopy(model)
    balance = even_balance(len(model), args.partitions)
    gpipe = GPipe(model, balance, devices=['cpu'] * args.partitions, chunks=args.chunks,
                  checkpoint=args.checkpoint)

    images = [torch.rand(args.batch_size, 3, args.size, args.size) for _ in range(args.steps)]
    # A learnable target: bright regions of the first channel.
    masks = [(x[:, :1] > 0.5).float() for x in images]

    expected = train(reference, images, masks, torch.device('cpu'))
    actual = train(gpipe, images, masks, gpipe.devices[-1])

    routes = gpipe._skip_layout.by_ns_name.values()
    crossing = [(prev_j, next_j) for prev_j, next_j in routes if prev_j != next_j]
    through_every_boundary = sum(next_j - prev_j for prev_j, next_j in crossing)

    print(f'U-Net: {len(model)} layers, balance {balance}, chunks {args.chunks}, '
          f'checkpoint {args.checkpoint!r}')
    print(f'final loss: GPipe {actual[-1]:.6f}, unwrapped {expected[-1]:.6f}, '
          f'largest difference over {args.steps} steps '
          f'{max(abs(a - e) for a, e in zip(actual, expected)):.3g}')
    print(f'skip tensors: {len(routes)}, crossing partitions: {len(crossing)}; copies per '
          f'micro-batch with portals: {len(crossing)}, through every partition in between: '
          f'{through_every_boundary}')


if __name__ == '__main__':
    main()

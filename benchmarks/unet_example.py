"""U-Net example: a small U-Net with long skips trained on GPipe, next to the unwrapped model.

Run from the repository root::

    python -m benchmarks.unet_example --steps 20

It trains U-Net(1, 8) (``benchmarks/models/unet.py``) with plain SGD on
random images whose target is their bright regions, once unwrapped and once
with GPipe on CPU devices, from the same weights, and reports the largest
loss difference between the two runs (expected 0 up to float rounding).
From the pipeline's skip layout it also counts how many copies each
micro-batch's skip tensors take with portals (straight from the stashing
partition to the popping one), against carrying them through every
partition in between. Speed is measured by the other experiments.
"""
import copy
import sys
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.balance import even_balance
from benchmarks.models.unet import unet
from benchmarks.report import format_table
from benchmarks.runner import Experiment, Figure, Option, Preset, main as run_main
from torchgpipe import GPipe

PRESETS: Dict[str, Preset] = {
    'cpu': Preset('U-Net(1, 8), 3x32x32, batch 16, chunks 4, 4 partitions, 20 steps (~10 s)',
                  steps=20, batch=16, chunks=4, partitions=4, checkpoint='except_last',
                  size=32),
}

SMOKE = dict(steps=2, batch=4)

#: U-Net's five down-samplings need sides that are multiples of 2^5.
SIDE = 32


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


def check(config: Dict[str, Any]) -> Optional[str]:
    if config['size'] % SIDE:
        return (f"--size must be a multiple of {SIDE} (U-Net halves it five times), got "
                f"{config['size']}; pass --size {SIDE * max(1, round(config['size'] / SIDE))}")
    return None


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(0)
    model = unet(depth=5, num_convs=1, base_channels=8)
    reference = copy.deepcopy(model)
    balance = even_balance(len(model), config['partitions'])
    devices = ['cpu'] * config['partitions']
    gpipe = GPipe(model, balance, devices=devices, chunks=config['chunks'],
                  checkpoint=config['checkpoint'])

    size, batch = config['size'], config['batch']
    images = [torch.rand(batch, 3, size, size) for _ in range(config['steps'])]
    # A learnable target: bright regions of the first channel.
    masks = [(x[:, :1] > 0.5).float() for x in images]
    expected = train(reference, images, masks, torch.device('cpu'))
    actual = train(gpipe, images, masks, gpipe.devices[-1])

    routes = list(gpipe.core.skip_layout.by_ns_name.values())
    crossing = [(prev_j, next_j) for prev_j, next_j in routes if prev_j != next_j]
    return {'results': {'layers': len(model), 'balance': balance,
                        'gpipe_losses': actual, 'unwrapped_losses': expected,
                        'max_loss_difference': max(abs(a - e) for a, e in zip(actual, expected)),
                        'skips': len(routes), 'crossing_skips': len(crossing),
                        'copies_with_portals': len(crossing),
                        'copies_through_partitions': sum(n - p for p, n in crossing)},
            'devices': devices}


def table(document: Dict[str, Any]) -> str:
    config, r = document['settings'], document['results']
    return '\n'.join([
        f"U-Net: {r['layers']} layers, balance {r['balance']}, chunks {config['chunks']}, "
        f"checkpoint {config['checkpoint']!r}, {config['steps']} steps",
        format_table(['final loss, GPipe', 'final loss, unwrapped',
                      'largest loss difference (all steps)'],
                     [[f"{r['gpipe_losses'][-1]:.6f}", f"{r['unwrapped_losses'][-1]:.6f}",
                       f"{r['max_loss_difference']:.3g}"]]),
        '',
        format_table(['skip tensors', 'crossing partitions',
                      'copies per micro-batch, portals',
                      'copies per micro-batch, through every partition'],
                     [[r['skips'], r['crossing_skips'], r['copies_with_portals'],
                       r['copies_through_partitions']]])])


def headline(document: Dict[str, Any]) -> List[Figure]:
    r = document['results']
    return [Figure('largest loss difference', f"{r['max_loss_difference']:.3g}"),
            Figure('skip copies per micro-batch: portals / through every partition',
                   f"{r['copies_with_portals']} / {r['copies_through_partitions']}")]


def plot(document: Dict[str, Any], plt: Any) -> None:
    r = document['results']
    fig = plt.gcf()
    fig.set_size_inches(10, 4.2)
    left = fig.add_subplot(1, 2, 1)
    left.plot(r['unwrapped_losses'], color='black', label='unwrapped')
    left.plot(r['gpipe_losses'], color='tab:orange', linestyle='--', label='GPipe')
    left.set_xlabel('step')
    left.set_ylabel('loss')
    left.set_title(f"training loss (largest difference {r['max_loss_difference']:.3g})")
    left.legend()
    right = fig.add_subplot(1, 2, 2)
    right.bar(['portals', 'through every\npartition'],
              [r['copies_with_portals'], r['copies_through_partitions']])
    right.set_ylabel('skip-tensor copies per micro-batch')
    right.set_title('copies of the long skips')


#: The options of this experiment beyond those of every experiment.
OPTIONS = [Option('--steps', 'steps', 'SGD steps', minimum=1),
           Option('--batch-size', 'batch', 'images per step', minimum=1),
           Option('--chunks', 'chunks', 'micro-batches', minimum=1),
           Option('--partitions', 'partitions', 'partitions, on CPU', minimum=1),
           Option('--checkpoint', 'checkpoint', 'checkpoint mode', type=str,
                  choices=['always', 'except_last', 'never']),
           Option('--size', 'size', f'image height and width, a multiple of {SIDE}',
                  minimum=SIDE)]

EXPERIMENT = Experiment(
    name='unet_example', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run, table=table,
    headline=headline, plot=plot, check=check, options=OPTIONS)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

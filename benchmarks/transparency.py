"""Transparency: training with GPipe gives the losses of training without it.

Run from the repository root::

    python -m benchmarks.transparency

The paper backs GPipe's transparency with ResNet-101's accuracy on ImageNet
trained with and without the pipeline. This is the same claim at a size that
runs anywhere: a tiny bottleneck ResNet from ``benchmarks/models/resnet.py``
(residuals through ``torchgpipe.skip``, no BatchNorm, float64) is trained
with plain SGD for a few hundred steps on a fixed synthetic classification
task, once unwrapped and once per GPipe setting (several chunks, every
checkpoint mode, several partitions), all from the same initial weights and
the same batches. The table reports, per setting, the largest difference of
the loss over all steps and of the parameters at the end, which should be 0
up to float rounding (micro-batches sum the weight gradients in a different
order than the full batch).
"""
import copy
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.balance import even_balance
from benchmarks.devices import cpu_devices, cuda_devices
from benchmarks.memory import parameter_count
from benchmarks.models.resnet import resnet
from benchmarks.report import format_table, progress
from benchmarks.runner import Experiment, Figure, Option, Preset, main as run_main
from torchgpipe import GPipe

CHECKPOINTS = ['always', 'except_last', 'never']

PRESETS: Dict[str, Preset] = {
    'cpu': Preset('tiny ResNet (blocks 1-1-1-1, width 4), 16x16 images, 200 steps, '
                  '2 and 4 CPU devices (~1 min)',
                  device='cpu', layers=[1, 1, 1, 1], width=4, image_size=16, batch_size=16,
                  steps=200, lr=0.1, settings=[(1, 2), (4, 2), (4, 4)]),
    'resnet101': Preset('ResNet-101 layout (blocks 3-4-23-3) at width 4, 32x32 images, '
                        '200 steps, 4 CPU devices (several minutes)',
                        device='cpu', layers=[3, 4, 23, 3], width=4, image_size=32,
                        batch_size=16, steps=200, lr=0.1,
                        settings=[(c, 4) for c in (1, 4, 8)]),
    'cuda': Preset('ResNet-101 layout at width 8 on 4 CUDA devices, 32x32 images, 300 steps',
                   device='cuda', layers=[3, 4, 23, 3], width=8, image_size=32, batch_size=32,
                   steps=300, lr=0.1, settings=[(c, 4) for c in (1, 4, 8)]),
}

SMOKE = dict(steps=3)

NUM_CLASSES = 10


def dataset(config: Dict[str, Any], device: torch.device, generator: torch.Generator,
            ) -> List[Tuple[Tensor, Tensor]]:
    """Batches of random images labelled by a fixed random teacher, so the loss can fall."""
    size, batch = config['image_size'], config['batch_size']
    num_batches = 8
    images = torch.randn(num_batches * batch, 3, size, size, generator=generator,
                         dtype=torch.float64)
    teacher = torch.randn(3 * 4 * 4, NUM_CLASSES, generator=generator, dtype=torch.float64)
    labels = (F.adaptive_avg_pool2d(images, 4).flatten(1) @ teacher).argmax(dim=1)
    return [(x.to(device), y.to(device))
            for x, y in zip(images.split(batch), labels.split(batch))]


def train(model: nn.Module, data: List[Tuple[Tensor, Tensor]], steps: int, lr: float,
          output_device: torch.device, desc: str) -> List[float]:
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses = []
    for step in progress(range(steps), desc=desc):
        images, labels = data[step % len(data)]
        optimizer.zero_grad()
        loss = F.cross_entropy(model(images), labels.to(output_device))
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    torch.manual_seed(0)
    initial = resnet(config['layers'], num_classes=NUM_CLASSES, width=config['width'],
                     batch_norm=False, small_input=True).double()
    max_partitions = max(p for _, p in config['settings'])
    if config['device'] == 'cuda':
        devices = cuda_devices(max_partitions)
    else:
        devices = cpu_devices(max_partitions)

    generator = torch.Generator().manual_seed(1)
    data = dataset(config, devices[0], generator)

    reference = copy.deepcopy(initial).to(devices[0])
    expected = train(reference, data, config['steps'], config['lr'], devices[0], 'unwrapped')
    expected_params = [p.detach().cpu() for p in reference.parameters()]

    results: List[Dict[str, Any]] = []
    for chunks, partitions in config['settings']:
        for checkpoint in CHECKPOINTS:
            gpipe = GPipe(copy.deepcopy(initial), even_balance(len(initial), partitions),
                          devices=devices[:partitions], chunks=chunks, checkpoint=checkpoint)
            name = f'chunks={chunks} partitions={partitions} {checkpoint}'
            actual = train(gpipe, data, config['steps'], config['lr'], gpipe.devices[-1], name)
            diffs = [abs(a - e) for a, e in zip(actual, expected)]
            param_diff = max((p.detach().cpu() - q).abs().max().item()
                             for p, q in zip(gpipe.parameters(), expected_params))
            results.append({'chunks': chunks, 'partitions': partitions,
                            'checkpoint': checkpoint, 'final_loss': actual[-1],
                            'max_loss_difference': max(diffs),
                            'max_parameter_difference': param_diff})

    return {'results': results, 'losses': expected, 'devices': [str(d) for d in devices],
            'parameters': parameter_count(initial), 'layers': len(initial),
            'initial_loss': expected[0], 'final_loss': expected[-1],
            'max_loss_difference': max(r['max_loss_difference'] for r in results),
            'max_parameter_difference': max(r['max_parameter_difference'] for r in results)}


def table(document: Dict[str, Any]) -> str:
    config = document['settings']
    return '\n'.join([
        f"ResNet blocks {config['layers']} width {config['width']}: {document['layers']} "
        f"layers, {document['parameters']:,} parameters, float64, {config['steps']} SGD steps; "
        f"unwrapped loss {document['initial_loss']:.4f} -> {document['final_loss']:.4f}",
        format_table(
            ['chunks', 'partitions', 'checkpoint', 'final loss', 'max |loss diff|',
             'max |param diff|'],
            [[r['chunks'], r['partitions'], r['checkpoint'], f"{r['final_loss']:.6f}",
              f"{r['max_loss_difference']:.3g}", f"{r['max_parameter_difference']:.3g}"]
             for r in document['results']])])


def headline(document: Dict[str, Any]) -> List[Figure]:
    return [Figure('largest loss difference', f"{document['max_loss_difference']:.3g}"),
            Figure('largest parameter difference',
                   f"{document['max_parameter_difference']:.3g}")]


def plot(document: Dict[str, Any], plt: Any) -> None:
    from matplotlib.ticker import LogLocator

    fig = plt.gcf()
    fig.set_size_inches(11, 4.4)
    left = fig.add_subplot(1, 2, 1)
    left.plot(document['losses'], color='black')
    left.set_xlabel('step')
    left.set_ylabel('loss')
    left.set_title('training loss, unwrapped (GPipe: the same)')
    right = fig.add_subplot(1, 2, 2)
    results = document['results']
    names = [f"m={r['chunks']} n={r['partitions']} {r['checkpoint']}" for r in results]
    nonzero = [r[k] for r in results for k in ('max_loss_difference', 'max_parameter_difference')
               if r[k] > 0]
    # A log axis cannot show 0, which is what most settings give: a 0 is a
    # marker at the axis' left end, labelled, instead of an invisible bar.
    high = max(nonzero, default=1e-15) * 10
    low = min(nonzero, default=1e-15) / 100
    for offset, key, label, color in ((-0.2, 'max_loss_difference', 'loss', 'tab:blue'),
                                      (0.2, 'max_parameter_difference', 'parameters',
                                       'tab:orange')):
        ys = [i + offset for i in range(len(results))]
        values = [r[key] for r in results]
        right.barh([y for y, v in zip(ys, values) if v > 0], [v for v in values if v > 0],
                   height=0.4, left=low, label=label, color=color)
        zeros = [y for y, v in zip(ys, values) if v == 0]
        right.scatter([low] * len(zeros), zeros, marker='|', s=120, color=color, zorder=3)
        for y in zeros:
            right.annotate(f'0 ({label}: identical)', (low, y), xytext=(6, 0),
                           textcoords='offset points', va='center', fontsize='x-small')
    right.set_yticks(range(len(results)))
    right.set_yticklabels(names, fontsize='x-small')
    right.set_xscale('log')
    right.set_xlim(low, high)
    right.xaxis.set_major_locator(LogLocator(base=10, numticks=5))
    right.set_xlabel('largest |GPipe - unwrapped| over all steps')
    right.set_title('difference from the unwrapped model')
    right.legend(fontsize='small', loc='lower right')


EXPERIMENT = Experiment(
    name='transparency', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run, table=table,
    headline=headline, plot=plot,
    options=[Option('--steps', 'steps', 'SGD steps', minimum=1)])


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

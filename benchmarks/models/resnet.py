"""ResNet (He et al., 2016) as a flat nn.Sequential for GPipe, residuals through torchgpipe.skip.

Every bottleneck block is five consecutive layers of the sequential model::

    Shortcut            stashes the block's input (or its projection) as 'identity'
    conv 1x1 (+BN) ReLU
    conv 3x3 (+BN) ReLU  strided in the first block of a stage
    conv 1x1 (+BN)
    AddIdentity         pops 'identity', adds it and applies ReLU

Each block has its own :class:`~torchgpipe.skip.Namespace`, so the same skip
name is reused without clashes, and in a pipeline the residual goes straight
from the partition of the shortcut to the partition of the addition.

:func:`resnet101` is the usual ResNet-101 (blocks ``(3, 4, 23, 3)``, width 64,
1000 classes, 44.5M parameters); ``width``, ``num_classes``,
``batch_norm`` and ``small_input`` make a tiny variant that trains on a CPU in
seconds. Without BatchNorm, every convolution has a bias and the model's
output does not depend on how a batch is split into micro-batches.
"""
from typing import Any, Generator, List, Optional, Sequence

import torch
from torch import Tensor, nn

from torchgpipe.skip import Namespace, pop, skippable, stash

__all__ = ['resnet', 'resnet101', 'Shortcut', 'AddIdentity']


@skippable(stash=['identity'])
class Shortcut(nn.Module):
    """Stashes the block input, projected by ``downsample`` if given, and passes the input on."""

    def __init__(self, downsample: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.downsample = downsample

    def forward(self, input: Tensor) -> Generator[Any, Any, Tensor]:
        identity = input if self.downsample is None else self.downsample(input)
        yield stash('identity', identity)
        return input


@skippable(pop=['identity'])
class AddIdentity(nn.Module):
    """Adds the stashed identity to the residual branch, then ReLU."""

    def forward(self, input: Tensor) -> Generator[Any, Any, Tensor]:
        identity = yield pop('identity')
        return torch.relu(input + identity)


def conv_norm(in_channels: int, out_channels: int, kernel_size: int, stride: int,
              batch_norm: bool, relu: bool) -> nn.Sequential:
    """A convolution, optionally followed by BatchNorm, optionally by ReLU."""
    layers: List[nn.Module] = [nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride,
                                         padding=kernel_size // 2, bias=not batch_norm)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(out_channels))
    if relu:
        layers.append(nn.ReLU())
    return nn.Sequential(*layers)


def bottleneck(in_channels: int, width: int, stride: int, batch_norm: bool,
               expansion: int = 4) -> List[nn.Module]:
    """The five layers of one bottleneck block (output channels ``width * expansion``)."""
    out_channels = width * expansion
    downsample: Optional[nn.Module] = None
    if stride != 1 or in_channels != out_channels:
        downsample = conv_norm(in_channels, out_channels, 1, stride, batch_norm, relu=False)

    ns = Namespace()
    return [
        Shortcut(downsample).isolate(ns),
        conv_norm(in_channels, width, 1, 1, batch_norm, relu=True),
        conv_norm(width, width, 3, stride, batch_norm, relu=True),
        conv_norm(width, out_channels, 1, 1, batch_norm, relu=False),
        AddIdentity().isolate(ns),
    ]


def resnet(layers: Sequence[int] = (3, 4, 23, 3), *, num_classes: int = 1000, width: int = 64,
           input_channels: int = 3, batch_norm: bool = True,
           small_input: bool = False) -> nn.Sequential:
    """Builds a bottleneck ResNet as a flat :class:`nn.Sequential <torch.nn.Sequential>`.

    Args:
        layers: the number of bottleneck blocks of each stage; the first
            stage keeps the resolution, every other one halves it
        num_classes: outputs of the classifier
        width: channels of the stem and of the first stage's 3x3 convolutions,
            doubled at each stage (64 in ResNet-101)
        input_channels: channels of the input images
        batch_norm: BatchNorm after every convolution (as in the paper); off,
            convolutions have biases instead
        small_input: a 3x3 stem without max pooling, for images of 32x32 or
            smaller, instead of the 7x7 strided stem and max pooling for 224x224

    Returns:
        nn.Sequential: stem, ``5 * sum(layers)`` block layers, and the head
        (global average pooling, flatten, linear)

    Example::

        >>> model = resnet((1, 1), width=4, num_classes=10, small_input=True)
        >>> model(torch.rand(2, 3, 16, 16)).shape
        torch.Size([2, 10])
    """
    modules: List[nn.Module] = []
    if small_input:
        modules.append(conv_norm(input_channels, width, 3, 1, batch_norm, relu=True))
    else:
        stem = conv_norm(input_channels, width, 7, 2, batch_norm, relu=True)
        stem.append(nn.MaxPool2d(3, stride=2, padding=1))
        modules.append(stem)

    in_channels = width
    for stage, blocks in enumerate(layers):
        stage_width = width * 2 ** stage
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            modules += bottleneck(in_channels, stage_width, stride, batch_norm)
            in_channels = stage_width * 4

    modules += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(in_channels, num_classes)]
    return nn.Sequential(*modules)


def resnet101(**kwargs: Any) -> nn.Sequential:
    """ResNet-101: :func:`resnet` with blocks ``(3, 4, 23, 3)``; keyword arguments as there."""
    return resnet((3, 4, 23, 3), **kwargs)

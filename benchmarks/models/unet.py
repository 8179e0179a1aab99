"""U-Net(B, C) as in Section 4.2.2 of the paper, flat, with long skips through torchgpipe.skip.

Five down-sampling and five up-sampling stages; ``B`` convolution blocks
between them; ``C`` output channels of the first convolution, doubled after
each down-sampling and halved after each up-sampling. The long skip of each
stage is stashed before its down-sampling and popped after the matching
up-sampling, each stage in its own :class:`~torchgpipe.skip.Namespace`, so
in a pipeline every skip tensor goes straight to the partition that uses it.
The model is symmetric (same blocks on both sides), which balances well.
"""
from typing import Any, Generator, List

import torch
from torch import Tensor, nn

from torchgpipe.skip import Namespace, pop, skippable, stash

__all__ = ['unet']


@skippable(stash=['skip'])
class StashSkip(nn.Module):
    """Keeps the input of a down-sampling stage for its up-sampling twin."""

    def forward(self, input: Tensor) -> Generator[Any, Any, Tensor]:
        yield stash('skip', input)
        return input


@skippable(pop=['skip'])
class PopCat(nn.Module):
    """Concatenates the up-sampled input with the long skip of its stage."""

    def forward(self, input: Tensor) -> Generator[Any, Any, Tensor]:
        skip = yield pop('skip')
        return torch.cat([input, skip], dim=1)


def conv_block(channels: int, batch_norm: bool) -> List[nn.Module]:
    layers: List[nn.Module] = [nn.Conv2d(channels, channels, 3, padding=1, bias=not batch_norm)]
    if batch_norm:
        layers.append(nn.BatchNorm2d(channels))
    layers.append(nn.ReLU())
    return layers


def unet(depth: int = 5, num_convs: int = 5, base_channels: int = 64,
         input_channels: int = 3, output_channels: int = 1,
         batch_norm: bool = False) -> nn.Sequential:
    """Builds U-Net(B, C) as a flat :class:`nn.Sequential <torch.nn.Sequential>`.

    Args:
        depth (int): number of down- and up-sampling stages (5 in the paper);
            the input size must be divisible by ``2 ** depth``
        num_convs (int): ``B``, convolution blocks between samplings
        base_channels (int): ``C``, channels of the first convolution
        input_channels (int): channels of the input images
        output_channels (int): channels of the output map
        batch_norm (bool): whether each block has a BatchNorm (off keeps the
            model's output independent of how the batch is split)

    Returns:
        nn.Sequential: the model; its skippable layers need no GPipe to run

    Example::

        >>> model = unet(depth=2, num_convs=1, base_channels=4)
        >>> model(torch.rand(2, 3, 8, 8)).shape
        torch.Size([2, 1, 8, 8])
    """
    channels = base_channels
    layers: List[nn.Module] = [nn.Conv2d(input_channels, channels, 3, padding=1), nn.ReLU()]
    namespaces = [Namespace() for _ in range(depth)]

    for ns in namespaces:
        for _ in range(num_convs):
            layers += conv_block(channels, batch_norm)
        layers.append(StashSkip().isolate(ns))
        layers += [nn.Conv2d(channels, channels * 2, 3, stride=2, padding=1), nn.ReLU()]
        channels *= 2

    for _ in range(num_convs):
        layers += conv_block(channels, batch_norm)

    for ns in reversed(namespaces):
        layers += [nn.ConvTranspose2d(channels, channels // 2, 2, stride=2), nn.ReLU()]
        channels //= 2
        layers.append(PopCat().isolate(ns))
        layers += [nn.Conv2d(channels * 2, channels, 1), nn.ReLU()]
        for _ in range(num_convs):
            layers += conv_block(channels, batch_norm)

    layers.append(nn.Conv2d(channels, output_channels, 1))
    return nn.Sequential(*layers)

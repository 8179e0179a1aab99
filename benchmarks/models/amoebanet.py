"""AmoebaNet-D(L, D) as a flat nn.Sequential for GPipe: one layer per cell.

AmoebaNet-D is the image classifier that GPipe (Huang et al., 2019) scaled up,
with cells found by regularized evolution (Real et al., 2019). ``L`` is the
number of normal cell layers and ``D`` the number of filters of the first
stack. The network, as this module builds it::

    stem            3x3 conv, stride 2, BN              -> (x, x)
    2 stem cells    reduction cells with D/4 and D/2 filters
    L/3 normal cells with D filters
    reduction cell  2D filters
    L/3 normal cells with 2D filters
    reduction cell  4D filters
    L/3 normal cells with 4D filters
    classifier      ReLU, global average pooling, dropout, linear

so ``len(amoebanetd(L, D)) == L + 6``. A 224x224 input is 28x28 in the first
normal stack, 14x14 in the second and 7x7 in the third.

A cell reads the outputs of the two previous cells, so every layer between
the stem and the classifier takes and returns a tuple ``(prev, prev_prev)``
of tensors, which is what GPipe carries across partition boundaries. Inside
a cell, both inputs are first brought to the cell's filters (ReLU, 1x1
conv, BN; a factorized reduction when ``prev_prev`` is twice as large), then
five pairwise combinations each add two operations applied to earlier hidden
states, and the states listed in the cell's ``concat`` are concatenated.

The operations are those of AmoebaNet-D's cells: identity, 3x3 max and
average pooling, 2x2 max pooling, 1x1 and 3x3 convolutions, the factorized
1x7-then-7x1 convolution and the 3x3 depthwise-separable convolution, each
convolution as ReLU, conv, BN. The wiring below is this project's own
rendering of the published cells, written for the benchmarks: it has the
same operation mix, cell interface and network layout, which is what the
speed benchmark exercises, but it is not guaranteed to match the reference
implementation operation for operation, nor its exact parameter count.
"""
from typing import List, Sequence, Tuple

import torch
from torch import Tensor, nn

__all__ = ['amoebanetd', 'Stem', 'Cell', 'Classifier', 'NORMAL', 'REDUCTION']

#: A cell: five ``((op, input), (op, input))`` pairs producing hidden states
#: 2..6 from states 0 (``prev_prev``) and 1 (``prev``), and the states concatenated.
Genotype = Tuple[Sequence[Tuple[Tuple[str, int], Tuple[str, int]]], Sequence[int]]

NORMAL: Genotype = (
    [(('conv_1x1', 1), ('max_pool_3x3', 1)),
     (('none', 1), ('conv_1x7_7x1', 0)),
     (('conv_1x1', 0), ('sep_conv_3x3', 0)),
     (('max_pool_3x3', 2), ('none', 2)),
     (('avg_pool_3x3', 1), ('conv_1x1', 5))],
    [0, 3, 4, 6],
)

REDUCTION: Genotype = (
    [(('max_pool_2x2', 0), ('max_pool_3x3', 0)),
     (('none', 2), ('sep_conv_3x3', 1)),
     (('conv_1x7_7x1', 2), ('max_pool_3x3', 2)),
     (('none', 3), ('max_pool_2x2', 1)),
     (('avg_pool_3x3', 2), ('conv_3x3', 3))],
    [4, 5, 6],
)

Pair = Tuple[Tensor, Tensor]


def relu_conv_bn(in_channels: int, out_channels: int, kernel_size: Tuple[int, int],
                 stride: int = 1) -> List[nn.Module]:
    padding = (kernel_size[0] // 2, kernel_size[1] // 2)
    return [nn.ReLU(),
            nn.Conv2d(in_channels, out_channels, kernel_size, stride=stride, padding=padding,
                      bias=False),
            nn.BatchNorm2d(out_channels)]


class FactorizedReduce(nn.Module):
    """Halves the resolution without losing half of the pixels: two offset strided 1x1 convs."""

    def __init__(self, in_channels: int, out_channels: int) -> None:
        super().__init__()
        self.relu = nn.ReLU()
        self.conv1 = nn.Conv2d(in_channels, out_channels // 2, 1, stride=2, bias=False)
        self.conv2 = nn.Conv2d(in_channels, out_channels - out_channels // 2, 1, stride=2,
                               bias=False)
        self.bn = nn.BatchNorm2d(out_channels)

    def forward(self, input: Tensor) -> Tensor:
        x = self.relu(input)
        shifted = nn.functional.pad(x[:, :, 1:, 1:], (0, 1, 0, 1))
        output: Tensor = self.bn(torch.cat([self.conv1(x), self.conv2(shifted)], dim=1))
        return output


def operation(name: str, channels: int, stride: int) -> nn.Module:
    """One of the cell operations, keeping ``channels``, with the given stride."""
    if name == 'none':
        return nn.Identity() if stride == 1 else FactorizedReduce(channels, channels)
    if name == 'max_pool_3x3':
        return nn.MaxPool2d(3, stride=stride, padding=1)
    if name == 'avg_pool_3x3':
        return nn.AvgPool2d(3, stride=stride, padding=1, count_include_pad=False)
    if name == 'max_pool_2x2':
        return nn.MaxPool2d(2, stride=2) if stride == 2 else nn.MaxPool2d(3, stride=1, padding=1)
    if name == 'conv_1x1':
        return nn.Sequential(*relu_conv_bn(channels, channels, (1, 1), stride))
    if name == 'conv_3x3':
        return nn.Sequential(*relu_conv_bn(channels, channels, (3, 3), stride))
    if name == 'conv_1x7_7x1':
        middle = channels // 4 if channels >= 4 else channels
        return nn.Sequential(
            nn.ReLU(),
            nn.Conv2d(channels, middle, 1, bias=False), nn.BatchNorm2d(middle), nn.ReLU(),
            nn.Conv2d(middle, middle, (1, 7), stride=(1, stride), padding=(0, 3), bias=False),
            nn.BatchNorm2d(middle), nn.ReLU(),
            nn.Conv2d(middle, middle, (7, 1), stride=(stride, 1), padding=(3, 0), bias=False),
            nn.BatchNorm2d(middle), nn.ReLU(),
            nn.Conv2d(middle, channels, 1, bias=False), nn.BatchNorm2d(channels),
        )
    if name == 'sep_conv_3x3':
        layers: List[nn.Module] = []
        for i in range(2):
            layers += [nn.ReLU(),
                       nn.Conv2d(channels, channels, 3, stride=stride if i == 0 else 1,
                                 padding=1, groups=channels, bias=False),
                       nn.Conv2d(channels, channels, 1, bias=False),
                       nn.BatchNorm2d(channels)]
        return nn.Sequential(*layers)
    raise ValueError(f'unknown operation: {name!r}')


class Stem(nn.Module):
    """3x3 strided convolution and BN; returns ``(x, x)`` as the two previous cell outputs."""

    def __init__(self, input_channels: int, channels: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(input_channels, channels, 3, stride=2, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(channels)

    def forward(self, input: Tensor) -> Pair:
        x = self.bn(self.conv(input))
        return x, x


class Cell(nn.Module):
    """A normal or reduction cell: ``(prev, prev_prev) -> (output, prev)``.

    Args:
        genotype: the cell's operations and concatenated states
        channels_prev_prev: channels of the output of the cell before the previous one
        channels_prev: channels of the previous cell's output
        filters: channels of every hidden state of this cell
        reduction: whether this cell halves the resolution (operations on
            the cell inputs have stride 2)
        reduction_prev: whether the previous cell halved the resolution (so
            ``prev_prev`` is twice as large as ``prev``)
    """

    def __init__(self, genotype: Genotype, channels_prev_prev: int, channels_prev: int,
                 filters: int, reduction: bool, reduction_prev: bool) -> None:
        super().__init__()
        pairs, concat = genotype
        if reduction_prev:
            self.preprocess0: nn.Module = FactorizedReduce(channels_prev_prev, filters)
        else:
            self.preprocess0 = nn.Sequential(*relu_conv_bn(channels_prev_prev, filters, (1, 1)))
        self.preprocess1 = nn.Sequential(*relu_conv_bn(channels_prev, filters, (1, 1)))

        self.inputs: List[Tuple[int, int]] = []
        self.ops = nn.ModuleList()
        for (name_a, a), (name_b, b) in pairs:
            for name, index in ((name_a, a), (name_b, b)):
                stride = 2 if reduction and index < 2 else 1
                self.ops.append(operation(name, filters, stride))
            self.inputs.append((a, b))
        self.concat = list(concat)
        self.out_channels = filters * len(self.concat)

    def forward(self, input: Pair) -> Pair:
        prev, prev_prev = input
        states = [self.preprocess0(prev_prev), self.preprocess1(prev)]
        for i, (a, b) in enumerate(self.inputs):
            states.append(self.ops[2 * i](states[a]) + self.ops[2 * i + 1](states[b]))
        return torch.cat([states[i] for i in self.concat], dim=1), prev


class Classifier(nn.Module):
    """ReLU, global average pooling, dropout and the linear classifier on ``prev``."""

    def __init__(self, channels: int, num_classes: int, dropout: float) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.fc = nn.Linear(channels, num_classes)

    def forward(self, input: Pair) -> Tensor:
        x = torch.relu(input[0])
        x = torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1)
        output: Tensor = self.fc(self.dropout(x))
        return output


def amoebanetd(num_layers: int = 18, num_filters: int = 256, *, num_classes: int = 1000,
               input_channels: int = 3, dropout: float = 0.0) -> nn.Sequential:
    """Builds AmoebaNet-D(L, D) as a flat :class:`nn.Sequential <torch.nn.Sequential>`.

    Args:
        num_layers: ``L``, the number of normal cells, a multiple of 3
        num_filters: ``D``, the filters of the first normal stack (at least 4)
        num_classes: outputs of the classifier
        input_channels: channels of the input images
        dropout: dropout probability before the classifier

    Returns:
        nn.Sequential: ``L + 6`` layers, one per cell plus the stem and the
        classifier; the input's height and width must be divisible by 32

    Example::

        >>> model = amoebanetd(3, 8, num_classes=10)
        >>> model(torch.rand(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    if num_layers % 3 or num_layers < 3:
        raise ValueError(f'num_layers must be a positive multiple of 3 (got {num_layers})')
    if num_filters < 4:
        raise ValueError(f'num_filters must be at least 4 (got {num_filters})')

    stem_channels = num_filters // 4
    layers: List[nn.Module] = [Stem(input_channels, stem_channels)]

    # (filters, reduction) of every cell after the stem.
    plan: List[Tuple[int, bool]] = [(num_filters // 4, True), (num_filters // 2, True)]
    per_stack = num_layers // 3
    for stack in range(3):
        if stack > 0:
            plan.append((num_filters * 2 ** stack, True))
        plan += [(num_filters * 2 ** stack, False)] * per_stack

    channels_prev_prev = channels_prev = stem_channels
    reduction_prev = False
    for filters, reduction in plan:
        cell = Cell(REDUCTION if reduction else NORMAL, channels_prev_prev, channels_prev,
                    filters, reduction, reduction_prev)
        layers.append(cell)
        channels_prev_prev, channels_prev = channels_prev, cell.out_channels
        reduction_prev = reduction

    layers.append(Classifier(channels_prev, num_classes, dropout))
    return nn.Sequential(*layers)

"""The tables of docs/any_model.rst: real models through to_sequential, measured.

For each model: the time ``to_sequential`` takes, the children and skip
connections it makes, and the largest difference between the gradients of
the original and those of GPipe over the sequential (3 partitions balanced
by time on ``cpu:0..2``, 4 micro-batches, one forward and backward pass, in
float64).

* ``python -m benchmarks.any_model``: the transformers models of
  :mod:`benchmarks.models.zoo` (needs transformers; the ``dev`` extra has it).
* ``python -m benchmarks.any_model --vision``: CNNs and ViTs of torchvision
  and timm, flattened with no argument (torch.fx), in evaluation mode (batch
  normalization). Needs both libraries, which the extras do not install:
  PyPI's torchvision does not import beside the CPU build of torch 2.13.0
  (see docs/any_model.rst for a pair that works).

It is not one of the registered experiments: it measures no speed.
"""
import argparse
import copy
import sys
import time
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from benchmarks.report import format_table
from torchgpipe import GPipe, to_sequential
from torchgpipe.balance import balance_by_time

HEADERS = ['model', 'to_sequential(model, ...)', 'children', 'skips', 'balance',
           'capture (s)', 'max grad diff']


def measure(name: str, model: nn.Module, inputs: Dict[str, Tensor],
            select: Callable[[Any], Tensor], example: Optional[Dict[str, Tensor]]) -> List[object]:
    """One row of the table, for ``model`` flattened with ``example`` and called on ``inputs``."""
    reference = copy.deepcopy(model)
    tick = time.perf_counter()
    seq = to_sequential(model) if example is None else to_sequential(model,
                                                                      example_inputs=example)
    seconds = time.perf_counter() - tick
    skips = sum(len(getattr(getattr(child, 'module', child), 'stashes', ())) for child in seq)
    input = seq.interface.inputs(**inputs)
    balance = balance_by_time(3, seq, input, timeout=0.2, device='cpu')
    pipe = GPipe(seq, balance, devices=['cpu:0', 'cpu:1', 'cpu:2'], chunks=4)
    expected = select(reference(**inputs))
    target = torch.randn_like(expected)
    F.mse_loss(expected, target).backward()
    F.mse_loss(select(seq.interface.outputs(pipe(input))), target).backward()
    worst = max((p.grad - q.grad).abs().max().item()
                for p, q in zip(model.parameters(), reference.parameters())
                if q.grad is not None)
    how = 'no argument' if example is None else 'example_inputs'
    return [name, how, len(seq), skips, balance, f'{seconds:.2f}', f'{worst:.1e}']


def transformers_rows() -> List[List[object]]:
    from benchmarks.models.zoo import MODELS

    rows = []
    for name, case in MODELS.items():
        torch.manual_seed(0)
        model = case.factory().double()
        if case.evaluate:
            model.eval()
        rows.append(measure(name, model, case.inputs(), case.select,
                            None if case.example is None else case.example()))
    return rows


def vision_rows() -> List[List[object]]:
    import timm
    import torchvision

    factories: Dict[str, Callable[[], nn.Module]] = {
        f'torchvision {name}': (lambda name=name: torchvision.models.get_model(name))
        for name in ['resnet18', 'densenet121', 'mobilenet_v3_small', 'efficientnet_b0',
                     'convnext_tiny', 'regnet_y_400mf', 'vit_b_16', 'swin_t']}
    factories.update({
        f'timm {name}': (lambda name=name: timm.create_model(name))
        for name in ['resnet18', 'densenet121', 'efficientnet_b0', 'convnext_atto',
                     'vit_tiny_patch16_224', 'deit_tiny_patch16_224', 'mobilenetv3_small_100',
                     'regnety_002']})
    rows = []
    for name, factory in factories.items():
        torch.manual_seed(0)
        model = factory().double().eval()
        x = torch.randn(8, 3, 224, 224, dtype=torch.float64)
        argument = next(iter(to_sequential_names(model)))
        try:
            rows.append(measure(name, model, {argument: x}, lambda y: y, None))
        except Exception as exc:  # a row that says what failed
            rows.append([name, f'{type(exc).__name__}: {str(exc)[:60]}', '', '', '', '', ''])
    return rows


def to_sequential_names(model: nn.Module) -> List[str]:
    """The names of ``forward``'s arguments, the first being the image."""
    import inspect
    return list(inspect.signature(model.forward).parameters)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--vision', action='store_true',
                        help='the models of torchvision and timm instead')
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = vision_rows() if args.vision else transformers_rows()
    print(format_table(HEADERS, rows))
    return 0


if __name__ == '__main__':
    sys.exit(main())

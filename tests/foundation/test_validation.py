"""One validation policy: a wrong argument gets the same message from every entry point
that takes it (torchgpipe.foundation.validation checks it for all of them)."""
from typing import Any, Callable, Dict, List

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchgpipe
from torchgpipe import GPipe
from torchgpipe.balance import balance_by_size, balance_by_time
from torchgpipe.balance.blockpartition import solve


def model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))


def messages(calls: List[Callable[[], Any]]) -> List[str]:
    found = []
    for call in calls:
        with pytest.raises((TypeError, ValueError)) as caught:
            call()
        found.append(f'{type(caught.value).__name__}: {caught.value}')
    return found


INPUT, TARGET = torch.randn(4, 8), torch.randn(4, 4)
GPIPE = GPipe(model(), [2, 1], devices=['cpu', 'cpu'])
PLAN: Dict[str, Any] = {'devices': ['cpu:0', 'cpu:1'], 'repeat': 1}


def test_a_loss_function_that_is_no_function() -> None:
    found = messages([lambda: GPIPE.train_step(INPUT, TARGET, 3),  # type: ignore[arg-type]
                      lambda: GPIPE.eval_step(INPUT, TARGET, 3),  # type: ignore[arg-type]
                      lambda: torchgpipe.plan(model(), INPUT, **PLAN, target=TARGET,
                                              loss_fn=3)])  # type: ignore[arg-type]
    assert found == ['TypeError: loss_fn must be callable (loss_fn: 3); pass a function of '
                     '(output, target), e.g. F.mse_loss'] * 3


def test_a_target_without_a_loss_function() -> None:
    found = messages([lambda: GPIPE.eval_step(INPUT, TARGET),
                      lambda: torchgpipe.plan(model(), INPUT, target=TARGET, **PLAN)])
    for caller, message in zip(['eval_step', 'plan'], found):
        assert message.startswith(f'ValueError: {caller} takes a target and a loss_fn '
                                  'together, or neither (target without loss_fn); pass '
                                  'loss_fn too '), message
    found = messages([lambda: torchgpipe.plan(model(), INPUT, loss_fn=F.mse_loss, **PLAN)])
    assert '(loss_fn without target); pass target too ' in found[0]


@pytest.mark.parametrize('partitions', [0, 1.5])
def test_a_number_of_partitions_that_is_no_count(partitions: Any) -> None:
    found = messages([lambda: balance_by_time(partitions, model(), INPUT, device='cpu'),
                      lambda: balance_by_size(partitions, model(), INPUT, device='cpu'),
                      lambda: solve([1, 2, 3], partitions)])
    assert len(set(found)) == 1, found
    assert found[0].endswith(f'(partitions: {partitions}); give the number of devices to '
                             'balance over, such as partitions=2')

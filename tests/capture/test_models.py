"""Real architectures of Hugging Face transformers, flattened with no hand work.

The models of ``benchmarks/models/zoo.py``, in float64, go through
``to_sequential`` as a user would call it (once per model: both paths get a
copy, ``helpers.captured``), then GPipe on a balance by time, on both
execution paths, by forward and backward and by train_step.
"""
import copy
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from helpers import assert_flattened_trains_like_original, captured, cpu_devices
from torchgpipe import GPipe, to_sequential

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.models.zoo import MODELS  # noqa: E402

# Real models, whose lines the smaller tests measure: untraced, at a third of the time.
pytestmark = [pytest.mark.unmeasured, pytest.mark.slow]


@pytest.mark.parametrize('name', list(MODELS))
def test_flattened_model_trains_like_the_original(name: str, threaded: bool) -> None:
    case = MODELS[name]
    model, seq = captured(name, evaluate=case.evaluate)
    assert len(seq) >= 20, 'a row of children to balance'
    assert_flattened_trains_like_original(model, case.inputs(), case.select, threaded, seq=seq)


def test_tied_embedding_and_head_are_children_of_their_own() -> None:
    model, seq = captured('gpt2', torch.float32)
    assert seq.lm_head is model.lm_head and seq.transformer_wte is model.transformer.wte
    assert model.lm_head.weight is model.transformer.wte.weight
    # The state dict keys of the original all reach the same tensors.
    state = seq.state_dict(keep_vars=True)
    for key, tensor in model.state_dict(keep_vars=True).items():
        assert state[seq.state_dict_map[key]] is tensor, key


def test_vision_model_without_example_says_how() -> None:
    model = MODELS['vit'].factory()
    with pytest.raises(RuntimeError, match=r"to_sequential\(module, example_inputs="
                                           r"\{'pixel_values': x\}\)"):
        to_sequential(model)


def test_wrapping_trains_the_users_model_and_leaves_its_registration(threaded: bool) -> None:
    model, seq = captured('gpt2')
    reference = copy.deepcopy(model)
    keys = list(model.state_dict())
    registered = [(name, id(p)) for name, p in model.named_parameters(remove_duplicate=False)]
    pipe = GPipe(seq, [len(seq) // 2, len(seq) - len(seq) // 2],
                 devices=cpu_devices(2, threaded), chunks=2)
    # The tied head keeps its weight registered, as before wrapping.
    assert list(model.state_dict()) == keys and 'lm_head.weight' in keys
    assert [(name, id(p)) for name, p in
            model.named_parameters(remove_duplicate=False)] == registered
    assert len(to_sequential(model)) == len(seq)

    ids = MODELS['gpt2'].inputs()['input_ids']

    def loss_fn(output: Any, labels: Tensor) -> Tensor:
        logits = seq.interface.outputs(output).logits
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten())

    pipe.train_step(seq.interface.inputs(input_ids=ids), ids, loss_fn)
    torch.optim.SGD(pipe.parameters(), lr=0.1).step()
    F.cross_entropy(reference(input_ids=ids).logits.flatten(0, 1), ids.flatten()).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    # The user's own parameters trained, under every key of the user's model.
    trained, wanted = model.state_dict(), reference.state_dict()
    assert list(trained) == keys
    for key in keys:
        torch.testing.assert_close(trained[key], wanted[key], msg=key)
    assert model.lm_head.weight is model.transformer.wte.weight

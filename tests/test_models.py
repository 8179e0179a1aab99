"""Real architectures of Hugging Face transformers, flattened with no hand work.

The models of ``benchmarks/models/zoo.py``, in float64, go through
``to_sequential`` as a user would call it (once per model: both paths get a
copy, ``helpers.captured``), then GPipe on a balance by time, on both
execution paths, by forward and backward and by train_step.
"""
import sys
from pathlib import Path

import pytest
import torch

from helpers import assert_flattened_trains_like_original, captured
from torchgpipe import to_sequential

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.models.zoo import MODELS  # noqa: E402

# Real models, whose lines the smaller tests measure: untraced, at a third of the time.
pytestmark = pytest.mark.unmeasured


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

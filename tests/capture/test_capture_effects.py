"""Capture is never silently wrong: the module stays as it was, and every effect of its
forward (hooks, buffers, aliasing of inputs and views) is reproduced or refused.

Each comparison runs the flattened model inside GPipe on both execution paths,
with torch.fx and with torch.export where both apply, against the unwrapped model.
"""
import copy
from typing import Any, Callable, Dict, List, Optional

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings, strategies as st
from torch import Tensor, nn

from helpers import CHECKPOINT_MODES, cpu_devices
from torchgpipe import GPipe, to_sequential

W = 6
CAPTURES = ['fx', 'export']


def flatten(model: nn.Module, capture: str, example: Any) -> nn.Sequential:
    return to_sequential(model) if capture == 'fx' else \
        to_sequential(model, example_inputs=example)


def state_of(model: nn.Module) -> Dict[str, Any]:
    """What capture must leave as it was: attributes, tensors and their values, hooks."""
    state: Dict[str, Any] = {}
    for path, m in model.named_modules():
        for name, value in m.__dict__.items():
            if isinstance(value, dict):
                value = dict(value)
            state[f'{path}:{name}'] = value
    for key, tensor in model.state_dict(keep_vars=True).items():
        state[f'{key}:value'] = (tensor, tensor.detach().clone(), tensor.grad_fn)
    return state


def assert_unchanged(model: nn.Module, before: Dict[str, Any]) -> None:
    after = state_of(model)
    assert after.keys() == before.keys()
    for key, value in before.items():
        if key.endswith(':value'):
            tensor, data, grad_fn = value
            assert after[key][0] is tensor and after[key][2] is grad_fn, key
            assert torch.equal(after[key][1], data), key
        elif isinstance(value, dict):
            assert after[key].keys() == value.keys(), key
            assert all(after[key][k] is v for k, v in value.items()), key
        else:
            assert after[key] is value or after[key] == value, key


def assert_pipelines_equal(model: nn.Module, seq: nn.Sequential, inputs: Dict[str, Tensor],
                           threaded: bool, checkpoint: str, chunks: int = 2) -> None:
    """GPipe over ``seq``, on every balance of 2 partitions, gives the model's output,
    and, by forward + backward and by train_step, every parameter's gradient."""
    input = seq.interface.inputs(**inputs)
    reference = copy.deepcopy(model)
    expected = reference(*inputs.values())  # positional, as pre-hooks read them
    expected = expected if isinstance(expected, Tensor) else expected[0]
    target = torch.randn_like(expected)
    F.mse_loss(expected, target).backward()
    wanted = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    for cut in range(1, len(seq)):
        gpipe = GPipe(seq, [cut, len(seq) - cut], devices=cpu_devices(2, threaded),
                      chunks=chunks, checkpoint=checkpoint)
        for step in ('forward', 'train_step'):
            model.zero_grad(set_to_none=True)
            if step == 'forward':
                output = gpipe(input)
                output = output if isinstance(output, Tensor) else output[0]
                torch.testing.assert_close(output, expected)
                F.mse_loss(output, target).backward()
            else:
                loss = gpipe.train_step(input, target, lambda out, t: F.mse_loss(
                    out if isinstance(out, Tensor) else out[0], t))
                torch.testing.assert_close(loss, F.mse_loss(expected, target).detach())
            for name, p in model.named_parameters():
                if name in wanted:
                    torch.testing.assert_close(p.grad, wanted[name],
                                               msg=f'{step}, cut {cut}: {name}')
    model.zero_grad(set_to_none=True)


# 1. One tensor given for two arguments.

class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fa, self.fb = nn.Linear(W, W), nn.Linear(W, W)

    def forward(self, a: Tensor, b: Tensor) -> Tensor:
        return self.fa(a) * self.fb(b)


def test_one_tensor_given_for_two_arguments_is_two_inputs(threaded: bool) -> None:
    model = TwoInputs().double()
    x = torch.randn(3, W, dtype=torch.float64)
    seq = to_sequential(model, example_inputs={'a': x, 'b': x})
    inputs = {'a': torch.randn(4, W, dtype=torch.float64),
              'b': torch.randn(4, W, dtype=torch.float64)}
    assert_pipelines_equal(model, seq, inputs, threaded, 'except_last')


# Untraced: torch.export of T5 makes many Python calls, which coverage.py's
# tracing slows by half again; the capture's lines are measured by other tests.
@pytest.mark.slow
@pytest.mark.unmeasured
def test_t5_with_its_dummy_inputs_reads_both_inputs() -> None:
    transformers = pytest.importorskip('transformers')
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=16, num_layers=1,
                                   num_decoder_layers=1, num_heads=2, dropout_rate=0.0,
                                   decoder_start_token_id=0)
    model = transformers.T5ForConditionalGeneration(config).double().eval()
    seq = to_sequential(model)  # dummy_inputs: one tensor for both ids
    ids, decoder_ids = torch.randint(0, 32, (2, 5)), torch.randint(0, 32, (2, 5))
    mask = torch.ones(2, 5, dtype=torch.long)
    got = seq.interface.outputs(seq(seq.interface.inputs(
        input_ids=ids, decoder_input_ids=decoder_ids, decoder_attention_mask=mask)))
    wanted = model(input_ids=ids, decoder_input_ids=decoder_ids, decoder_attention_mask=mask)
    torch.testing.assert_close(got.logits, wanted.logits)


# 2. An update in place of a view whose memory crosses children.

class ViewUpdated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        v = h[:, :3]
        t = self.act(h)  # reads h before the update
        v.add_(1)  # updates h through its view
        return self.fc3(h) + self.fc2(t)  # fc3 reads h after it


@pytest.mark.slow
@pytest.mark.parametrize('capture', CAPTURES)
def test_update_of_a_view_is_seen_by_every_reader(capture: str, checkpoint: str,
                                                  threaded: bool) -> None:
    model = ViewUpdated().double()
    x = torch.randn(4, W, dtype=torch.float64)
    seq = flatten(model, capture, x[:2])
    assert_pipelines_equal(model, seq, {'x': x}, threaded, checkpoint)


def test_update_read_only_through_its_result_is_not_merged() -> None:
    """bn -> relu(inplace=True) -> linear stay three children: nothing else reads bn's output."""
    model = nn.Sequential(nn.Linear(W, W), nn.BatchNorm1d(W), nn.ReLU(inplace=True),
                          nn.Linear(W, W))
    for capture in CAPTURES:
        seq = flatten(model, capture, torch.randn(2, W))
        children = list(seq)
        assert model[1] in children and model[2] in children, capture


# 3. A buffer updated under torch.no_grad() in forward, and 4. state assigned in forward.

class RunningAverage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(W, W), nn.Linear(W, W)
        self.register_buffer('avg', torch.zeros(W))

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        with torch.no_grad():
            self.avg.mul_(0.9).add_(h.mean(0) * 0.1)
        return self.out(h)


class Counting(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.count = 0

    def forward(self, x: Tensor) -> Tensor:
        self.count += 1
        return self.fc(x)


class Assigning(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(x)
        self.last = h.mean()
        return h


@pytest.mark.parametrize('capture', CAPTURES)
@pytest.mark.parametrize('model, words', [
    (RunningAverage, r'updates a buffer outside the module holding it \(updated: avg\)'),
    (Counting, r"changes the module's state.*\(changed: count\)"),
    (Assigning, r"changes the module's state.*\(changed: last\)"),
], ids=['buffer_under_no_grad', 'counter', 'assigned_tensor'])
def test_forward_changing_state_is_refused_and_the_model_left_as_it_was(
        capture: str, model: Callable[[], nn.Module], words: str) -> None:
    original = model()
    before = state_of(original)
    with pytest.raises(RuntimeError, match=words):
        flatten(original, capture, torch.randn(2, W))
    assert_unchanged(original, before)
    copy.deepcopy(original)  # a buffer with a grad_fn would fail here


def test_running_average_kept_whole_runs_in_the_pipeline(threaded: bool) -> None:
    class Average(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer('avg', torch.zeros(W))

        def forward(self, h: Tensor) -> Tensor:
            with torch.no_grad():
                self.avg.mul_(0.9).add_(h.mean(0) * 0.1)
            return h

    model = nn.Sequential(nn.Linear(W, W), Average(), nn.Linear(W, W))
    seq = to_sequential(model, leaf_modules=[Average])
    assert seq[1] is model[1]
    gpipe = GPipe(seq, [1, 2], devices=cpu_devices(2, threaded), chunks=1)
    gpipe(torch.randn(4, W))
    # The user's own buffer is updated, once per micro-batch.
    assert model[1].avg.abs().sum() > 0 and model[1].avg.grad_fn is None


# 5. Hooks.

def forward_hook(module: nn.Module, args: Any, output: Tensor) -> Tensor:
    return output * 3


def pre_hook(module: nn.Module, args: Any) -> Any:
    return (args[0] * 2,) + tuple(args[1:])


class Hooked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.inner = nn.Sequential(nn.Linear(W, W), nn.Tanh())
        self.out = nn.Linear(W, W)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.inner(self.fc(x)))


@pytest.mark.slow
@pytest.mark.parametrize('capture', CAPTURES)
@pytest.mark.parametrize('where', ['model', 'inner', 'fc'])
@pytest.mark.parametrize('hook', ['forward', 'pre'])
def test_hooks_run_as_registered(capture: str, where: str, hook: str, threaded: bool) -> None:
    model = Hooked().double()
    module = {'model': model, 'inner': model.inner, 'fc': model.fc}[where]
    if hook == 'forward':
        module.register_forward_hook(forward_hook)
    else:
        module.register_forward_pre_hook(pre_hook)
    x = torch.randn(4, W, dtype=torch.float64)
    before = state_of(model)
    seq = flatten(model, capture, x[:2])
    assert_unchanged(model, before)
    if where != 'model':
        # Kept whole: its hooks run at each call, as the user wrote them.
        assert any(m is module for m in seq.modules())
    assert_pipelines_equal(model, seq, {'x': x}, threaded, 'except_last')


@pytest.mark.parametrize('capture', CAPTURES)
def test_hook_with_side_effects_runs_at_each_call(capture: str, threaded: bool) -> None:
    model = Hooked()
    seen: List[int] = []
    model.inner.register_forward_hook(lambda m, args, out: seen.append(out.size(0)))
    seq = flatten(model, capture, torch.randn(2, W))
    seen.clear()
    GPipe(seq, [1, len(seq) - 1], devices=cpu_devices(2, threaded), chunks=2)(torch.randn(4, W))
    assert seen == [2, 2]


def test_backward_hook_of_the_model_is_refused() -> None:
    model = Hooked()
    model.register_full_backward_hook(lambda m, grad_input, grad_output: None)
    with pytest.raises(RuntimeError, match='cannot capture backward hooks of the module itself'):
        to_sequential(model)


def test_hooks_of_a_model_fx_calls_through_a_wrapper_are_refused_before_tracing() -> None:
    class KeywordOnly(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(W, W)

        def forward(self, x: Tensor, *, scale: float = 1.0) -> Tensor:
            return self.fc(x) * scale

    model = KeywordOnly()
    model.register_forward_hook(forward_hook)
    with pytest.raises(RuntimeError, match=r'^torch.fx cannot trace the hooks of a module whose '
                                           r'forward takes .* keyword-only arguments '
                                           r'\(module: KeywordOnly with hooks\)'):
        to_sequential(model)
    # torch.export runs them.
    x = torch.randn(4, W)
    seq = to_sequential(model, example_inputs=x[:2])
    torch.testing.assert_close(seq(x), model(x))


# Also: what the interface and the example are given.

def test_fx_outputs_are_plain_dicts_and_lists() -> None:
    class Structured(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(W, W)

        def forward(self, x: Tensor) -> Dict[str, Any]:
            h = self.fc(x)
            return {'h': h, 'pair': [h * 2, x + 1]}

    seq = to_sequential(Structured())
    out = seq.interface.outputs(seq(torch.randn(3, W)))
    assert type(out) is dict and type(out['pair']) is list
    out['extra'] = 1  # as on what the model returns
    with pytest.raises(TypeError, match=r'outputs takes the 3 tensors the sequential returns '
                                        r'\(output: 1 tensors\)'):
        seq.interface.outputs(torch.randn(3, W))


@pytest.mark.parametrize('example', [5, 'x', {}, (), {'x': None}], ids=repr)
def test_example_without_a_tensor_is_refused_before_forward_runs(example: Any) -> None:
    model = Counting()
    with pytest.raises(TypeError, match=r'example_inputs must hold a tensor.*'
                                        r"give an example batch .* such as \{'x': x\}"):
        to_sequential(model, example_inputs=example)
    assert model.count == 0


def test_numpy_example_is_refused_naming_the_fix() -> None:
    numpy = pytest.importorskip('numpy')
    with pytest.raises(TypeError, match=r"example_inputs\['x'\] must be a tensor, not a numpy "
                                        r'array .* torch.from_numpy\(x\)'):
        to_sequential(Counting(), example_inputs=numpy.zeros((2, W), dtype='float32'))


# The property: random small models with buffers, hooks, updates in place and
# shared inputs are left as they were by capture, and flatten into sequentials
# that equal them inside GPipe, with either capture, on both paths.

PIECES = ['linear', 'relu_inplace', 'view_update', 'iadd', 'buffer_shift', 'hooked',
          'second_input']


class Random(nn.Module):
    def __init__(self, pieces: List[str]) -> None:
        super().__init__()
        self.pieces = pieces
        self.layers = nn.ModuleList(
            nn.ReLU(inplace=True) if piece == 'relu_inplace' else nn.Linear(W, W)
            for piece in pieces)
        self.register_buffer('shift', torch.linspace(-1, 1, W))
        for piece, layer in zip(pieces, self.layers):
            if piece == 'hooked':
                layer.register_forward_hook(forward_hook)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = x
        for piece, layer in zip(self.pieces, self.layers):
            if piece == 'view_update':
                g = layer(h)
                v = g[:, :2]
                before = torch.sigmoid(g)
                v.mul_(2)
                h = g + before
            elif piece == 'iadd':
                g = layer(h)
                g += h
                h = g
            elif piece == 'buffer_shift':
                h = layer(h) + self.shift
            elif piece == 'second_input':
                h = layer(h) * y
            else:
                h = layer(h)
        return h


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pieces=st.lists(st.sampled_from(PIECES), min_size=2, max_size=5).filter(
           # relu_(relu_(h)) fails the unwrapped model's backward: ReLU keeps its result.
           lambda p: all(p[i:i + 2] != ['relu_inplace'] * 2 for i in range(len(p)))),
       capture=st.sampled_from(CAPTURES), same_input=st.booleans(),
       checkpoint=st.sampled_from(CHECKPOINT_MODES), threaded=st.booleans(),
       hooked_model=st.booleans())
@pytest.mark.slow
def test_capture_leaves_the_model_and_equals_it_in_gpipe(
        pieces: List[str], capture: str, same_input: bool, checkpoint: str, threaded: bool,
        hooked_model: bool) -> None:
    torch.manual_seed(0)
    model = Random(['linear'] + pieces).double()
    if hooked_model:
        model.register_forward_hook(forward_hook)
    x = torch.randn(4, W, dtype=torch.float64)
    y = x if same_input else torch.randn(4, W, dtype=torch.float64)
    before = state_of(model)
    example: Optional[Dict[str, Tensor]] = {'x': x[:2], 'y': y[:2]}
    seq = flatten(model, capture, example)
    assert_unchanged(model, before)
    assert_pipelines_equal(model, seq, {'x': x, 'y': torch.randn(4, W, dtype=torch.float64)},
                           threaded, checkpoint)

"""to_sequential with torch.export: models fx cannot trace, keyword inputs, structured outputs."""
import copy
import functools
from typing import Any, Callable, Dict, Optional, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import (COPIERS, assert_flattened_trains_like_original, assert_runs_in_both_modes,
                     capture_once, cpu_devices)
from test_flatten import DataDependent
from torchgpipe import GPipe, to_sequential
from torchgpipe.balance import balance_by_time

V, W, B, T = 20, 8, 8, 6


def keywords(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A decorator as transformers writes them: the forward becomes (self, *args, **kwargs)."""
    @functools.wraps(forward)
    def wrapper(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        return forward(self, *args, **kwargs)
    return wrapper


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.fc = nn.Linear(W, W)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        # Mixes the positions a token may see: a second argument, so the
        # block is traced through.
        mixed = (mask.unsqueeze(-1) * x.unsqueeze(1)).sum(2) / mask.sum(-1, keepdim=True)
        return x + self.fc(F.gelu(self.norm(mixed)))


class LanguageModel(nn.Module):
    """Written as a transformers model: keyword inputs, checks on sizes, a dict out."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, W)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.norm = nn.LayerNorm(W)
        self.head = nn.Linear(W, V, bias=False)
        self.head.weight = self.embed.weight  # tied

    @keywords
    def forward(self, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                labels: Optional[Tensor] = None) -> Dict[str, Tensor]:
        batch, length = input_ids.shape
        if attention_mask is not None and attention_mask.shape[0] != batch:
            raise ValueError('one mask per sequence')
        mask = torch.ones(length, length, device=input_ids.device).tril()
        if attention_mask is not None:
            mask = mask * attention_mask[:, None, :].to(mask.dtype)
        else:
            mask = mask.expand(batch, length, length)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, mask)
        logits = self.head(self.norm(x))
        out = {'logits': logits}
        if labels is not None:
            out['loss'] = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return out


class WithDummyInputs(LanguageModel):
    """Says how it is called, as transformers models do."""

    @property
    def dummy_inputs(self) -> Dict[str, Tensor]:
        return {'input_ids': torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9]]),
                'decoder_input_ids': torch.tensor([[1]])}  # not an argument: left out


def ids(batch: int = B) -> Tensor:
    return torch.randint(0, V, (batch, T))


def logits(output: Dict[str, Tensor]) -> Tensor:
    return output['logits']


def test_fx_failure_tells_to_give_an_example() -> None:
    with pytest.raises(RuntimeError, match=r'torch.fx cannot trace the module itself '
                                           r'\(LanguageModel\).*or give an example input to '
                                           r'capture it with torch.export instead: '
                                           r"to_sequential\(module, "
                                           r"example_inputs=\{'input_ids': x\}\)"):
        to_sequential(LanguageModel())


# Each capture below serves both paths (or every length): made once, copied.

def captured_by_default(model: nn.Module) -> Tuple[nn.Module, nn.Sequential]:
    return model, to_sequential(model)


def captured_on(model: nn.Module, example: Any) -> Tuple[nn.Module, nn.Sequential]:
    return model, to_sequential(model, example_inputs=example)


@pytest.mark.slow
def test_model_that_gives_dummy_inputs_flattens_with_no_argument(threaded: bool) -> None:
    model, seq = capture_once('dummy inputs', lambda: captured_by_default(WithDummyInputs()))
    assert seq.interface.names == ('input_ids',)
    # Calls of modules whose forward takes one tensor are children again:
    # the user's own modules, tied weights included.
    assert seq.head is model.head and model.embed in list(seq.modules())
    assert seq.blocks_2_norm is model.blocks[2].norm
    assert_flattened_trains_like_original(model, {'input_ids': ids()}, logits, threaded,
                                          seq=seq)


@pytest.mark.slow
def test_keyword_inputs_and_dict_output(threaded: bool) -> None:
    model, seq = capture_once('keywords', lambda: captured_on(LanguageModel(), {
        'input_ids': ids(3), 'attention_mask': torch.ones(3, T)}))
    mask = (torch.rand(B, T) > 0.3).float()
    mask[:, 0] = 1
    assert seq.interface.names == ('input_ids', 'attention_mask')
    assert_flattened_trains_like_original(model, {'input_ids': ids(), 'attention_mask': mask},
                                          logits, threaded, seq=seq)


@pytest.mark.parametrize('length', [1, 2, T + 3])
def test_any_size_of_any_dimension(length: int) -> None:
    """Captured on 3 sequences of T tokens, called on micro-batches of 1 of other lengths."""
    model, seq = capture_once('one input', lambda: captured_on(LanguageModel(), (ids(3),)))
    x = torch.randint(0, V, (4, length))
    gpipe = GPipe(seq, [len(seq) // 2, len(seq) - len(seq) // 2], devices=['cpu'] * 2,
                  chunks=4)
    torch.testing.assert_close(seq.interface.outputs(gpipe(x))['logits'],
                               model(x)['logits'])


def test_loss_computed_by_the_model() -> None:
    model = LanguageModel()
    x, labels = ids(), ids()
    seq = to_sequential(model, example_inputs={'input_ids': ids(3), 'labels': ids(3)})
    assert seq.interface.names == ('input_ids', 'labels')
    actual = seq.interface.outputs(seq(seq.interface.inputs(x, labels=labels)))
    expected = model(x, labels=labels)
    assert actual.keys() == expected.keys()
    torch.testing.assert_close(actual['loss'], expected['loss'])
    grad, = torch.autograd.grad(actual['loss'], model.embed.weight)
    expected_grad, = torch.autograd.grad(expected['loss'], model.embed.weight)
    torch.testing.assert_close(grad, expected_grad)

    # A loss per micro-batch has no batch dimension to gather along.
    gpipe = GPipe(seq, [1, len(seq) - 1], devices=['cpu'] * 2, chunks=2)
    with pytest.raises(ValueError, match='compute the loss from the output'):
        gpipe(seq.interface.inputs(x, labels=labels))


def test_generated_children_follow_the_mode() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(W, W)

        @keywords
        def forward(self, x: Tensor) -> Tensor:
            # Recorded as dropout on, or off: captured in each mode.
            return self.fc(F.dropout(x, 0.5, self.training))

    model = Noisy()
    seq = to_sequential(model, example_inputs=torch.randn(2, W))
    assert model.training and seq.training
    x = torch.randn(4, W)
    y = assert_runs_in_both_modes(seq, model, x)
    assert not torch.equal(y, seq.eval()(x))
    evaluating = to_sequential(model.eval(), example_inputs=torch.randn(2, W))
    torch.testing.assert_close(evaluating(x), model(x))
    # The profiler runs layers in training mode.
    assert sum(balance_by_time(2, evaluating, x, timeout=0.05, device='cpu')) == len(evaluating)
    # The folded calls are the user's modules, in their modes.
    dropout = nn.Sequential(nn.Linear(W, W), nn.Dropout(0.5)).eval()
    seq = to_sequential(dropout, example_inputs=x)
    assert seq[1] is dropout[1] and not seq[1].training
    torch.testing.assert_close(seq(x), dropout(x))


@pytest.mark.parametrize('copier', COPIERS)
def test_copies_train_like_the_original(copier: Callable[[nn.Module], nn.Module]) -> None:
    _, seq = capture_once('dummy inputs', lambda: captured_by_default(WithDummyInputs()))
    copy = copier(seq)
    x = ids()
    torch.testing.assert_close(copy.interface.outputs(copy(x)), seq.interface.outputs(seq(x)))
    loss = copy.interface.outputs(copy(x))['logits'].pow(2).mean()
    loss.backward()
    assert all(p.grad is not None for p in copy.parameters())
    assert copy.state_dict_map == seq.state_dict_map


def test_state_dict_map_moves_checkpoints() -> None:
    model, seq = capture_once('dummy inputs', lambda: captured_by_default(WithDummyInputs()))
    state = seq.state_dict()
    assert set(seq.state_dict_map) == set(model.state_dict())
    for key, value in model.state_dict().items():
        assert state[seq.state_dict_map[key]] is value or \
            state[seq.state_dict_map[key]].data_ptr() == value.data_ptr()
    other = WithDummyInputs()
    seq.load_state_dict({seq.state_dict_map[k]: v for k, v in other.state_dict().items()})
    x = ids()
    torch.testing.assert_close(seq.interface.outputs(seq(x))['logits'], other(x)['logits'])


def test_errors_before_capture() -> None:
    model = LanguageModel()
    with pytest.raises(TypeError, match="example_inputs must name arguments of module.forward"
                                        r" \(example_inputs: 'mask' unknown\)"):
        to_sequential(model, example_inputs={'input_ids': ids(), 'mask': ids()})
    with pytest.raises(TypeError, match='leaf_modules and concrete_args apply to the torch.fx'):
        to_sequential(model, example_inputs=ids(), leaf_modules=[Block])
    with pytest.raises(TypeError, match='which gives dummy_inputs'):
        to_sequential(WithDummyInputs(), concrete_args={'labels': None})
    with pytest.raises(TypeError, match='example_inputs holds 4 arguments'):
        to_sequential(model, example_inputs=(ids(),) * 4)


def test_interface_errors() -> None:
    _, seq = capture_once('keywords', lambda: captured_on(LanguageModel(), {
        'input_ids': ids(3), 'attention_mask': torch.ones(3, T)}))
    x, mask = ids(), torch.ones(B, T)
    assert seq.interface.inputs(x, mask)[0] is x
    assert seq.interface.inputs(attention_mask=mask, input_ids=x)[1] is mask
    with pytest.raises(TypeError, match='the sequential needs attention_mask'):
        seq.interface.inputs(x)
    with pytest.raises(TypeError, match="the sequential takes no input 'mask'"):
        seq.interface.inputs(x, mask=mask)
    with pytest.raises(TypeError, match="inputs got 'input_ids' twice"):
        seq.interface.inputs(x, input_ids=x)
    with pytest.raises(TypeError, match='inputs takes at most 2 positional arguments'):
        seq.interface.inputs(x, mask, mask)
    # Captured without labels: the labels=None of the capture only.
    assert seq.interface.inputs(x, mask, labels=None)[0] is x
    with pytest.raises(TypeError, match='labels was fixed to None when the model was captured'):
        seq.interface.inputs(x, mask, labels=x)


def test_what_export_cannot_capture_is_named() -> None:
    # A branch on the values of a tensor: no capture makes one graph of it.
    with pytest.raises(RuntimeError, match=r'torch.export cannot capture the module '
                                           r'\(DataDependent\)'):
        to_sequential(DataDependent(), example_inputs=torch.randn(2, W))

    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(W, W)
            self.register_buffer('calls', torch.zeros(()))

        def forward(self, x: Tensor) -> Tensor:
            self.calls.add_(1)
            return self.fc(x)

    with pytest.raises(RuntimeError, match='updates a buffer outside the module holding it '
                                           r'\(updated: calls\)'):
        to_sequential(Counting(), example_inputs=torch.randn(2, W))


def test_structured_output_through_fx(threaded: bool) -> None:
    class Heads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(W, W)
            self.a, self.b = nn.Linear(W, 2), nn.Linear(W, 3)

        def forward(self, x: Tensor) -> Dict[str, Any]:
            h = self.body(x)
            return {'a': self.a(h), 'pair': [self.b(h), h]}

    model = Heads()
    seq = to_sequential(model)
    assert seq.interface.names == ('x',)
    x = torch.randn(B, W)
    gpipe = GPipe(seq, [len(seq) - 1, 1], devices=cpu_devices(2, threaded), chunks=4)
    out = seq.interface.outputs(gpipe(x))
    expected = model(x)
    assert out.keys() == expected.keys() and isinstance(out['pair'], list)
    torch.testing.assert_close(out, expected)


class Bottleneck(nn.Module):
    """A residual block as torchvision writes it: ``out += identity``, an update in place."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(channels, channels, 1), nn.Conv2d(channels, channels, 1)
        self.bn = nn.BatchNorm2d(channels)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.conv1(x))
        out = self.bn(self.conv2(out))
        out += identity
        return self.relu(out)


@pytest.mark.slow
@pytest.mark.parametrize('checkpoint', ['always', 'except_last'])
def test_updates_in_place_of_values_from_other_children(checkpoint: str,
                                                        threaded: bool) -> None:
    """A child that updated a popped skip in place changed it under its recomputation."""
    model = nn.Sequential(Bottleneck(2), Bottleneck(2)).double().eval()
    x = torch.randn(4, 2, 3, 3, dtype=torch.float64)
    seq = to_sequential(model, example_inputs=x)
    for cut in range(1, len(seq)):
        reference = copy.deepcopy(model)
        gpipe = GPipe(seq, [cut, len(seq) - cut], devices=cpu_devices(2, threaded), chunks=2,
                      checkpoint=checkpoint)
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        reference(x1).pow(2).sum().backward()
        gpipe(x2).pow(2).sum().backward()
        torch.testing.assert_close(x2.grad, x1.grad)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
        model.zero_grad(set_to_none=True)


def test_mode_check_runs_when_the_mode_recorded_nothing() -> None:
    class NoisyInTraining(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(W, W), nn.Linear(W, W)

        def forward(self, x: Tensor) -> Tensor:
            if self.training:  # recorded as nothing in evaluation mode
                x = x * torch.rand_like(x)
            return self.fc2(self.fc1(x))

    # A branch on self.training cuts the graph of each mode into other
    # children: one sequential cannot run both.
    model = NoisyInTraining().eval()
    seq = to_sequential(model, example_inputs=torch.randn(2, W))
    seq.train()
    with pytest.raises(RuntimeError, match=r'captured in evaluation mode .* cannot run in '
                                           r'training mode: its forward runs other code in '
                                           r'training mode, which cuts into 3 parts, not 2'):
        seq(torch.randn(2, W))
    x = torch.randn(2, W)
    torch.testing.assert_close(seq.eval()(x), model(x))


def test_buffer_updated_through_a_view_is_refused() -> None:
    class Counting(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(W, W)
            self.register_buffer('count', torch.zeros(2))

        def forward(self, x: Tensor) -> Tensor:
            self.count[0] += 1
            return self.fc(x)

    with pytest.raises(RuntimeError, match=r'updates a buffer .* \(updated: count\)'):
        to_sequential(Counting(), example_inputs=torch.randn(2, W))


def test_inputs_in_the_order_of_forward() -> None:
    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(W, W)

        def forward(self, input: Tensor, mask: Tensor) -> Tensor:
            return self.fc(input) * mask

    model = Masked()
    x, mask = torch.randn(4, W), torch.rand(4, W)
    seq = to_sequential(model, example_inputs={'mask': mask[:2], 'input': x[:2]})
    assert seq.interface.names == ('input', 'mask')
    torch.testing.assert_close(seq(seq.interface.inputs(x, mask)), model(x, mask))
    # fx renames a node named after a builtin; the interface keeps the argument's name.
    traced = to_sequential(model)
    assert traced.interface.names == ('input', 'mask')
    torch.testing.assert_close(traced(traced.interface.inputs(input=x, mask=mask)),
                               model(x, mask))


@pytest.mark.parametrize('context', ['no_grad', 'autocast'])
def test_module_called_in_a_context_stays_in_it(context: str) -> None:
    class InContext(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc, self.out = nn.Linear(W, W), nn.Linear(W, W)

        def forward(self, x: Tensor) -> Tensor:
            manager = torch.no_grad() if context == 'no_grad' else \
                torch.autocast('cpu', enabled=False)
            with manager:
                h = self.fc(x)
            return self.out(h) + x

    model = InContext()
    x = torch.randn(4, W, requires_grad=True)
    seq = to_sequential(model, example_inputs=torch.randn(2, W))
    assert model.fc not in list(seq), 'folded out of its context'
    torch.testing.assert_close(seq(x), model(x))


def test_examples_export_would_misread_are_refused() -> None:
    model = LanguageModel()
    with pytest.raises(ValueError, match=r"example_inputs\['input_ids'\] must hold at least 2 "
                                         r'samples \(input_ids: shape \(1, 6\)\)'):
        to_sequential(model, example_inputs=ids(1))

    class Pair(nn.Module):
        def forward(self, pair: Tuple[Tensor, Tensor]) -> Tensor:
            return pair[0] + pair[1]

    with pytest.raises(TypeError, match=r"example_inputs\['pair'\] must be a tensor or a "
                                        r'constant \(pair: a tuple of tensors\)'):
        to_sequential(Pair(), example_inputs=((torch.ones(2), torch.ones(2)),))

"""A sequential captured by torch.export runs in both modes, as the model it came from.

Hugging Face models come from their constructor in training mode, with
dropout on, partly as modules (``nn.Dropout``, which follow the mode when
called) and partly written functionally (``F.dropout(x, p, self.training)``,
the attention's ``dropout_p``), which export records in one mode.
``to_sequential`` captures the other mode too, into the same children:
``pipe.train()``, ``pipe.eval()``, ``train_step``, ``eval_step`` and
``generate`` then go in any order, each equal to the unwrapped model in
that mode, and the user's model is left in its modes. torch.fx bakes the
mode into its trace too. The generated children follow the user's
``model.train()`` and ``model.eval()``; a mode they cannot run is refused
before a step starts.
"""
import copy
import gc
import pickle
import weakref
from typing import Any, Callable, Dict, List, Tuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from helpers import assert_runs_in_both_modes, capture_once, cpu_devices
from torchgpipe import GPipe, generate, to_sequential
from torchgpipe.balance import balance_by_time
from torchgpipe.capture.cut import GeneratedChild

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

transformers = pytest.importorskip('transformers')

V, B, T = 100, 4, 8  # vocabulary, batch, sequence length


def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=V, n_positions=64,
        resid_pdrop=0.2, embd_pdrop=0.2, attn_pdrop=0.2))


def llama() -> nn.Module:
    # Its only dropout is functional: the attention's, on in training only.
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=64, vocab_size=V, max_position_embeddings=64,
        attention_dropout=0.2))


MODELS: Dict[str, Callable[[], nn.Module]] = {'gpt2': gpt2, 'llama': llama}


def modes(model: nn.Module) -> List[Tuple[str, bool]]:
    return [(name, m.training) for name, m in model.named_modules()]


def grads(model: nn.Module) -> Dict[str, Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def ids(seed: int) -> Tensor:
    return torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(seed))


def lm_loss(logits: Tensor, labels: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))


def fresh_capture(name: str) -> Tuple[nn.Module, nn.Sequential]:
    """A model fresh from its constructor (training mode) and its capture,
    which leaves it in its modes; captured once for both paths."""
    def build() -> Tuple[nn.Module, nn.Sequential]:
        torch.manual_seed(0)
        model = MODELS[name]().double()
        assert model.training
        before = modes(model)
        seq = to_sequential(model)
        assert modes(model) == before, 'to_sequential left the model in its modes'
        return model, seq
    return capture_once(('fresh', name), build)


# llama on both paths; gpt2, whose layers differ but whose path is the same, on threads.
@pytest.mark.parametrize('name, threaded', [('gpt2', True), ('llama', False), ('llama', True)],
                         ids=['threads-gpt2', 'inline-llama', 'threads-llama'])
def test_fresh_model_trains_evaluates_generates_and_trains_again(name: str,
                                                                 threaded: bool) -> None:
    model, seq = fresh_capture(name)
    before = modes(model)
    reference = copy.deepcopy(model)
    # The user's own modules are the sequential's children, not copies.
    held = {id(m) for m in model.modules()}
    assert sum(id(child) in held for child in seq.children()) >= 5
    # One child per chunk of work: 2 partitions, 1 micro-batch, so that the
    # random numbers are drawn in the unwrapped model's order.
    pipe = GPipe(seq, [len(seq) // 2, len(seq) - len(seq) // 2],
                 devices=cpu_devices(2, threaded), chunks=1)

    def logits_of(output: Any) -> Tensor:
        return seq.interface.outputs(output).logits  # type: ignore[no-any-return]

    def loss_fn(output: Any, labels: Tensor) -> Tensor:
        return lm_loss(logits_of(output), labels)

    def train(seed: int) -> None:
        x, labels = ids(seed), ids(seed + 1)
        torch.manual_seed(seed)
        loss = pipe.train_step(seq.interface.inputs(input_ids=x), labels, loss_fn)
        torch.manual_seed(seed)
        expected = lm_loss(reference(input_ids=x).logits, labels)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach())
        got, wanted = grads(model), grads(reference)
        assert got.keys() == wanted.keys()
        for key in wanted:
            torch.testing.assert_close(got[key], wanted[key], msg=key)
        # Dropout dropped: the loss is not the evaluation's.
        with torch.no_grad():
            assert not torch.allclose(loss, lm_loss(copy.deepcopy(reference).eval()(
                input_ids=x).logits, labels))
        for m in (model, reference):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
            m.zero_grad(set_to_none=True)

    def evaluate(seed: int) -> None:
        x, labels = ids(seed), ids(seed + 1)
        modes_before = modes(reference)
        with torch.no_grad():
            expected = reference.eval()(input_ids=x).logits
        reference.train()
        assert modes(reference) == modes_before
        torch.testing.assert_close(logits_of(pipe.eval_step(seq.interface.inputs(input_ids=x))),
                                   expected)
        torch.testing.assert_close(
            pipe.eval_step(seq.interface.inputs(input_ids=x), labels, loss_fn),
            lm_loss(expected, labels))
        assert pipe.training and modes(model) == before
        pipe.eval()
        with torch.no_grad():
            torch.testing.assert_close(logits_of(pipe(seq.interface.inputs(input_ids=x))),
                                       expected)
        pipe.train()
        assert modes(model) == before
        # Greedy tokens of Hugging Face's generate on the unwrapped model.
        reference.eval()
        wanted = reference.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                                    max_new_tokens=3, pad_token_id=0)
        reference.train()
        assert torch.equal(generate(pipe, x, 3, interface=seq.interface), wanted)
        assert pipe.training and modes(model) == before

    train(10)
    evaluate(20)
    train(30)
    evaluate(40)
    assert modes(model) == before


class Noisy(nn.Module):
    """Dropout written functionally between two layers, and once as a module."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        h = F.dropout(torch.tanh(self.fc1(x)), 0.5, self.training)
        return self.drop(self.fc2(h)) + x


@pytest.mark.parametrize('capture', ['fx', 'export'])
@pytest.mark.parametrize('start', ['train', 'eval'])
def test_functional_dropout_follows_the_mode(start: str, capture: str) -> None:
    torch.manual_seed(0)
    model = Noisy().double().train(start == 'train')
    before = modes(model)
    seq = to_sequential(model, example_inputs=None if capture == 'fx' else
                        torch.randn(2, 8, dtype=torch.float64))
    assert modes(model) == before
    x = torch.randn(4, 8, dtype=torch.float64)
    for mode in [True, False, True, False]:
        seq.train(mode)
        model.train(mode)
        torch.manual_seed(1)
        actual = seq(x)
        torch.manual_seed(1)
        torch.testing.assert_close(actual, model(x))
    model.train(start == 'train')
    assert modes(model) == before or start == 'train'


def test_fx_traces_a_constant_of_each_mode() -> None:
    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x: Tensor) -> Tensor:
            # One code in both modes, reading a tensor fx keeps of each.
            return self.fc(x) * torch.full((), 0.5 if self.training else 2.0)

    model = Scaled()
    assert_runs_in_both_modes(to_sequential(model), model, torch.randn(4, 8))


@pytest.mark.parametrize('copier', [copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))],
                         ids=['deepcopy', 'pickle'])
def test_copies_run_in_both_modes_and_keep_the_state_dict(copier: Callable[[Any], Any]) -> None:
    torch.manual_seed(0)
    model = Noisy().double()
    seq = to_sequential(model, example_inputs=torch.randn(2, 8, dtype=torch.float64))
    keys = seq.state_dict().keys()
    assert sorted(keys) == sorted(seq.state_dict_map[k] for k in model.state_dict())
    twin = copier(seq)
    assert twin.state_dict().keys() == keys
    x = torch.randn(4, 8, dtype=torch.float64)
    assert_runs_in_both_modes(twin, model, x, seed=1)
    # The other mode's code reads the copy's tensors: moved with it.
    twin.float()
    with torch.no_grad():
        assert twin.eval()(x.float()).dtype == torch.float32


def test_balance_by_time_profiles_training() -> None:
    seq = to_sequential(Noisy().eval(), example_inputs=torch.randn(2, 8))
    x = torch.randn(4, 8)
    assert sum(balance_by_time(2, seq, x, timeout=0.05, device='cpu')) == len(seq)


class Branchy(nn.Module):
    """Code run in training mode only (baked in by either capture), and a batch norm."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(self.fc1(x))
        if self.training:
            h = h * 0.5
        return self.fc2(torch.tanh(h))


CAPTURES = {'fx': None, 'export': torch.randn(2, 8, dtype=torch.float64)}


@pytest.mark.parametrize('capture', CAPTURES)
def test_the_users_model_and_the_pipeline_set_the_mode_of_every_layer(capture: str,
                                                                       threaded: bool) -> None:
    torch.manual_seed(0)
    model = Branchy().double()
    reference = copy.deepcopy(model)
    seq = to_sequential(model.eval(), example_inputs=CAPTURES[capture])
    pipe = GPipe(seq, [2, len(seq) - 2], devices=cpu_devices(2, threaded), chunks=2)
    x, target = torch.randn(6, 8, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)

    def assert_steps_as(mode: Callable[[nn.Module], object]) -> None:
        """train_step, then forward and backward, give what ``reference`` gives in ``mode``."""
        mode(reference)
        expected = F.mse_loss(reference(x), target)
        expected.backward()
        for run in (lambda: pipe.train_step(x, target, F.mse_loss),
                    lambda: F.mse_loss(pipe(x), target)):
            loss = run()
            if loss.requires_grad:
                loss.backward()
            torch.testing.assert_close(loss.detach(), expected.detach())
            assert grads(model).keys() == grads(reference).keys()
            for key, grad in grads(reference).items():
                torch.testing.assert_close(grads(model)[key], grad, msg=key)
            model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)

    def frozen(m: nn.Module) -> None:
        m.train()
        m.norm.eval()  # on purpose: statistics of its own

    # The user's model.train() reaches the children generated from its
    # forward: its branch runs. The batch norm the user froze stays frozen.
    frozen(model)
    assert_steps_as(frozen)
    assert model.fc1.training and not model.norm.training
    # So does the pipeline's eval(), after the user's train().
    pipe.eval()
    assert_steps_as(lambda m: m.eval())
    assert not model.training
    model.train()
    model.norm.eval()
    assert_steps_as(frozen)
    model.eval()
    assert_steps_as(lambda m: m.eval())


class TrainingOnlyLayer(nn.Module):
    """A layer called in training mode only: each mode's graph cuts into other children."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.extra, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x)
        if self.training:
            h = self.extra(h)
        return self.fc2(h)


@pytest.mark.parametrize('capture', CAPTURES)
def test_a_step_in_a_mode_the_capture_cannot_run_is_refused_before_it_starts(
        capture: str, threaded: bool) -> None:
    model = TrainingOnlyLayer().double()
    seq = to_sequential(model.eval(), example_inputs=CAPTURES[capture])
    # The first generated child, which runs first.
    name = next(n for n, child in seq.named_children()
                if all(child is not m for m in model.modules()))
    pipe = GPipe(seq, [1, len(seq) - 1], devices=cpu_devices(2, threaded), chunks=2)
    started = []
    pipe.partitions[0].register_forward_pre_hook(lambda *_: started.append(True))
    x, target = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    model.train()
    for run in (lambda: pipe(x), lambda: pipe.train_step(x, target, F.mse_loss)):
        with pytest.raises(RuntimeError, match=(
                r'captured in evaluation mode and cannot run in training mode: its forward '
                rf"runs other code in training mode, .* \(child '{name}' of the sequential: "
                r'training=True\)')):
            run()
    assert started == [] and all(p.grad is None for p in model.parameters())
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x))


def test_generated_children_hold_the_captured_model_weakly() -> None:
    """The model goes with its last reference (a rank of a DistributedGPipe frees the
    other ranks' layers with it); a child keeps the mode it last read of it."""
    model = Branchy().double()
    seq = to_sequential(model.train())
    generated = [m for m in seq.modules() if isinstance(m, GeneratedChild)]
    assert generated
    model.eval()
    assert not any(child.training for child in generated)
    gone = weakref.ref(model)
    del model, seq
    gc.collect()
    assert gone() is None
    assert not any(child.training for child in generated)
    generated[0].train()
    assert generated[0].training


def test_a_child_pickled_with_a_flag_of_its_own_loads() -> None:
    """As pickled before the mode followed the captured model: ``training`` in its state."""
    child = next(m for m in to_sequential(Branchy().double()).modules()
                 if isinstance(m, GeneratedChild))
    state = child.__getstate__()
    del state['own_training'], state['captured_from']
    state['training'] = False
    old = GeneratedChild.__new__(GeneratedChild)
    old.__setstate__(state)
    assert old.training is False


class Halved(nn.Module):
    """Its forward makes a constant tensor, which a capture keeps as the child's own."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(self.a(x) * torch.full((), 0.5, dtype=x.dtype))


@pytest.mark.parametrize('capture', ['fx', 'export'])
def test_a_capture_holding_a_constant_pickles(capture: str) -> None:
    """fx traces a loaded child's code again, with the tracer its graph names: the constant
    its code makes goes where fx looks for it."""
    model = Halved().double()
    x = torch.randn(3, 4, dtype=torch.float64)
    seq = to_sequential(model, example_inputs=x[:2] if capture == 'export' else None)
    loaded = pickle.loads(pickle.dumps(seq))
    torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)

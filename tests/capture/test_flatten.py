"""to_sequential: models written as usual, flattened, pipelined, and trained like the original."""
import copy
import math
import re
import warnings
from typing import Callable, Dict, List, Optional, Tuple, Union

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from helpers import COPIERS, cpu_devices
from torchgpipe import GPipe, to_sequential
from torchgpipe.balance import balance_by_size, balance_by_time
from torchgpipe.skip.skippable import Skippable

W = 8
Inputs = Tuple[Tensor, ...]


class Block(nn.Module):
    """A pre-activation residual block."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.fc1 = nn.Linear(W, 2 * W)
        self.fc2 = nn.Linear(2 * W, W)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Linear(W, W)
        self.blocks = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(W, 3))

    def forward(self, x: Tensor) -> Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class UNet(nn.Module):
    """Encoder features concatenated into the decoder, the last one first."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList([nn.Linear(W, W), nn.Linear(W, W), nn.Linear(W, W)])
        self.middle = nn.Linear(W, W)
        self.up = nn.ModuleList([nn.Linear(2 * W, W) for _ in range(3)])

    def forward(self, x: Tensor) -> Tensor:
        features = []
        for layer in self.down:
            x = torch.tanh(layer(x))
            features.append(x)
        x = self.middle(x)
        for layer, feature in zip(self.up, reversed(features)):
            x = torch.tanh(layer(torch.cat([x, feature], dim=1)))
        # Two features used once more, by one child that pops both.
        return x + features[0] - features[1]


class CausalSelfAttention(nn.Module):
    def __init__(self, heads: int = 2, length: int = 5) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(W, 3 * W)
        self.proj = nn.Linear(W, W)
        self.register_buffer('mask', torch.tril(torch.ones(length, length)).bool())

    def forward(self, x: Tensor) -> Tensor:
        B, T, C = x.size()
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        k = k.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        v = v.view(B, T, self.heads, C // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = att.masked_fill(~self.mask[:T, :T], float('-inf')).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(W)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(W)
        self.mlp = nn.Sequential(nn.Linear(W, 4 * W), nn.GELU(), nn.Linear(4 * W, W))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Parameter(torch.randn(5, W) / 10)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(2))
        self.ln_f = nn.LayerNorm(W)
        # A non-persistent buffer: not in the state dict, in the sequential neither.
        self.register_buffer('scale', torch.tensor(0.5), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.pos[:x.size(1)]
        for layer in self.layers:
            x = layer(x)
        return self.ln_f(x) * self.scale


class LibraryAttention(nn.Module):
    """nn.MultiheadAttention returns a tuple whose second item is None here."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(W)
        self.attn = nn.MultiheadAttention(W, 2, batch_first=True)
        self.out = nn.Linear(W, W)

    def forward(self, x: Tensor) -> Tensor:
        h = self.norm(x)
        h, _ = self.attn(h, h, h, need_weights=False)
        return self.out(x + h)


class CalledTwice(nn.Module):
    """One layer used at two places, with other layers before, between and after."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(W, W)
        self.shared = nn.Linear(W, W)
        self.middle = nn.Linear(W, W)
        self.last = nn.Linear(W, W)

    def forward(self, x: Tensor) -> Tensor:
        x = self.first(x)
        h = torch.relu(self.shared(x))
        h = self.middle(h)
        return self.last(self.shared(h) + x)


class TwoHeads(nn.Module):
    """Returns a tuple: two heads on a shared trunk."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(W, W)
        self.left = nn.Linear(W, 2)
        self.right = nn.Linear(W, 3)

    def forward(self, x: Tensor) -> Tuple[Tensor, Tensor]:
        h = torch.tanh(self.trunk(x))
        return self.left(h), self.right(h)


class TwoInputs(nn.Module):
    """Two inputs: the second one is only used at the end, as a gate."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(W, W)
        self.b = nn.Linear(W, W)
        self.gate = nn.Linear(W, W)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.b(torch.relu(self.a(x)))
        return h * torch.sigmoid(self.gate(y)) + x


# In double precision: GPipe sums the gradients of micro-batches, whose
# rounding differs from the full batch's by more than float32's tolerance.
def vector(batch: int = 6) -> Inputs:
    return (torch.randn(batch, W, dtype=torch.float64),)


def sequence(batch: int = 6) -> Inputs:
    return (torch.randn(batch, 5, W, dtype=torch.float64),)


def pair(batch: int = 6) -> Inputs:
    return (torch.randn(batch, W, dtype=torch.float64),
            torch.randn(batch, W, dtype=torch.float64))


def double(cls: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
    return lambda: cls().double()


MODELS: Dict[str, Tuple[Callable[[], nn.Module], Callable[[], Inputs]]] = {
    'resnet': (double(ResNet), vector),
    'unet': (double(UNet), vector),
    'transformer': (double(Transformer), sequence),
    'library_attention': (double(LibraryAttention), sequence),
    'called_twice': (double(CalledTwice), vector),
    'two_heads': (double(TwoHeads), vector),
    'two_inputs': (double(TwoInputs), pair),
}


def outputs(value: Union[Tensor, Tuple[Tensor, ...]]) -> Tuple[Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def loss(value: Union[Tensor, Tuple[Tensor, ...]]) -> Tensor:
    return sum((y.pow(2).sum() for y in outputs(value)), torch.zeros(()))


def even(layers: int, partitions: int) -> List[int]:
    return [layers // partitions + (j < layers % partitions) for j in range(partitions)]


def gpipe_input(inputs: Inputs) -> Union[Tensor, Inputs]:
    return inputs[0] if len(inputs) == 1 else inputs


def assert_trains_like_original(original: nn.Module, gpipe: GPipe, inputs: Inputs,
                                steps: int = 3,
                                trained: Optional[Dict[str, nn.Parameter]] = None) -> float:
    """Trains ``gpipe`` with an optimizer on the ORIGINAL module's parameters
    and a copy of ``original`` alongside; every step, outputs, input
    gradients and parameter gradients must be equal. Returns the largest
    gradient difference seen.

    ``trained`` gives the parameters ``gpipe`` holds instead, by the names
    of the original's, when it runs a copy of the flattened module."""
    if trained is None:
        trained = dict(original.named_parameters())
    reference = copy.deepcopy(original)
    optimizer = torch.optim.SGD(trained.values(), lr=0.01)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.01)
    worst = 0.0
    for _ in range(steps):
        x1 = tuple(x.detach().clone().requires_grad_() for x in inputs)
        x2 = tuple(x.detach().clone().requires_grad_() for x in inputs)
        expected = reference(*x1)
        loss(expected).backward()
        actual = gpipe(gpipe_input(x2))
        loss(actual).backward()

        assert len(outputs(actual)) == len(outputs(expected))
        for a, e in zip(outputs(actual), outputs(expected)):
            torch.testing.assert_close(a, e)
        for a, e in zip(x2, x1):
            torch.testing.assert_close(a.grad, e.grad)
        for (name, p), q in zip(trained.items(), reference.parameters()):
            if q.grad is None:
                # Unused by this input: the data-dependent branch not taken.
                assert p.grad is None, name
                continue
            torch.testing.assert_close(p.grad, q.grad, msg=name)
            worst = max(worst, (p.grad - q.grad).abs().max().item())

        optimizer.step()
        reference_optimizer.step()
        optimizer.zero_grad()
        reference_optimizer.zero_grad()
    return worst


@pytest.mark.parametrize('name', list(MODELS))
def test_gpipe_trains_the_flattened_model_like_the_original(name: str, checkpoint: str,
                                                            threaded: bool) -> None:
    factory, data = MODELS[name]
    original = factory()
    seq = to_sequential(original)
    partitions = min(3, len(seq))
    gpipe = GPipe(seq, even(len(seq), partitions), chunks=3, checkpoint=checkpoint,
                  devices=cpu_devices(partitions, threaded))
    assert_trains_like_original(original, gpipe, data())


@pytest.mark.slow
@pytest.mark.unmeasured
@pytest.mark.parametrize('copier', COPIERS)
@pytest.mark.parametrize('name', list(MODELS))
def test_a_copy_of_the_flattened_model_trains_like_the_original(
        name: str, copier: Callable[[nn.Module], nn.Module], threaded: bool) -> None:
    factory, data = MODELS[name]
    original = factory()
    seq = to_sequential(original)
    clone = copier(seq)

    # The copy has tensors of its own, under the keys of the sequential,
    # which its state_dict_map still gives for the original's keys.
    assert clone.state_dict_map == seq.state_dict_map
    state, cloned_state = seq.state_dict(), clone.state_dict()
    assert list(cloned_state) == list(state)
    for key, tensor in state.items():
        assert torch.equal(cloned_state[key], tensor), key
    assert {id(p) for p in clone.parameters()}.isdisjoint(id(p) for p in original.parameters())
    # Its children are of the classes of the original's: generated ones too.
    assert [type(child) for child in clone] == [type(child) for child in seq]

    trained = {key: clone.get_parameter(clone.state_dict_map[key])
               for key, _ in original.named_parameters()}
    partitions = min(3, len(clone))
    gpipe = GPipe(clone, even(len(clone), partitions), chunks=3,
                  devices=cpu_devices(partitions, threaded))
    assert_trains_like_original(original, gpipe, data(), steps=2, trained=trained)


@pytest.mark.slow
@pytest.mark.parametrize('name', list(MODELS))
def test_any_cut_between_two_children(name: str) -> None:
    factory, data = MODELS[name]
    original = factory()
    layers = len(to_sequential(original))
    assert layers >= 3
    for cut in range(1, layers):
        # A fresh copy each time: the steps must not add up.
        model = copy.deepcopy(original)
        gpipe = GPipe(to_sequential(model), [cut, layers - cut], chunks=2,
                      devices=['cpu'] * 2)
        assert_trains_like_original(model, gpipe, data(), steps=1)


@pytest.mark.parametrize('name', list(MODELS))
def test_children_are_the_original_modules_and_parameters(name: str) -> None:
    original = MODELS[name][0]()
    seq = to_sequential(original)
    assert {id(p) for p in seq.parameters()} == {id(p) for p in original.parameters()}
    # Leaf modules are children themselves wherever no skip or glue must
    # be attached to them.
    leaves = {id(m) for m in original.modules() if not list(m.children())}
    assert any(id(child) in leaves for child in seq)
    for child in seq:
        assert id(child) in leaves or isinstance(child, Skippable)


def test_containers_are_flattened_with_meaningful_names() -> None:
    seq = to_sequential(Transformer())
    names = [name for name, _ in seq.named_children()]
    assert '.' not in ''.join(names)
    for expected in ['layers_0_ln_1', 'layers_0_attn_qkv', 'layers_0_attn_proj',
                     'layers_0_mlp_0', 'layers_0_mlp_1', 'layers_1_mlp_2', 'ln_f']:
        assert expected in names
    # The glue code between them, named after its first operation: the
    # position embedding's indexing, the attention from the split of q, k
    # and v to the masked softmax, the residual additions.
    assert {'getitem', 'split', 'add_1', 'mul'} <= set(names)
    # The causal mask stays with the code that reads it.
    mapping = getattr(seq, 'state_dict_map')
    assert mapping['layers.0.attn.mask'].startswith('split.')


def test_module_called_twice_is_one_child_from_first_call_to_last() -> None:
    original = CalledTwice()
    seq = to_sequential(original)
    holders = [name for name, child in seq.named_children()
               if any(p is original.shared.weight for p in child.parameters())]
    assert len(holders) == 1
    # 'middle', called between the two calls, is in the same child.
    assert [name for name, child in seq.named_children()
            if any(p is original.middle.weight for p in child.parameters())] == holders
    assert seq[0] is original.first
    assert seq[len(seq) - 1] is original.last


class SharedDropout(nn.Module):
    """A module without state called first and last, as T5 uses its dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(W, W)
        self.dropout = nn.Dropout(0.0)
        self.layers = nn.ModuleList(nn.Linear(W, W) for _ in range(4))
        self.norm = nn.LayerNorm(W)

    def forward(self, x: Tensor) -> Tensor:
        x = self.dropout(self.embed(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.dropout(self.norm(x))


def test_module_without_state_called_twice_does_not_merge_what_lies_between(
        threaded: bool) -> None:
    original = SharedDropout().double()
    seq = to_sequential(original)
    # Every layer with parameters stays a child of its own, so the model
    # can be balanced: nothing is merged between the two calls.
    holders = [name for name, child in seq.named_children() if list(child.parameters())]
    assert len(holders) == 6
    assert sum(child is original.dropout for child in seq) == 1
    gpipe = GPipe(seq, [3, len(seq) - 6, 3], chunks=2, devices=cpu_devices(3, threaded))
    assert_trains_like_original(original, gpipe, vector())


def test_skips_go_straight_to_the_child_that_uses_them() -> None:
    original = UNet()
    seq = to_sequential(original)
    # Only one tensor crosses each boundary: the features travel as skips.
    x = torch.randn(2, W)
    for child in seq:
        assert isinstance(x, Tensor)
        x = child(x)
    stashing = [child for child in seq
                if isinstance(child, Skippable) and child.stashable_names]
    # The three features, once each, and the first two again for the end.
    assert sum(len(child.stashable_names) for child in stashing) == 5


def gpipe_key(gpipe: GPipe, seq_key: str) -> str:
    [key] = [k for k in gpipe.state_dict() if re.fullmatch(r'partitions\.\d+\.' + re.escape(
        seq_key), k)]
    return key


@pytest.mark.parametrize('name', list(MODELS))
def test_state_dict_round_trip(name: str) -> None:
    factory, data = MODELS[name]
    trained = factory()
    checkpoint = trained.state_dict()

    original = factory()
    seq = to_sequential(original)
    mapping = getattr(seq, 'state_dict_map')
    assert set(mapping) == set(checkpoint)
    gpipe = GPipe(seq, even(len(seq), 2), chunks=2, devices=['cpu'] * 2)
    gpipe.load_state_dict({gpipe_key(gpipe, mapping[k]): v for k, v in checkpoint.items()})

    inputs = data()
    for a, e in zip(outputs(gpipe(gpipe_input(inputs))), outputs(trained(*inputs))):
        torch.testing.assert_close(a, e)

    state = gpipe.state_dict()
    back = factory()
    back.load_state_dict({k: state[gpipe_key(gpipe, mapping[k])] for k in checkpoint})
    for key, value in back.state_dict().items():
        torch.testing.assert_close(value, checkpoint[key])


@pytest.mark.parametrize('name', ['transformer', 'unet'])
def test_balance_by_time_and_size(name: str) -> None:
    factory, data = MODELS[name]
    original = factory()
    seq = to_sequential(original)
    sample = gpipe_input(data())
    for balance in [balance_by_time(3, seq, sample, timeout=0.1, device='cpu'),
                    balance_by_size(3, seq, sample, chunks=2, device='cpu')]:
        assert len(balance) == 3 and sum(balance) == len(seq)
        gpipe = GPipe(seq, balance, chunks=2, devices=['cpu'] * 3)
        assert_trains_like_original(original, gpipe, data(), steps=1)


class DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x: Tensor) -> Tensor:
        if x.sum() > 0:
            return self.fc(x)
        return -x


class WithDataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.before = nn.Linear(W, W)
        self.branchy = DataDependent()
        self.after = nn.Linear(W, W)

    def forward(self, x: Tensor) -> Tensor:
        return self.after(self.branchy(self.before(x)))


def test_untraceable_module_is_named_with_its_line_and_the_fix() -> None:
    original = WithDataDependent().double()
    with pytest.raises(RuntimeError) as info:
        to_sequential(original)
    message = str(info.value)
    assert 'branchy (DataDependent)' in message
    assert "'if x.sum() > 0:'" in message
    assert f'{__file__}:' in message
    assert 'leaf_modules=[DataDependent]' in message

    seq = to_sequential(original, leaf_modules=[DataDependent])
    assert original.branchy in list(seq)
    gpipe = GPipe(seq, [1, 2], chunks=2, devices=['cpu'] * 2)
    assert_trains_like_original(original, gpipe, vector(), steps=1)


def test_non_tensor_output_is_refused() -> None:
    class Counting(nn.Module):
        def forward(self, x: Tensor) -> Tuple[Tensor, int]:
            return x, 3

    with pytest.raises(TypeError, match=r'module must return tensors to be flattened '
                                        r'\(output: \(x, 3\)\); return the tensors alone'):
        to_sequential(Counting())


class ShapesAndMethods(nn.Module):
    """Reads x.shape across a layer, and calls a method named like a Module's."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[-1]
        h = self.fc(x).to(x.dtype)
        return h / n


def test_shapes_are_recomputed_and_names_never_clash() -> None:
    original = ShapesAndMethods().double()
    seq = to_sequential(original)
    names = [name for name, _ in seq.named_children()]
    assert names == ['fc', 'to_']
    gpipe = GPipe(seq, [1, 1], chunks=2, devices=['cpu'] * 2)
    assert_trains_like_original(original, gpipe, vector(), steps=1)


def test_untraceable_root_is_named_too() -> None:
    class Root(nn.Module):
        def forward(me, x: Tensor) -> Tensor:  # noqa: N805 - self under another name
            return x if len(x) > 2 else -x

    with pytest.raises(RuntimeError, match=r'cannot trace the module itself \(Root\)') as error:
        to_sequential(Root())
    # The module itself cannot be one of its own leaves: the fix is another.
    message = str(error.value)
    assert 'leaf_modules=[Root]' not in message
    assert 'move that code into a submodule' in message


V = 11


class TiedLM(nn.Module):
    """A language model whose output projection is its token embedding.

    ``glue_head``: the projection is written in forward (``F.linear`` on
    the embedding's weight) rather than an ``nn.Linear`` holding it.
    """

    def __init__(self, glue_head: bool) -> None:
        super().__init__()
        self.glue_head = glue_head
        self.emb = nn.Embedding(V, W)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.norm = nn.LayerNorm(W)
        self.head = nn.Linear(W, V, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.emb(tokens)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        if self.glue_head:
            return F.linear(x, self.emb.weight)
        return self.head(x)


@pytest.mark.slow
@pytest.mark.parametrize('glue_head', [False, True], ids=['linear_head', 'glue_head'])
def test_tied_embedding_and_head_stay_children_of_their_own(glue_head: bool, checkpoint: str,
                                                            threaded: bool) -> None:
    original = TiedLM(glue_head).double()
    seq = to_sequential(original)
    # Every leaf is a child: the tie merges nothing.
    assert len(seq) == 1 + 2 * 5 + 2
    holders = [k for k, child in enumerate(seq)
               if any(p is original.emb.weight for p in child.parameters())]
    assert holders == [0, len(seq) - 1]
    tokens = torch.randint(V, (6, 5))
    for balance in [[1, len(seq) - 1], [len(seq) - 1, 1], even(len(seq), 3), [1, 6, 6]]:
        model = copy.deepcopy(original)
        gpipe = GPipe(to_sequential(model), balance, chunks=3, checkpoint=checkpoint,
                      devices=cpu_devices(len(balance), threaded))
        # The tied weight is listed once, as by the original.
        assert [id(p) for p in gpipe.parameters()].count(id(model.emb.weight)) == 1
        assert len(list(gpipe.parameters())) == len(list(model.parameters()))

        reference = copy.deepcopy(model)
        optimizer = torch.optim.SGD(gpipe.parameters(), lr=0.1)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        for _ in range(3):
            expected = reference(tokens)
            F.cross_entropy(expected.flatten(0, 1), tokens.flatten()).backward()
            actual = gpipe(tokens)
            F.cross_entropy(actual.flatten(0, 1), tokens.flatten()).backward()
            torch.testing.assert_close(actual, expected)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad, q.grad, msg=name)
            optimizer.step()
            reference_optimizer.step()
            optimizer.zero_grad()
            reference_optimizer.zero_grad()


class SharedBuffer(nn.Module):
    """Two layers holding one buffer: GPipe cannot share a buffer across partitions."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.BatchNorm1d(W)
        self.middle = nn.Linear(W, W)
        self.second = nn.BatchNorm1d(W)
        self.last = nn.Linear(W, W)

    def forward(self, x: Tensor) -> Tensor:
        return self.last(self.second(self.middle(self.first(x))))


def test_layers_sharing_a_buffer_are_one_child() -> None:
    original = SharedBuffer().double()
    # Tied after .double(), which converts each layer's buffers apart.
    original.second.running_mean = original.first.running_mean
    seq = to_sequential(original)
    assert [name for name, _ in seq.named_children()] == ['first', 'last']
    gpipe = GPipe(seq, [1, 1], chunks=1, devices=['cpu'] * 2)
    assert_trains_like_original(original, gpipe, vector(), steps=2)


def test_state_dict_map_of_tied_weights_keeps_every_key() -> None:
    trained = TiedLM(glue_head=False).double()
    checkpoint = trained.state_dict()
    original = TiedLM(glue_head=False).double()
    seq = to_sequential(original)
    mapping = getattr(seq, 'state_dict_map')
    # Both keys of the tied weight, each to the key of its own module.
    assert set(mapping) == set(checkpoint)
    assert mapping['head.weight'] == 'head.weight'
    assert mapping['emb.weight'].endswith('emb.weight')
    seq.load_state_dict({mapping[k]: v for k, v in checkpoint.items()})
    tokens = torch.randint(V, (4, 5))
    torch.testing.assert_close(seq(tokens), trained(tokens))


class Switched(nn.Module):
    """A branch on an argument that is no tensor, fixed with concrete_args."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.fc2 = nn.Linear(W, W)

    def forward(self, x: Tensor, scaled: bool = False) -> Tensor:
        h = self.fc1(x)
        if scaled:
            h = h / 2
        return self.fc2(h)


@pytest.mark.parametrize('scaled', [False, True])
def test_concrete_args_are_not_inputs_of_the_sequential(scaled: bool) -> None:
    original = Switched().double()
    seq = to_sequential(original, concrete_args={'scaled': scaled})
    assert len(seq) == (3 if scaled else 2)
    gpipe = GPipe(seq, [1, len(seq) - 1], chunks=2, devices=['cpu'] * 2)
    x = vector()[0]
    torch.testing.assert_close(gpipe(x), original(x, scaled))


class Counted(nn.Module):
    """Counts the calls of its forward, tracing included."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(W, W)
        self.calls = 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        return torch.relu(self.fc(x))


def scripted() -> nn.Module:
    with warnings.catch_warnings():
        # Deprecated in favour of torch.export, but still what users have.
        warnings.simplefilter('ignore', DeprecationWarning)
        return torch.jit.script(Counted())


def traced() -> nn.Module:
    with warnings.catch_warnings():
        # The trace warns that the counter is a Python value it bakes in.
        warnings.simplefilter('ignore')
        return torch.jit.trace(Counted(), torch.randn(2, W))


def twice(x: Tensor) -> Tensor:
    return 2 * x


@pytest.mark.parametrize('module, leaf_modules, words', [
    (scripted, (), ['module must be a Python nn.Module', 'RecursiveScriptModule of Counted',
                    'pass the module you gave torch.jit.script']),
    (traced, (), ['module must be a Python nn.Module', 'TopLevelTracedModule of Counted',
                  'torch.jit.trace']),
    (lambda: twice, (), ['module must be an nn.Module', 'module: <function twice at',
                         'wrap it in an nn.Module whose forward calls it']),
    (Counted, 'Linear', ["leaf_modules must be an iterable of module classes or modules, not a "
                         "name (leaf_modules: 'Linear')", 'leaf_modules=[Linear]']),
    (Counted, nn.Linear, ["leaf_modules: <class 'torch.nn.modules.linear.Linear'>",
                          'give a list of module classes or modules']),
    (Counted, ['Linear'], ["leaf_modules[0] must be a module class or a module "
                           "(leaf_modules[0]: 'Linear')", 'leaf_modules=[']),
    (Counted, [nn.Linear, F.relu], ['leaf_modules[1] must be', '<function relu at']),
    (Counted, [int], ["leaf_modules[0]: <class 'int'>"]),
    (Counted, [nn.Linear, None], ['leaf_modules[1]: None']),
    (lambda: GPipe(nn.Sequential(Counted(), nn.Linear(W, W)), [1, 1], devices=['cpu'] * 2),
     (), ['module must not be a GPipe to be flattened', 'GPipe of 2 layers',
          'to_sequential(gpipe.unwrap())']),
], ids=['script', 'trace', 'function', 'string', 'class_alone', 'name_in_list',
        'function_in_list', 'other_class', 'none', 'gpipe'])
def test_wrong_arguments_are_refused_before_tracing_naming_value_and_fix(
        module: Callable[[], object], leaf_modules: object, words: List[str]) -> None:
    given = module()
    with pytest.raises(TypeError) as error:
        to_sequential(given, leaf_modules=leaf_modules)  # type: ignore[arg-type]
    message = str(error.value)
    for word in words:
        assert word in message
    # One sentence: requirement (value received); fix.
    assert '\n' not in message and message.count('; ') == 1
    if isinstance(given, Counted):
        assert given.calls == 0


def test_leaf_modules_may_be_any_iterable_of_classes_and_modules() -> None:
    model = nn.Sequential(Counted(), nn.Linear(W, W))
    # Traced through, Counted would count once, while tracing, and never again.
    with pytest.raises(RuntimeError, match=r"changes the module's state.*\(changed: 0\.calls\)"):
        to_sequential(model)
    assert model[0].calls == 0
    for leaf_modules in ([Counted], (Counted,), iter([model[0]]), nn.ModuleList([model[0]])):
        seq = to_sequential(model, leaf_modules=leaf_modules)
        assert list(seq) == list(model)


class Checked(nn.Module):
    """Checks its input's width with torch._assert before any layer (as
    torchvision's VisionTransformer does), and has optional arguments."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(W, W)
        self.fc2 = nn.Linear(W, W)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None,
                is_causal: bool = False) -> Tensor:
        torch._assert(x.shape[1] == W, 'wrong width')
        h = self.fc1(x)
        if mask is not None:
            h = h + mask
        if is_causal:
            h = -h
        return self.fc2(h)


def test_checks_and_optional_arguments_behave_as_in_the_original(threaded: bool) -> None:
    """A child made of torch._assert alone would pass its None on; optional
    arguments are taken at their defaults, as in ``original(x)``, rather than
    becoming inputs traced as if given (``mask is not None`` held while tracing)."""
    original = Checked().double()
    seq = to_sequential(original)
    x = vector()[0]
    torch.testing.assert_close(seq(x), original(x))
    gpipe = GPipe(seq, [1, len(seq) - 1], chunks=2, devices=cpu_devices(2, threaded))
    assert_trains_like_original(original, gpipe, vector())
    with pytest.raises(AssertionError, match='wrong width'):
        seq(torch.randn(2, W + 1, dtype=torch.double))
    # A default fixed otherwise, as before, with concrete_args; or kept an input.
    causal = to_sequential(original, concrete_args={'is_causal': True})
    torch.testing.assert_close(causal(x), original(x, is_causal=True))
    masked = to_sequential(original, concrete_args={'mask': fx.PH})
    mask = torch.randn(W, dtype=torch.double)
    torch.testing.assert_close(masked((x, mask)), original(x, mask))

"""Reference computations the tests compare GPipe against."""
import copy
import io
import pickle
import random
from typing import Any, Callable, Dict, Hashable, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torchgpipe.engine.pipeline import clock_cycles
from torchgpipe.engine.schedule import Action, Kind, Schedule, clock_order
from torchgpipe.skip import pop, skippable, stash


#: GPipe's three checkpoint modes. The ``checkpoint`` fixture of conftest.py
#: runs a test in each; use this list for a strategy or a product of parameters.
CHECKPOINT_MODES = ['always', 'except_last', 'never']


def mlp(*widths: int, depth: Optional[int] = None,
        activation: Callable[[], nn.Module] = nn.Tanh, last_activation: bool = True,
        blocks: bool = False, dtype: Optional[torch.dtype] = None) -> nn.Sequential:
    """A multilayer perceptron: a Linear layer from each width to the next, each
    followed by an ``activation``.

    ``mlp(3, 4, 2)`` is Linear(3, 4), Tanh, Linear(4, 2), Tanh. One width and a
    ``depth`` give that many square layers: ``mlp(4, depth=3)`` is three
    Linear(4, 4) + Tanh. ``last_activation=False`` ends on the last Linear;
    ``blocks=True`` makes each Linear and its activation one child (a
    ``balance`` then counts layers); ``dtype`` converts the parameters once
    built, so the initial values do not depend on it.

    The parameters are drawn from PyTorch's generator, in layer order, exactly
    as the same layers written out by hand would draw them.
    """
    if depth is not None:
        if len(widths) != 1:
            raise ValueError('give one width with depth, or the widths without it')
        widths = widths * (depth + 1)
    if len(widths) < 2:
        raise ValueError('an mlp needs at least two widths (or a width and a depth)')
    layers: List[nn.Module] = []
    for k, (a, b) in enumerate(zip(widths, widths[1:])):
        layer: List[nn.Module] = [nn.Linear(a, b)]
        if last_activation or k < len(widths) - 2:
            layer.append(activation())
        layers += [nn.Sequential(*layer)] if blocks else layer
    model = nn.Sequential(*layers)
    return model if dtype is None else model.to(dtype)


def cpu_devices(n: int, threaded: bool) -> List[str]:
    """n CPU devices for one of GPipe's two execution paths.

    One shared device (``['cpu'] * n``) runs every partition in the calling
    thread; distinct indices (``['cpu:0', 'cpu:1', ...]``) get one worker
    thread each. The ``threaded`` fixture of conftest.py runs a test on both.
    A single partition has a single device, so it always runs in the calling
    thread.
    """
    return [f'cpu:{j}' for j in range(n)] if threaded else ['cpu'] * n


def assert_same_training_step(model: nn.Sequential,
                              gpipe_factory: Callable[[nn.Sequential], nn.Module],
                              input: Tensor,
                              loss_fn: Callable[[Tensor], Tensor] = lambda y: y.pow(2).sum(),
                              **tolerance: float) -> None:
    """Asserts that a GPipe step equals the unwrapped model's on the full batch.

    Compares the output, the input gradient and every parameter gradient.
    """
    reference = copy.deepcopy(model)
    gpipe = gpipe_factory(model)

    x1 = input.detach().clone().requires_grad_(input.is_floating_point())
    x2 = input.detach().clone().requires_grad_(input.is_floating_point())

    expected = reference(x1)
    loss_fn(expected).backward()
    actual = gpipe(x2)
    loss_fn(actual).backward()

    torch.testing.assert_close(actual, expected, **tolerance)
    if x1.grad is not None:
        torch.testing.assert_close(x2.grad, x1.grad, **tolerance)
    ref_params = dict(reference.named_parameters())
    gpipe_params = {name.split('.', 2)[2]: p for name, p in gpipe.named_parameters()}
    assert ref_params.keys() == gpipe_params.keys()
    for name, p in ref_params.items():
        if p.grad is None:
            assert gpipe_params[name].grad is None, name
        else:
            torch.testing.assert_close(gpipe_params[name].grad, p.grad, **tolerance, msg=name)


def deepcopy(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)


def pickled(module: nn.Module) -> nn.Module:
    return pickle.loads(pickle.dumps(module))


def saved(module: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


#: The three ways a user copies a module; parametrize a test with them.
COPIERS = [deepcopy, pickled, saved]


def run_in_clock_order(model: nn.Sequential, balance: Sequence[int], input: Tensor,
                       chunks: int, schedule: Optional[Schedule] = None) -> Tensor:
    """Runs the unwrapped model on micro-batches in GPipe's clock-cycle order,
    or in the order of the forward actions of ``schedule``'s clock cycles
    (``train_step``'s).

    With random layers such as dropout, this is what GPipe computes: the
    random numbers are drawn micro-batch by micro-batch, in this order.
    """
    layers = list(model)
    partitions: List[nn.Sequential] = []
    offset = 0
    for size in balance:
        partitions.append(nn.Sequential(*layers[offset:offset + size]))
        offset += size
    batches = list(input.chunk(chunks))
    if schedule is None:
        order = [(i, j) for cycle in clock_cycles(len(batches), len(partitions)) for i, j in cycle]
    else:
        order = [(a.i, a.j) for cycle in clock_order(schedule.workers, len(partitions))
                 for a in cycle if a.kind is Kind.F]
    for i, j in order:
        batches[i] = partitions[j](batches[i])
    return torch.cat(batches)



def assert_same_random_step(reference: nn.Sequential, gpipe: nn.Module, input: Tensor,
                            seed: int = 1) -> Tuple[Tensor, Tensor]:
    """Asserts that a GPipe step equals the unwrapped model's run in clock order.

    Both start from the same seed, so layers drawing random numbers (dropout)
    draw the same ones, micro-batch by micro-batch. Compares the input
    gradient and every parameter gradient; the outputs are returned for the
    caller's own checks.

    Returns:
        (actual, expected): the outputs of GPipe and of the reference
    """
    x1 = input.detach().clone().requires_grad_()
    x2 = input.detach().clone().requires_grad_()
    torch.manual_seed(seed)
    expected = run_in_clock_order(reference, gpipe.balance, x1, gpipe.chunks)
    expected.pow(2).sum().backward()
    torch.manual_seed(seed)
    actual = gpipe(x2)
    actual.pow(2).sum().backward()

    torch.testing.assert_close(actual, expected)
    torch.testing.assert_close(x2.grad, x1.grad)
    for (name, p), q in zip(gpipe.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    return actual, expected


@skippable(stash=['skip'])
class Stash(nn.Module):
    """Stashes its input as the skip ``'skip'``."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        yield stash('skip', x)
        return x


@skippable(pop=['skip'])
class PopAdd(nn.Module):
    """Adds the skip ``'skip'`` to its input."""

    def forward(self, x: Tensor):  # type: ignore[no-untyped-def]
        skip = yield pop('skip')
        return x + skip


def assert_flattened_trains_like_original(original: nn.Module, inputs: Dict[str, Any],
                                          select: Callable[[Any], Tensor], threaded: bool,
                                          partitions: int = 3, chunks: int = 4,
                                          seq: Optional[nn.Sequential] = None) -> nn.Sequential:
    """Flattens ``original`` (unless ``seq`` is given), pipelines it and checks it trains alike.

    The sequential must hold the original's own parameters. GPipe, on a
    balance from balance_by_time, must give the original's output and every
    parameter gradient, called as the original is called (keyword inputs,
    structured output through ``seq.interface``), by forward + backward and
    by train_step with 1F1B. ``select`` picks from the original's output
    the tensor the loss is computed from.

    Returns:
        the sequential
    """
    from torchgpipe import GPipe, to_sequential
    from torchgpipe.balance import balance_by_time

    if seq is None:
        seq = to_sequential(original)
    own = {id(p) for p in original.parameters()}
    held = list(seq.parameters())
    assert held and all(id(p) in own for p in held)
    reference = copy.deepcopy(original)
    input = seq.interface.inputs(**inputs)
    balance = balance_by_time(partitions, seq, input, timeout=0.1, device='cpu')
    gpipe = GPipe(seq, balance, devices=cpu_devices(partitions, threaded), chunks=chunks)

    def parameter_grads(model: nn.Module) -> Dict[str, Tensor]:
        return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}

    def assert_same_grads(got: Dict[str, Tensor], wanted: Dict[str, Tensor]) -> None:
        assert wanted.keys() <= got.keys(), wanted.keys() - got.keys()
        for name, grad in wanted.items():
            torch.testing.assert_close(got[name], grad, msg=lambda m, name=name: f'{name}: {m}')
        # A checkpointed partition's backward gives an output the loss does
        # not use a zero gradient: the parameters only it reads get zeros.
        for name in got.keys() - wanted.keys():
            assert not got[name].any(), name

    expected = select(reference(**inputs))
    target = torch.randn_like(expected)
    F.mse_loss(expected, target).backward()
    wanted = parameter_grads(reference)
    assert wanted

    actual = select(seq.interface.outputs(gpipe(input)))
    torch.testing.assert_close(actual, expected)
    F.mse_loss(actual, target).backward()
    assert_same_grads(parameter_grads(original), wanted)

    original.zero_grad(set_to_none=True)
    loss = gpipe.train_step(
        input, target, lambda output, t: F.mse_loss(select(seq.interface.outputs(output)), t))
    torch.testing.assert_close(loss, F.mse_loss(expected, target).detach())
    assert_same_grads(parameter_grads(original), wanted)
    original.zero_grad(set_to_none=True)
    return seq


class RaiseInBackward(torch.autograd.Function):
    """The identity, whose backward pass raises ``error``: ``RaiseInBackward.apply(x, error)``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, error: BaseException) -> Tensor:
        ctx.error = error
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        raise ctx.error


def schedule_devices(schedule: str, n: int, threaded: bool) -> List[str]:
    """The devices ``n`` partitions run a built-in schedule on, on either execution path.

    Threaded, a schedule with several partitions per worker needs their
    devices to repeat as it places them: interleaved 1F1B loops over two
    devices (with an even ``n``), ZBV folds the partitions into a V over
    ``n / 2``; the others take a device each. Inline, ``['cpu'] * n`` runs
    any of them.
    """
    if not threaded:
        return ['cpu'] * n
    if schedule == 'interleaved_1f1b' and n % 2 == 0:
        return ['cpu:0', 'cpu:1'] * (n // 2)
    if schedule == 'zbv':
        return [f'cpu:{min(j, n - 1 - j)}' for j in range(n)]
    return cpu_devices(n, threaded)


def random_order(m: int, n: int, placement: List[int], split: List[bool],
                 rng: random.Random) -> Schedule:
    """Runs a random valid schedule: any ready action of any worker, one at a time."""
    p = max(placement) + 1
    todo = {Action(Kind.F, i, j) for i in range(m) for j in range(n)}
    for i in range(m):
        for j in range(n):
            todo |= {Action(Kind.I, i, j), Action(Kind.W, i, j)} if split[j] else \
                {Action(Kind.B, i, j)}
    done: Set[Action] = set()
    workers: List[List[Action]] = [[] for _ in range(p)]
    back = lambda i, j: Action(Kind.I if split[j] else Kind.B, i, j)  # noqa: E731
    while todo:
        ready = [a for a in todo
                 if (a.kind is Kind.F and (a.j == 0 or Action(Kind.F, a.i, a.j - 1) in done))
                 or (a.kind in (Kind.B, Kind.I) and Action(Kind.F, a.i, a.j) in done
                     and (a.j == n - 1 or back(a.i, a.j + 1) in done))
                 or (a.kind is Kind.W and Action(Kind.I, a.i, a.j) in done)]
        action = rng.choice(sorted(ready, key=str))
        todo.remove(action)
        done.add(action)
        workers[placement[action.j]].append(action)
    return Schedule(workers)


def literal_block(text: str, after: str) -> str:
    """The first literal block (``::`` then indented lines) of reStructuredText or a
    docstring that follows the phrase ``after``, dedented."""
    import textwrap
    start = text.index('::', text.index(after)) + 2
    lines = text[start:].split('\n')[1:]
    while lines and not lines[0].strip():
        lines.pop(0)
    indent = len(lines[0]) - len(lines[0].lstrip())
    body = []
    for line in lines:
        if line.strip() and len(line) - len(line.lstrip()) < indent:
            break
        body.append(line)
    return textwrap.dedent('\n'.join(body)).strip() + '\n'


def run_snippet(source: str, namespace: Dict[str, Any],
                supply: Dict[str, Callable[[Dict[str, Any]], Any]]) -> None:
    """Runs an example of the documentation as written, statement by statement.

    The names it leaves to the reader (``balance``) are given by ``supply``:
    each function makes its value from the namespace as it is when a
    statement first reads the name, after the statements before it ran
    (``balance`` from ``seq``).
    """
    import ast
    for statement in ast.parse(source).body:
        read = {n.id for n in ast.walk(statement) if isinstance(n, ast.Name)}
        for name in sorted(read & supply.keys() - namespace.keys()):
            namespace[name] = supply[name](namespace)
        exec(compile(ast.Module([statement], type_ignores=[]), '<example>', 'exec'), namespace)


def assert_runs_in_both_modes(seq: nn.Module, model: nn.Module, x: Tensor, seed: int = 0
                              ) -> Tensor:
    """``seq`` gives ``model``'s output in evaluation mode, then in training
    mode with the same random draws; both are left in training mode.

    Returns:
        ``seq``'s output in training mode
    """
    with torch.no_grad():
        torch.testing.assert_close(seq.eval()(x), model.eval()(x))
    model.train()
    torch.manual_seed(seed)
    actual = seq.train()(x)
    torch.manual_seed(seed)
    torch.testing.assert_close(actual, model(x))
    return actual


class OnBackward(torch.autograd.Function):
    """The identity, calling ``then()`` when the gradient passes back through:
    ``OnBackward.apply(x, then)`` makes a backward pass fail or stop there."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, then: Callable[[], None]) -> Tensor:
        ctx.then = then
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tuple[Tensor, None]:
        ctx.then()
        return grad, None


# -- captures made once ---------------------------------------------------------------

#: What capture_once made: the model, its sequential, PyTorch's generator after.
_CAPTURES: Dict[Hashable, Tuple[nn.Module, nn.Sequential, Tensor]] = {}


def capture_once(key: Hashable, build: Callable[[], Tuple[nn.Module, nn.Sequential]]
                 ) -> Tuple[nn.Module, nn.Sequential]:
    """A deep copy of the model and sequential that ``build()`` made the first
    time ``key`` was asked for in this process.

    A capture through torch.export takes seconds, the most of many tests of
    real models: each is made once per process. The copy's sequential holds
    the copy's own layers, and PyTorch's generator is left as ``build`` left
    it, so that what the test draws next is what it would draw after building
    the pair itself.
    """
    if key not in _CAPTURES:
        original, seq = build()
        _CAPTURES[key] = (original, seq, torch.get_rng_state())
    original, seq, state = _CAPTURES[key]
    pair = copy.deepcopy((original, seq))
    torch.set_rng_state(state)
    return pair


def captured(name: str, dtype: torch.dtype = torch.float64, evaluate: bool = False
             ) -> Tuple[nn.Module, nn.Sequential]:
    """The model ``name`` of ``benchmarks/models/zoo.py`` built after
    ``torch.manual_seed(0)``, in ``dtype`` (in evaluation mode if
    ``evaluate``), and its ``to_sequential``, made once (:func:`capture_once`)."""
    from benchmarks.models.zoo import MODELS
    from torchgpipe import to_sequential

    def build() -> Tuple[nn.Module, nn.Sequential]:
        case = MODELS[name]
        torch.manual_seed(0)
        original = case.factory().to(dtype)
        if evaluate:
            original.eval()
        return original, to_sequential(original) if case.example is None else \
            to_sequential(original, example_inputs=case.example())
    return capture_once(('zoo', name, dtype, evaluate), build)

"""The shape of the package: its modules import each other without a circle.

Every import counts, at the top of a module, inside a function or under
``TYPE_CHECKING``: each is a dependency a reader follows. The engine sits at
the bottom, instrumentation (``torchgpipe.foundation.record``) is a leaf it calls, and
the timeline and to_sequential sit on top.
"""
import ast
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Set, Tuple

import pytest

pytestmark = pytest.mark.slow

PACKAGE = Path(__file__).resolve().parent.parent / 'torchgpipe'


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix('').parts)
    if parts[-1] == '__init__':
        parts.pop()
    return '.'.join(parts)


def imports() -> Dict[str, Set[str]]:
    """Each module of the package, and the modules of the package it imports."""
    paths = {module_name(path): path for path in PACKAGE.rglob('*.py')}
    graph: Dict[str, Set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == '__init__.py' else name.rpartition('.')[0]
        found: Set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ''
                if node.level:
                    anchor = package.split('.')[:len(package.split('.')) - node.level + 1]
                    base = '.'.join(anchor + ([base] if base else []))
                for alias in node.names:
                    # 'from torchgpipe import microbatch' imports a module.
                    found.add(f'{base}.{alias.name}' if f'{base}.{alias.name}' in paths
                              else base)
        graph[name] = {module for module in found if module in paths and module != name}
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The circles of imports: strongly connected components of more than one module."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circle() -> None:
    graph = imports()
    assert 'torchgpipe.engine.pipeline' in graph
    assert 'torchgpipe.foundation.microbatch' in graph['torchgpipe.modules.gpipe']
    circles = cycles(graph)
    assert not circles, '\n'.join(
        ' <-> '.join(c) + '\n  ' + '\n  '.join(f'{v} imports {sorted(graph[v] & set(c))}'
                                            for v in c) for c in circles)


@pytest.mark.parametrize('first', ['torchgpipe.distributed', 'torchgpipe.modules.distributed',
                                   'torchgpipe.processes.core'])
def test_the_pipeline_across_processes_imports_from_any_module_first(first: str) -> None:
    """In a fresh interpreter, importing first the public package, DistributedGPipe's
    module or one it is made of finds none half-initialized, as an import circle through
    a package's ``__init__`` would leave them."""
    subprocess.run([sys.executable, '-c', f'import {first}\n'
                    'from torchgpipe.distributed import (DistributedGPipe, GradScaler, '
                    'Mismatch, PeerFailed, StepTimeout, train_step)\n'
                    'from torchgpipe.modules import distributed\n'
                    'assert DistributedGPipe is distributed.DistributedGPipe\n'],
                   cwd=PACKAGE.parent, check=True)


def test_the_engine_knows_no_timeline() -> None:
    graph = imports()
    # What sits above the engine: the timeline, to_sequential, balancing, planning.
    above = ('torchgpipe.timeline', 'torchgpipe.capture', 'torchgpipe.balance',
             'torchgpipe.planner')
    engine = [module for module in graph if module != 'torchgpipe'
              and not any(module == a or module.startswith(a + '.') for a in above)]
    assert {'torchgpipe.engine.pipeline', 'torchgpipe.engine.step',
            'torchgpipe.engine.mailbox'} <= set(engine)

    def reachable(module: str) -> Set[str]:
        seen: Set[str] = set()
        pending = [module]
        while pending:
            for imported in graph[pending.pop()] - seen:
                seen.add(imported)
                pending.append(imported)
        return seen

    for module in engine:
        assert not {m for m in reachable(module) if m.startswith('torchgpipe.timeline')}, module
    assert graph['torchgpipe.foundation.record'] == set(), 'the recording interface is a leaf'


DOCS = PACKAGE.parent / 'docs' / 'internals.rst'


def table() -> List[Tuple[int, str, List[str]]]:
    """The table under "Layers" in internals.rst: per line, the layer's number,
    the package of its folder, and its units (names within that package)."""
    text = DOCS.read_text()
    block = text[text.index('\nLayers\n'):].split('::\n\n', 1)[1].split('\n\n', 1)[0]
    rows = []
    for line in block.splitlines():
        number, _, folder, *units = line.split()
        rows.append((int(number), folder.strip('/').replace('/', '.'), units))
    return rows


#: The folders below the top, each a layer: their modules are units.
FOLDERS = {package for _, package, _ in table() if package != 'torchgpipe'}


def layers() -> Dict[str, int]:
    """The layer of each unit (a module of a layer's folder; at the top, a
    module or a subpackage), and of each folder's own ``__init__``."""
    found: Dict[str, int] = {}
    for number, package, units in table():
        if package != 'torchgpipe':
            found[package] = number
        for name in units:
            assert f'{package}.{name}' not in found, f'{package}.{name} is in two layers'
            found[f'{package}.{name}'] = number
    return found


def unit(module: str) -> str:
    """The unit of a module: ``torchgpipe.distributed.ddp`` is in
    ``torchgpipe.distributed``; a module of a layer's folder is its own."""
    parts = module.split('.')
    return '.'.join(parts[:3 if '.'.join(parts[:2]) in FOLDERS else 2])


def test_the_folders_are_the_layers() -> None:
    """Each line of the table lists what its folder holds: the tree is the table."""
    expected: Dict[str, Set[str]] = {}
    for _, package, units in table():
        expected.setdefault(package, set()).update(units)
    for package, units in expected.items():
        folder = PACKAGE.parent.joinpath(*package.split('.'))
        held = {path.stem for path in folder.glob('*.py')} | {
            path.name for path in folder.iterdir() if (path / '__init__.py').exists()}
        held -= {'__init__', '__version__', '_version'} | {f.split('.')[1] for f in FOLDERS}
        assert held == units, f'{package}: the table lists {sorted(units - held)} ' \
                              f'that it lacks, and not {sorted(held - units)}'


def test_every_unit_imports_only_its_layer_and_below() -> None:
    graph = imports()
    layer = layers()
    units = {unit(m) for m in graph} - {'torchgpipe', 'torchgpipe.__version__',
                                        'torchgpipe._version'}
    assert units == set(layer), 'docs/internals.rst lists every unit once, and no other'
    upward = sorted(f'{module} imports {imported}'
                    for module, imported_set in graph.items() if unit(module) in layer
                    for imported in imported_set
                    if unit(imported) in layer and layer[unit(imported)] > layer[unit(module)])
    assert not upward, '\n'.join(upward)
    package_graph: Dict[str, Set[str]] = {u: set() for u in units}
    for module, imported_set in graph.items():
        if unit(module) in units:
            package_graph[unit(module)] |= {unit(m) for m in imported_set
                                            if unit(m) in units and unit(m) != unit(module)}
    assert not cycles(package_graph), cycles(package_graph)


def test_the_layer_check_finds_an_upward_import(monkeypatch: pytest.MonkeyPatch) -> None:
    real = imports()
    stream = 'torchgpipe.foundation.stream'
    broken = {**real, stream: real[stream] | {'torchgpipe.gpipe'}}
    monkeypatch.setattr(sys.modules[__name__], 'imports', lambda: broken)
    with pytest.raises(AssertionError, match=f'{stream} imports torchgpipe.gpipe'):
        test_every_unit_imports_only_its_layer_and_below()


def test_the_cycle_finder_finds_circles() -> None:
    graph = {'a': {'b'}, 'b': {'c'}, 'c': {'a'}, 'd': {'a'}}
    assert cycles(graph) == [['a', 'b', 'c']]
    assert cycles({'a': {'b'}, 'b': set()}) == []


def test_modules_are_small() -> None:
    """A module holds one concern a reader can take in: none over 450 lines."""
    sizes = {module_name(path): len(path.read_text().splitlines())
             for path in PACKAGE.rglob('*.py')}
    assert len(sizes) > 40
    assert not {name: n for name, n in sizes.items() if n > 450}


def code_lines(function: ast.AST) -> int:
    """The lines of a function's definition, its docstring left out."""
    assert isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef))
    assert function.end_lineno is not None
    lines = function.end_lineno - function.lineno + 1
    docstring = function.body[0]
    if isinstance(docstring, ast.Expr) and isinstance(docstring.value, ast.Constant) and \
            isinstance(docstring.value.value, str):
        assert docstring.end_lineno is not None
        lines -= docstring.end_lineno - docstring.lineno + 1
    return lines


def test_functions_are_short() -> None:
    """A function does one thing a reader can follow: none over 80 lines of code."""
    long = {f'{module_name(path)}.{node.name}': code_lines(node)
            for path in PACKAGE.rglob('*.py') for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and code_lines(node) > 80}
    assert not long


def test_the_length_of_a_function_leaves_its_docstring_out() -> None:
    function = ast.parse('def f():\n    """Two\n    lines."""\n    return 1\n').body[0]
    assert code_lines(function) == 2


def imported_names(module: str) -> Set[Tuple[str, str]]:
    """Each ``(module, name)`` that ``from module import name`` brings into a module."""
    path = PACKAGE.parent / (module.replace('.', '/') + '.py')
    return {(node.module or '', alias.name) for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) for alias in node.names}


#: Each mechanism the executor and its two boundaries need, the one place that
#: implements it, and what each takes from there: the executor (every way to
#: run), the linked boundary (the forward path) and the cut one (steps).
MECHANISMS = {
    'a worker thread per device': ('torchgpipe.runtime.worker', {
        'torchgpipe.engine.step': {'run_on_workers'}}),
    'turns on the CPU generator': ('torchgpipe.runtime.worker', {
        'torchgpipe.engine.step': {'IssueOrder'}}),
    'the probe of random draws': ('torchgpipe.foundation.rng', {
        'torchgpipe.engine.pipeline': {'watch', 'cpu_generator_held'},
        'torchgpipe.engine.step': {'watch', 'cpu_generator_held'}}),
    'the replay of a checkpointed micro-batch': ('torchgpipe.runtime.replay', {
        'torchgpipe.runtime.checkpoint': {'first_pass', 'recomputation'},
        'torchgpipe.engine.step': {'first_pass', 'recomputation'}}),
    'moving a batch between devices': ('torchgpipe.foundation.copy', {
        'torchgpipe.engine.pipeline': {'Copy', 'Wait'}, 'torchgpipe.engine.step': {'Ready'}}),
    'skips crossing partitions': ('torchgpipe.skip.tracker', {
        'torchgpipe.engine.pipeline': {'SkipTrackerThroughPortals'},
        'torchgpipe.engine.mailbox': {'SkipTrackerAcross'}}),
}


@pytest.mark.parametrize('mechanism', sorted(MECHANISMS))
def test_each_mechanism_comes_from_its_one_place(mechanism: str) -> None:
    home, users = MECHANISMS[mechanism]
    for user, names in users.items():
        assert {(home, name) for name in names} <= imported_names(user), (user, names)


def test_every_way_to_run_is_one_executor() -> None:
    """One function starts the workers, for the forward path (the pipeline), train_step,
    eval_step and DistributedGPipe (a Step) alike, and 0.0.7's spawn_workers over it."""
    starters = {module_name(path) for path in PACKAGE.rglob('*.py')
                if ('torchgpipe.runtime.worker', 'run_on_workers') in
                {(node.module, alias.name) for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.ImportFrom) for alias in node.names}}
    assert starters == {'torchgpipe.engine.step'}
    step = (PACKAGE / 'engine' / 'step.py').read_text()
    assert step.count('run_on_workers(') == 1 and 'execute(self.order' in step
    functions = {node.name: ast.unparse(node) for node in ast.walk(ast.parse(
        (PACKAGE / 'runtime' / 'worker.py').read_text())) if isinstance(node, ast.FunctionDef)}
    assert [name for name, text in functions.items() if 'WorkerGroup(' in text] == \
        ['run_on_workers']
    assert 'run_on_workers(' in functions['spawn_workers']
    assert ('torchgpipe.engine.step', 'execute') in imported_names('torchgpipe.engine.pipeline')


def test_one_module_starts_threads_and_one_reads_generator_states() -> None:
    """No engine keeps a worker loop or a generator probe of its own."""
    sources = {module_name(path): path.read_text() for path in PACKAGE.rglob('*.py')}
    # Besides the workers: the threads that wait for a step's messages across
    # processes (a gloo wait cannot be interrupted), which run no task.
    assert [m for m, text in sorted(sources.items()) if 'threading.Thread(' in text] == \
        ['torchgpipe.runtime.worker', 'torchgpipe.transport.channels']
    assert [m for m, text in sources.items() if 'get_rng_state(' in text
            and 'torch.get_rng_state()' in text.replace('torch.cuda', '')] == \
        ['torchgpipe.foundation.rng']
    from torchgpipe.foundation.copy import Copy, Ready, Wait, copy_tensors, move_forward
    from torchgpipe.skip.tracker import SkipTrackerAcross, SkipTrackerThroughPortals
    from torchgpipe.engine.mailbox import StepSkips
    assert issubclass(SkipTrackerThroughPortals, SkipTrackerAcross)
    assert issubclass(StepSkips, SkipTrackerAcross)
    # Both ways of moving a batch end in the same copy.
    for code in (Copy.forward, Ready.receive):
        assert 'copy_tensors' in code.__code__.co_names or move_forward.__name__ in \
            code.__code__.co_names, code
    assert copy_tensors.__module__ == Wait.__module__


#: Lines that say nothing on their own: a repeat of them is no repeated logic.
TRIVIAL = {'"""', ')', ']', '}', '):', 'else:', 'try:', 'finally:', 'pass', 'return', 'yield',
           '...', 'Args:', 'Returns:', 'Raises:', 'Example::'}


def repeated_runs(sources: Dict[str, str], length: int = 6) -> List[Tuple[str, str]]:
    """Places where ``length`` consecutive lines (of substance) repeat lines met before."""
    seen: Dict[Tuple[str, ...], Tuple[str, int]] = {}
    repeats = []
    for name, text in sorted(sources.items()):
        lines = [(k, line.strip()) for k, line in enumerate(text.splitlines(), 1)]
        lines = [(k, t) for k, t in lines if t and t not in TRIVIAL and not t.startswith('#')]
        for w in range(len(lines) - length + 1):
            run = tuple(t for _, t in lines[w:w + length])
            first = seen.setdefault(run, (name, lines[w][0]))
            if first[0] != name or lines[w][0] - first[1] >= length:
                repeats.append((f'{first[0]}:{first[1]}', f'{name}:{lines[w][0]}'))
    return repeats


def test_no_run_of_six_identical_lines_repeats() -> None:
    """Each piece is written once: no six lines of substance appear twice in the package."""
    sources = {module_name(path): path.read_text() for path in PACKAGE.rglob('*.py')}
    assert not repeated_runs(sources)
    twin = ('def f(x):\n    y = x + 1\n    z = y * 2\n    w = z - 3\n    v = w / 4\n'
            '    u = v % 5\n    return u\n')
    assert repeated_runs({'a': twin, 'b': twin.replace('def f', 'def g')}) == [('a:2', 'b:2')]


def private_names(tree: ast.AST) -> Set[str]:
    """The private names a module defines: its functions, classes and module
    variables, and the attributes its methods set on ``self``."""
    names: Set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                isinstance(node.value, ast.Name) and node.value.id == 'self':
            names.add(node.attr)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
    return {name for name in names if name.startswith('_') and not name.startswith('__')}


def reaches(tree: ast.AST) -> Set[Tuple[str, int]]:
    """The private attributes a module reads or sets on objects other than ``self``/``cls``."""
    return {(node.attr, node.lineno) for node in ast.walk(tree)
            if isinstance(node, ast.Attribute) and node.attr.startswith('_')
            and not node.attr.startswith('__')
            and not (isinstance(node.value, ast.Name) and node.value.id in ('self', 'cls'))
            and not isinstance(node.value, ast.Call)}  # super()._name


def foreign_reaches(trees: Dict[str, ast.AST]) -> List[str]:
    """Where a module uses a private name that only other modules of the package define."""
    defined = {name: private_names(tree) for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        for attr, line in sorted(reaches(tree)):
            owners = [other for other, names in defined.items() if attr in names]
            if owners and name not in owners:
                found.append(f'{name}:{line} uses {attr}, private to {", ".join(owners)}')
    return found


def test_no_module_reaches_into_private_names_of_another() -> None:
    """GPipe, DistributedGPipe, the timeline and DDP's step meet through the pipeline's
    core (torchgpipe.engine.core), not through each other's private attributes."""
    trees = {module_name(path): ast.parse(path.read_text())
             for path in PACKAGE.rglob('*.py')}
    assert foreign_reaches(trees) == []


def test_the_private_name_check_finds_a_reach() -> None:
    trees = {'a': ast.parse('class A:\n    def __init__(self):\n        self._state = 1\n'),
             'b': ast.parse('def f(a):\n    return a._state\n'),
             'c': ast.parse('def g(t):\n    return t._version\n')}  # torch's, not ours
    assert foreign_reaches(trees) == ['b:2 uses _state, private to a']


def test_a_ranks_core_overrides_the_hooks_of_the_step_not_the_step() -> None:
    """Core.train and Core.evaluate are the one template of a step (with Core.started);
    RankCore changes only its hooks."""
    tree = ast.parse((PACKAGE / 'processes' / 'core.py').read_text())
    rank_core = next(node for node in tree.body
                     if isinstance(node, ast.ClassDef) and node.name == 'RankCore')
    defined = {node.name for node in rank_core.body if isinstance(node, ast.FunctionDef)}
    assert 'agreed' in defined
    assert not defined & {'train', 'evaluate', 'started'}

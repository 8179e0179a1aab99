"""Packaging: the sdist and wheel build, hold the package only, and install into a clean venv."""
import ast
import subprocess
import sys
import tarfile
import tomllib
import venv
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, List, Set

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import torchgpipe

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope='module')
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp('dist')
    subprocess.run([sys.executable, '-m', 'build', '--sdist', '--wheel', '--outdir', str(out),
                    str(ROOT)], check=True, capture_output=True)
    return out


def test_wheel_holds_the_package_and_no_tests_or_benchmarks(dist: Path) -> None:
    wheel, = dist.glob('*.whl')
    assert wheel.name.startswith(f'torchgpipe-{torchgpipe.__version__}-')
    names = zipfile.ZipFile(wheel).namelist()
    assert 'torchgpipe/__init__.py' in names
    assert 'torchgpipe/py.typed' in names
    assert 'torchgpipe/skip/portal.py' in names
    assert 'torchgpipe_balancing.py' in names
    assert not [n for n in names if n.startswith(('tests/', 'benchmarks/', 'examples/', 'docs/'))]
    sdist, = dist.glob('*.tar.gz')
    assert any(n.endswith('/LICENSE') for n in tarfile.open(sdist).getnames())


def link_torch(env: Path) -> None:
    """Links this environment's torch, and what it requires, into the venv ``env``.

    What installing the CPU build of torch into it would give, without
    unpacking a wheel of over a gigabyte: every top-level entry of the
    distributions (their packages and their ``.dist-info``, which pip reads).
    """
    site, = (env / 'lib').glob('python*/site-packages')
    names, done = ['torch'], set()
    while names:
        name = canonicalize_name(names.pop())
        if name in done:
            continue
        done.add(name)
        dist = metadata.distribution(name)
        for line in dist.requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({'extra': ''}):
                names.append(requirement.name)
        for top in {Path(str(f)).parts[0] for f in dist.files or []} - {'..'}:
            source = Path(str(dist.locate_file(top)))
            if source.exists() and not (site / top).exists():
                (site / top).symlink_to(source)


@pytest.mark.timeout(600)
def test_wheel_installs_into_a_clean_venv_and_trains(dist: Path, tmp_path: Path) -> None:
    wheel, = dist.glob('*.whl')
    env = tmp_path / 'venv'
    venv.EnvBuilder(with_pip=True).create(env)
    python = env / 'bin' / 'python'
    link_torch(env)
    # The wheel asks only for torch>=2.1, which the torch linked in satisfies:
    # pip installs the wheel alone (or fails, on a requirement nothing meets).
    subprocess.run([str(python), '-m', 'pip', 'install', '-q', '--no-index', str(wheel)],
                   check=True, capture_output=True)
    script = (
        'import torch, torchgpipe\n'
        'from torch import nn\n'
        'assert "venv" in torchgpipe.__file__, torchgpipe.__file__\n'
        'model = torchgpipe.GPipe(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), [1, 1],\n'
        '                         devices=["cpu", "cpu"], chunks=2)\n'
        'model(torch.rand(4, 2)).sum().backward()\n'
        'print(torchgpipe.__version__)\n'
    )
    result = subprocess.run([str(python), '-c', script], check=True, capture_output=True,
                            text=True, cwd=tmp_path)
    assert result.stdout.strip() == torchgpipe.__version__


def test_ci_reads_one_set_up_command_per_extra() -> None:
    """.ci/run takes its commands from README.md through .ci/commands.py, which checks
    every extra that pyproject.toml declares or the docs name; a failure there stops CI
    before any test runs (a docs regex that looks like an extra, '.[TR]', did)."""
    result = subprocess.run([sys.executable, str(ROOT / '.ci' / 'commands.py')],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = [line.split('\t') for line in result.stdout.splitlines()]
    # The docs build and the benchmarks' smoke run are the suite's own (below).
    assert [stage for stage, _, _ in lines] == ['examples', 'dev']
    # What CI installs ahead into a stage's venv: its extra's requirements.
    import tomllib
    extras = tomllib.loads((ROOT / 'pyproject.toml').read_text(encoding='utf-8'))[
        'project']['optional-dependencies']
    for stage, _, requirements in lines:
        assert requirements.split() == extras[stage]


def requirement_closure(names: List[str]) -> Set[str]:
    """The distributions that installing ``names`` brings, as installed here."""
    seen: Set[str] = set()
    todo = [canonicalize_name(name) for name in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({'extra': ''}):
                todo.append(canonicalize_name(requirement.name))
    return seen


def guarded(tree: ast.AST) -> Set[ast.AST]:
    """The import statements of ``tree`` inside a ``try`` that catches ImportError:
    optional, the code going on without them."""
    found: Set[ast.AST] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Try) and any(
                isinstance(h.type, ast.Name) and h.type.id in ('ImportError',
                                                               'ModuleNotFoundError')
                for h in node.handlers):
            found.update(n for statement in node.body for n in ast.walk(statement)
                         if isinstance(n, (ast.Import, ast.ImportFrom)))
    return found


def imported_modules(paths: List[Path]) -> Set[str]:
    """The top-level modules that ``paths`` import unguarded (at any depth), but the
    standard library and this repository's own; and, through them, that the modules
    of ``benchmarks`` they import do."""
    modules: Set[str] = set()
    todo, seen = list(paths), set()
    while todo:
        path = todo.pop()
        if path in seen or not path.exists():
            continue
        seen.add(path)
        tree = ast.parse(path.read_text(encoding='utf-8'))
        optional = guarded(tree)
        for node in ast.walk(tree):
            if node in optional:
                continue
            names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and \
                node.module else []
            for name in names:
                modules.add(name.split('.')[0])
                if name.startswith('benchmarks.'):
                    todo.append(ROOT.joinpath(*name.split('.')).with_suffix('.py'))
            if isinstance(node, ast.ImportFrom) and node.module == 'benchmarks':
                todo += [ROOT / 'benchmarks' / f'{alias.name}.py' for alias in node.names]
    return modules - set(sys.stdlib_module_names) - {'torchgpipe', 'benchmarks'}


def smoke_run_modules() -> Set[str]:
    """What ``python -m benchmarks.run_all --smoke`` imports: run_all, and every
    experiment of the registry (which it imports by name)."""
    from benchmarks import registry

    return imported_modules([ROOT / 'benchmarks' / 'run_all.py', ROOT / 'benchmarks' /
                             '__init__.py'] + [ROOT / 'benchmarks' / f'{name}.py'
                                               for name in registry.NAMES])


def docs_modules() -> Set[str]:
    """What the docs build imports: conf.py's imports, extensions and theme."""
    conf = ROOT / 'docs' / 'conf.py'
    names: Dict[str, Any] = {}
    for node in ast.parse(conf.read_text(encoding='utf-8')).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name) and \
                node.targets[0].id in ('extensions', 'html_theme'):
            names[node.targets[0].id] = ast.literal_eval(node.value)
    return imported_modules([conf]) | {name.split('.')[0]
                                       for name in [*names['extensions'], names['html_theme']]}


@pytest.mark.parametrize('extra, modules', [
    ('docs', docs_modules),
    ('benchmarks', smoke_run_modules),
])
def test_the_extras_ci_does_not_install_alone_hold_what_their_command_imports(
        extra: str, modules: Callable[[], Set[str]]) -> None:
    """The docs build and the benchmarks' smoke run are run by the test suite, in the
    dev extra's venv, not by CI in a venv of their own extra: every package their
    code imports comes with their extra (torch, which every command pins, aside)."""
    requirements = tomllib.loads((ROOT / 'pyproject.toml').read_text(encoding='utf-8'))[
        'project']['optional-dependencies'][extra]
    installed = requirement_closure(['torch'] + [Requirement(r).name for r in requirements])
    providers = metadata.packages_distributions()
    found = modules()
    assert found, 'no import found: the scan is broken'
    missing = {module: providers.get(module) for module in found
               if not {canonicalize_name(d) for d in providers.get(module, [])} & installed}
    assert not missing, f'imported, but not brought by the {extra!r} extra: {missing}'


def test_readme_gives_every_set_up_command_in_a_code_block() -> None:
    """A command to copy sits in a ```bash block of its own, never inside a
    sentence; the two right after the minimal example are the demo and the
    test suite, and the docs build comes later, in its own block."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location('ci_commands', ROOT / '.ci' / 'commands.py')
    assert spec is not None and spec.loader is not None
    commands = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(commands)

    readme = (ROOT / 'README.md').read_text(encoding='utf-8')
    fence = re.compile(r'^```(\w*)[ \t]*\n(.*?)^```', re.M | re.S)
    prose = fence.sub('', readme)
    assert commands.readme_commands(prose) == [], 'a set-up command in a sentence'
    blocks = [(m.group(1), commands.readme_commands(m.group(0))) for m in fence.finditer(readme)]
    assert blocks[0][0] == 'python', 'the minimal example comes first'
    set_up = [extras for language, extras in blocks if language == 'bash' and extras]
    assert all(len(extras) == 1 for extras in set_up), set_up
    assert [language for language, _ in blocks[1:3]] == ['bash', 'bash']
    assert ['.[examples]' in blocks[1][1][0], '.[dev]' in blocks[2][1][0]] == [True, True]
    assert sum('.[docs]' in extras[0] for extras in set_up) == 1


def test_the_demos_extra_stays_small() -> None:
    """``.[examples]`` installs what examples/demo.py, the README's first
    command, imports; transformers (for examples/transformers_lm.py, with its
    own dependencies) comes with ``.[dev]`` only."""
    import tomllib

    extras = tomllib.loads((ROOT / 'pyproject.toml').read_text(encoding='utf-8'))[
        'project']['optional-dependencies']
    assert not [d for d in extras['examples'] if d.startswith('transformers')], extras['examples']
    assert [d for d in extras['dev'] if d.startswith('transformers')], extras['dev']

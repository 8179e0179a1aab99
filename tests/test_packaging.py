"""Packaging: the sdist and wheel build, hold the package only, and install into a clean venv."""
import subprocess
import sys
import tarfile
import venv
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import torchgpipe

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
    stages = [line.split('\t')[0] for line in result.stdout.splitlines()]
    assert stages == ['examples', 'dev', 'docs', 'benchmarks']


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

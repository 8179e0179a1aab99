"""The test suite's own configuration: the coverage threshold holds for the whole suite only.

setup.cfg's addopts carry ``--cov-fail-under=95``; conftest.py lifts it when a
run is not the whole suite, so that ``python -m pytest tests/modules/test_gpipe.py``
passes when its tests do, while ``python -m pytest`` still fails below 95%,
also on the processes of pytest-xdist (the README's command, which CI runs).
"""
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import List, Set

import coverage
import pytest

from benchmarks import COVERAGE_VARIABLE, untraced_environ
from conftest import TESTS, is_whole_suite

pytestmark = pytest.mark.slow

ROOT = TESTS.parent
#: Options of the child runs that change nothing here but their start-up time.
FAST = ['-p', 'no:cacheprovider', '-p', 'no:hypothesispytest', '-p', 'no:anyio']


def start_pytest(args: List[str], cwd: Path, data: Path) -> 'subprocess.Popen[str]':
    """Starts pytest with the configuration of ``cwd`` (coverage and its threshold).

    Its coverage data goes to ``data``.
    """
    # It measures itself: without the variable that makes the outer run
    # trace it too (twice the tracing, for nothing).
    return subprocess.Popen([sys.executable, '-m', 'pytest', '-q', *FAST, *args], cwd=cwd,
                            env=dict(untraced_environ(), COVERAGE_FILE=str(data)), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def total_coverage(output: str) -> float:
    match = re.search(r'^TOTAL\s.*?(\d+(?:\.\d+)?)%$', output, re.M)
    assert match, output
    return float(match.group(1))


def test_the_threshold_is_in_the_projects_configuration() -> None:
    # What the next test relies on: the project's configuration sets a
    # threshold that a part of the suite does not reach.
    assert '--cov-fail-under=95' in (ROOT / 'setup.cfg').read_text(encoding='utf-8')


def test_part_of_the_suite_passes_below_the_threshold_and_the_whole_suite_fails(
        tmp_path: Path) -> None:
    """A suite of two test files, with this suite's conftest.py and setup.cfg:
    one of its files passes, run as one runs a file, its coverage far below
    95%; the whole suite fails, run as README.md runs it, on two processes of
    pytest-xdist (whose workers each see only part of the suite)."""
    shutil.copy(ROOT / 'setup.cfg', tmp_path / 'setup.cfg')
    tests = tmp_path / 'tests'
    tests.mkdir()
    for path in TESTS.glob('*.py'):
        if not path.name.startswith('test_'):  # conftest.py and the modules it may import
            shutil.copy(path, tests / path.name)
    for name in ['test_one.py', 'test_two.py']:
        (tests / name).write_text('def test_nothing():\n    pass\n')

    # Side by side: each starts torch and measures torchgpipe, a few seconds.
    part = start_pytest(['tests/test_one.py'], tmp_path, tmp_path / 'part.coverage')
    whole = start_pytest(['-n', '2', '--dist', 'loadfile'], tmp_path,
                         tmp_path / 'whole.coverage')
    try:
        part_output, _ = part.communicate(timeout=120)
        whole_output, _ = whole.communicate(timeout=120)
    finally:
        part.kill()
        whole.kill()

    assert part.returncode == 0, part_output
    assert total_coverage(part_output) < 95
    assert 'Coverage failure' not in part_output
    assert 'the 95% threshold holds for the whole suite only' in part_output

    assert whole.returncode == 1, whole_output
    assert '2 passed' in whole_output
    assert 'Coverage failure: total of' in whole_output
    assert 'less than fail-under=95' in whole_output


#: Every test file, as conftest.py's collection hook records them.
ALL = {path.resolve() for path in TESTS.rglob('test_*.py')}


@pytest.mark.parametrize('args, modules, deselected, whole', [
    (['tests'], ALL, False, True),                          # python -m pytest
    ([str(TESTS)], ALL, False, True),
    (['tests'], ALL, True, False),                          # -k, -m, --deselect, --lf
    (['tests/modules/test_gpipe.py'], {TESTS / 'modules' / 'test_gpipe.py'}, False, False),
    (['tests/modules/test_gpipe.py::test_parameters'], ALL, False, False),
    (['tests'], ALL - {TESTS / 'modules' / 'test_gpipe.py'}, False, False),  # --ignore
], ids=['default', 'directory', 'deselected', 'one-file', 'node-id', 'ignored-file'])
def test_what_is_the_whole_suite(args: List[str], modules: Set[Path], deselected: bool,
                                 whole: bool) -> None:
    assert is_whole_suite(args, modules, deselected) is whole


@pytest.mark.unmeasured
def test_a_test_marked_unmeasured_runs_untraced() -> None:
    # Neither this process traces (coverage.py's tracer is the trace
    # function when it measures), nor a process it starts.
    assert sys.gettrace() is None
    assert COVERAGE_VARIABLE not in os.environ


def test_other_tests_are_measured() -> None:
    if coverage.Coverage.current() is None:
        pytest.skip('coverage.py is not measuring this run (--no-cov)')
    assert sys.gettrace() is not None

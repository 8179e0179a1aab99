"""The type checker and the linter, run by the test suite: one command checks everything.

mypy checks ``torchgpipe/`` with setup.cfg's strict settings, ruff the whole
repository with pyproject.toml's; each runs in a child process, and a test
fails with its report. Run here, they overlap the suite's other files, where
they used to follow it.
"""
import subprocess
import sys
from typing import List

import pytest

from conftest import TESTS

ROOT = TESTS.parent

# They run none of the package's code: nothing to measure.
pytestmark = [pytest.mark.unmeasured, pytest.mark.slow]


@pytest.mark.parametrize('command', [['mypy'], ['ruff', 'check', '.']], ids=['mypy', 'ruff'])
def test_passes(command: List[str]) -> None:
    result = subprocess.run([sys.executable, '-m', *command], cwd=ROOT, capture_output=True,
                            text=True, timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr

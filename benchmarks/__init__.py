"""Benchmarks and examples reproducing the experiments of the torchgpipe paper.

``python -m benchmarks.<experiment>`` runs one experiment (the list is in
:mod:`benchmarks.registry`), ``python -m benchmarks.run_all`` all of them.
"""
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator

#: The root of the repository: where the measuring subprocesses start.
REPO_ROOT = Path(__file__).resolve().parent.parent

#: Where results go unless ``--output-dir`` says otherwise.
RESULTS_DIR = Path(__file__).resolve().parent / 'results'

#: What coverage.py's ``patch = subprocess`` (setup.cfg) sets for the Python
#: processes a measured one starts, so that they measure themselves too.
COVERAGE_VARIABLE = 'COVERAGE_PROCESS_CONFIG'


def untraced_environ() -> Dict[str, str]:
    """This process's environment, for a child that :func:`untraced` describes."""
    return {k: v for k, v in os.environ.items() if k != COVERAGE_VARIABLE}


@contextmanager
def untraced() -> Iterator[None]:
    """Python processes started inside run without coverage.py's tracing.

    Under the test suite, coverage.py traces every Python process started,
    which about doubles the time of code that calls many Python functions.
    A measuring process must not be slowed so; nor need be a process whose
    code the suite measures elsewhere.
    """
    saved = os.environ.pop(COVERAGE_VARIABLE, None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ[COVERAGE_VARIABLE] = saved

"""Benchmarks and examples reproducing the experiments of the torchgpipe paper.

``python -m benchmarks.<experiment>`` runs one experiment (the list is in
:mod:`benchmarks.registry`), ``python -m benchmarks.run_all`` all of them.
"""
from pathlib import Path

#: The root of the repository: where the measuring subprocesses start.
REPO_ROOT = Path(__file__).resolve().parent.parent

#: Where results go unless ``--output-dir`` says otherwise.
RESULTS_DIR = Path(__file__).resolve().parent / 'results'

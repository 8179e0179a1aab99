"""The experiments, in the order :mod:`benchmarks.run_all` runs them.

One entry per experiment: the name of its module in ``benchmarks/``, which
declares ``EXPERIMENT`` (a :class:`benchmarks.runner.Experiment`). The
summary of ``run_all``, the smoke tests and the documentation's list all come
from here, so adding an experiment is writing its module and adding its name.
"""
import importlib

from benchmarks.runner import Experiment

__all__ = ['NAMES', 'load']

NAMES = (
    'overhead',
    'transparency',
    'unet_memory',
    'unet_speed',
    'amoebanet_speed',
    'solver_speed',
    'unet_example',
    'timeline',
    'schedules',
    'bubbles',
    'distributed',
    'sharded',
    'plan',
)


def load(name: str) -> Experiment:
    """The :class:`Experiment` declared by ``benchmarks.<name>``."""
    if name not in NAMES:
        raise KeyError(f'no experiment {name!r}; the experiments are {", ".join(NAMES)}')
    experiment: Experiment = importlib.import_module(f'benchmarks.{name}').EXPERIMENT
    return experiment


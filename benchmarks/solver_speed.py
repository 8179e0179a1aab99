"""Solver speed: how long the balance solver takes to split 1,000 layer costs into 64 partitions.

Run from the repository root::

    python -m benchmarks.solver_speed

:func:`torchgpipe.balance.blockpartition.solve` is what
``balance_by_time`` and ``balance_by_size`` call on their profiled layer
costs. It is timed a few times on random costs, integers (what the profilers
return: microseconds or bytes) and floats; the table shows the fastest run
(the headline) and the median and slowest ones.
"""
import random
import sys
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from benchmarks.report import format_spread, format_table
from benchmarks.runner import Experiment, Figure, Option, Preset, main as run_main
from benchmarks.timing import time_steps
from torchgpipe.balance.blockpartition import solve

Cost = Union[int, float]

PRESETS: Dict[str, Preset] = {
    'cpu': Preset('1,000 random layer costs into 64 partitions, 5 runs each (~1 s)',
                  layers=1000, partitions=64, runs=5, seed=0),
}

SMOKE = dict(layers=50, partitions=4, runs=2)


def make_step(costs: Sequence[Cost], partitions: int) -> Callable[[], None]:
    def step() -> None:
        solve(costs, partitions)

    return step


def check(config: Dict[str, Any]) -> Optional[str]:
    if config['partitions'] > config['layers']:
        return (f"--partitions must be at most --layers, got {config['partitions']} partitions "
                f"for {config['layers']} layers (every partition needs a layer); pass "
                f"--partitions {config['layers']} or fewer")
    return None


def run(config: Dict[str, Any]) -> Dict[str, Any]:
    rng = random.Random(config['seed'])
    cases: Dict[str, List[Cost]] = {
        'int costs (1..10^6)': [rng.randint(1, 10**6) for _ in range(config['layers'])],
        'float costs [0, 1)': [rng.random() for _ in range(config['layers'])],
    }
    steps = {name: make_step(costs, config['partitions']) for name, costs in cases.items()}
    seconds = time_steps(steps, config['runs'], warmup=0, desc='solve')
    return {'results': [{'name': name, 'ms': {k: v * 1e3 if k != 'samples' else v
                                              for k, v in seconds[name].items()}}
                        for name in cases]}


def table(document: Dict[str, Any]) -> str:
    config = document['settings']
    return '\n'.join([
        f"{config['layers']} layers into {config['partitions']} partitions, "
        f"{config['runs']} runs each",
        format_table(['costs', 'solve time, ms: fastest (median, max)'],
                     [[r['name'], format_spread(r['ms'], digits=1)]
                      for r in document['results']])])


def headline(document: Dict[str, Any]) -> List[Figure]:
    return [Figure(f"solve, {r['name']}: fastest run", f"{r['ms']['min']:.1f} ms")
            for r in document['results']]


def plot(document: Dict[str, Any], plt: Any) -> None:
    results = document['results']
    fastest = [r['ms']['min'] for r in results]
    plt.bar([r['name'] for r in results], fastest, capsize=4,
            yerr=[[0.0] * len(results), [r['ms']['max'] - r['ms']['min'] for r in results]])
    plt.ylabel('solve time (ms): fastest run, whisker to the slowest')
    config = document['settings']
    plt.title(f"{config['layers']} layer costs into {config['partitions']} partitions")


#: The options of this experiment beyond those of every experiment.
OPTIONS = [Option('--layers', 'layers', 'how many layer costs', minimum=1),
           Option('--partitions', 'partitions', 'how many partitions', minimum=1),
           Option('--runs', 'runs', 'timed runs per kind of cost', minimum=1),
           Option('--seed', 'seed', 'seed of the random costs')]

EXPERIMENT = Experiment(
    name='solver_speed', doc=__doc__, presets=PRESETS, smoke=SMOKE, run=run, table=table,
    headline=headline, plot=plot, check=check, options=OPTIONS)


def main(argv: Optional[Sequence[str]] = None) -> Dict[str, Any]:
    return run_main(EXPERIMENT, argv)


if __name__ == '__main__':
    main(sys.argv[1:])

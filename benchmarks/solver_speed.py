"""Times the balance solver: 1,000 random layer costs into 64 partitions.

Run from the repository root::

    python -m benchmarks.solver_speed

It prints the median time of a few runs of
:func:`torchgpipe.balance.blockpartition.solve`, for integer costs (what the
profilers return: microseconds or bytes) and for float costs.
"""
import argparse
import random
import statistics
import time
from typing import Dict, List, Sequence, Union

from torchgpipe.balance.blockpartition import solve

Cost = Union[int, float]


def median_seconds(costs: Sequence[Cost], partitions: int, runs: int) -> float:
    """The median wall time of ``runs`` calls of the solver."""
    times: List[float] = []
    for _ in range(runs):
        started = time.perf_counter()
        solve(costs, partitions)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--layers', type=int, default=1000)
    parser.add_argument('--partitions', type=int, default=64)
    parser.add_argument('--runs', type=int, default=5)
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()

    rng = random.Random(args.seed)
    cases: Dict[str, List[Cost]] = {
        'int costs (1..10^6)': [rng.randint(1, 10**6) for _ in range(args.layers)],
        'float costs [0, 1)': [rng.random() for _ in range(args.layers)],
    }
    for name, costs in cases.items():
        seconds = median_seconds(costs, args.partitions, args.runs)
        print(f'{args.layers} layers into {args.partitions} partitions, {name}: '
              f'{seconds * 1000:.1f} ms (median of {args.runs})')


if __name__ == '__main__':
    main()

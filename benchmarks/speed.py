"""What the speed experiments (``unet_speed``, ``amoebanet_speed``) share.

Their ``--epochs`` option, the throughput cells of their tables (the fastest
epoch's, the headline, and the range over the counted epochs), and the
whiskers that show that range in their plots.
"""
from typing import Any, Dict, List, Mapping, Sequence

from benchmarks.runner import Option

__all__ = ['EPOCHS', 'format_throughput', 'throughput_whiskers', 'plot_throughputs']

EPOCHS = Option('--epochs', 'epochs', 'epochs per setting, at least 2', minimum=2,
                why='the first epoch is a warm-up and is not counted')


def format_throughput(result: Mapping[str, Any]) -> List[str]:
    """The fastest epoch's throughput and the range over the counted epochs, as two cells."""
    stats = result['throughput_spread']
    return [f"{result['throughput']:.2f}/s",
            f"{stats['min']:.2f}-{stats['max']:.2f}/s (median {stats['median']:.2f})"]


def throughput_whiskers(results: Sequence[Mapping[str, Any]]) -> List[List[float]]:
    """``yerr`` for a plot of the fastest throughputs: down to the slowest counted epoch."""
    return [[r['throughput'] - r['throughput_spread']['min'] for r in results],
            [0.0] * len(results)]


def plot_throughputs(plt: Any, results: Sequence[Dict[str, Any]], names: Sequence[str]) -> None:
    """Bars of the fastest throughputs, whiskers down to the slowest epochs, speed-ups on top."""
    bars = plt.bar(names, [r['throughput'] for r in results], color='tab:blue',
                   yerr=throughput_whiskers(results), capsize=4)
    for bar, r in zip(bars, results):
        if r['speedup'] is not None:
            plt.annotate(f"{r['speedup']:.2f}x", (bar.get_x() + bar.get_width() / 2,
                                                  bar.get_height()),
                         ha='center', va='bottom')
    plt.ylabel('throughput (samples/s): fastest epoch, whisker to the slowest')

"""What a run shows and leaves behind: progress bars, tables, JSON files and plots.

A run of experiment ``E`` with preset ``P`` writes ``<output-dir>/E-P.json``
and ``E-P.png``; a smoke run writes ``E-P-smoke.json`` and ``E-P-smoke.png``
instead, so that it never overwrites real results (:func:`output_path`).
"""
import json
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Sequence, TypeVar

__all__ = ['progress', 'format_table', 'format_spread', 'output_path', 'write_json',
           'save_plot']

T = TypeVar('T')


def progress(iterable: Iterable[T], *, total: Optional[int] = None, desc: str = '',
             leave: bool = False) -> Iterable[T]:
    """A tqdm progress bar on a terminal (none when tqdm is missing or output is redirected)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable
    bar: Iterable[T] = tqdm(iterable, total=total, desc=desc, leave=leave, disable=None,
                            dynamic_ncols=True)
    return bar


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain-text table: a header, a rule, and right-aligned cells.

    Raises:
        ValueError: if a header is empty or repeated: every column says what
            it holds, and no two say the same
    """
    if not all(headers) or len(set(headers)) != len(headers):
        raise ValueError(f'every column needs a header of its own, got {list(headers)}')
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ['  '.join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, '  '.join('-' * w for w in widths))
    return '\n'.join(lines)


def format_spread(stats: Mapping[str, float], scale: float = 1.0, digits: int = 3,
                  unit: str = '') -> str:
    """A :func:`benchmarks.timing.spread` in one cell: ``1.200 ms (median 1.250, max 1.410)``.

    The first figure is the fastest sample (the headline), the bracket the
    median and the slowest one, in the same unit.
    """
    low, median, high = (stats[k] * scale for k in ('min', 'median', 'max'))
    return f'{low:.{digits}f}{unit} (median {median:.{digits}f}, max {high:.{digits}f})'


def output_path(output_dir: Path, experiment: str, preset: str, smoke: bool,
                suffix: str) -> Path:
    """``<output_dir>/<experiment>-<preset>[-smoke]<suffix>``."""
    return Path(output_dir) / f"{experiment}-{preset}{'-smoke' if smoke else ''}{suffix}"


def write_json(path: Path, document: Dict[str, Any]) -> Path:
    """Writes ``document`` as indented JSON to ``path`` and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=2, default=str) + '\n')
    print(f'results: {path}')
    return path


def save_plot(path: Path, draw: Callable[[Any], None]) -> Optional[Path]:
    """Draws a figure with ``draw(pyplot)`` into ``path``.

    Returns None, with a message, when matplotlib is not installed.
    """
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print('plot skipped: matplotlib is not installed (pip install matplotlib, '
              "or pip install -e '.[benchmarks]')")
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    plt.figure(figsize=(6.4, 4.2))
    try:
        draw(plt)
        plt.tight_layout()
        plt.savefig(path, dpi=120)
    finally:
        plt.close('all')
    print(f'plot: {path}')
    return path

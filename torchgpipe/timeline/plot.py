"""Draws a timeline as a Gantt chart (matplotlib, an optional dependency)."""
import os
from typing import Any, Dict, List, Optional, Sequence, Tuple, Union

from torchgpipe.timeline.events import SIDE_TRACKS, Event

__all__: List[str] = []

#: A colour per kind, and the legend's words for it.
COLORS: Dict[str, str] = {'forward': '#4c72b0', 'recompute': '#8fb0de', 'backward': '#dd8452',
                          'input': '#c44e52', 'weight': '#e8c07d', 'copy': '#55a868',
                          'send': '#555555', 'receive': '#cccccc'}
LABELS: Dict[str, str] = {'forward': 'forward F', 'recompute': "recompute F'",
                          'backward': 'backward B', 'input': 'input gradients I',
                          'weight': 'weight gradients W', 'copy': 'copy',
                          'send': 'send S', 'receive': 'wait to receive R'}
#: The kinds whose boxes are light: their text is black.
LIGHT = ('recompute', 'weight', 'receive')


def plot_timeline(segments: Sequence[Tuple[Event, float, float]],
                  path: Union[str, 'os.PathLike[str]'], title: Optional[str]) -> None:
    """Writes a chart of ``segments`` (as :func:`torchgpipe.timeline.segments` gives them) to
    ``path``: a row per track, a box per segment, its action inside (``1F0``)."""
    try:
        import matplotlib
    except ModuleNotFoundError as exc:
        raise ModuleNotFoundError(
            'Timeline.plot draws with matplotlib, which is not installed: '
            'pip install matplotlib (Timeline.save writes a JSON trace without it)',
            name=exc.name) from exc
    matplotlib.use('Agg', force=False)
    import matplotlib.pyplot as plt

    rows = len({e.track for e, _, _ in segments})
    figure, axes = plt.subplots(figsize=(12, 0.6 * rows + 1.6))
    try:
        draw_timeline(axes, segments, title)
        figure.tight_layout()
        figure.savefig(path, dpi=120)
    finally:
        plt.close(figure)


def draw_timeline(axes: Any, segments: Sequence[Tuple[Event, float, float]],
                  title: Optional[str] = None, *, legend: bool = True) -> None:
    """Draws the chart of :func:`plot_timeline` on matplotlib ``axes``, for a figure of one's
    own; ``legend`` puts the colours' legend below it."""
    from matplotlib.patches import Patch

    # Devices (or ranks) top to bottom in order, each followed by its
    # copies' (or messages') row.
    tracks = sorted({e.track for e, _, _ in segments}, key=side_last)
    rows = {track: k for k, track in enumerate(tracks)}
    end = max((b for _, _, b in segments), default=0.0)
    start = min((a for _, a, _ in segments), default=0.0)
    scale = 1e3  # milliseconds

    for e, a, b in segments:
        y = len(tracks) - 1 - rows[e.track]
        left, width = (a - start) * scale, (b - a) * scale
        # A copy between CPU devices takes microseconds: a sliver, without edge.
        sliver = (end - start) * scale / 800
        edge = 'black' if e.failed else 'white' if width > sliver else 'none'
        axes.barh(y, max(width, sliver), left=left, height=0.8, color=COLORS[e.kind],
                  edgecolor=edge, linewidth=0.5)
        # The action ('1F0') where it fits, else its micro-batch.
        for text in (e.name, str(e.micro_batch)):
            if width > len(text) * (end - start) * scale / 150:
                axes.text(left + width / 2, y, text, ha='center', va='center', fontsize=7,
                          color='black' if e.kind in LIGHT else 'white')
                break
    axes.set_yticks(range(len(tracks)), list(reversed(tracks)))
    axes.set_xlabel('time (ms)')
    axes.set_xlim(0, max((end - start) * scale, 1e-3))
    if legend:
        kinds = [k for k in COLORS if any(e.kind == k for e, _, _ in segments)]
        axes.legend(handles=[Patch(color=COLORS[k], label=LABELS[k]) for k in kinds],
                    loc='upper center', bbox_to_anchor=(0.5, -0.18 - 0.1 / max(len(tracks), 1)),
                    ncol=len(kinds) or 1, frameon=False)
    if title:
        axes.set_title(title)


def side_last(track: str) -> Tuple[str, bool]:
    """Sorts a device's (or rank's) row of copies (or messages) right after its own."""
    for suffix in SIDE_TRACKS:
        if track.endswith(suffix):
            return track.removesuffix(suffix), True
    return track, False

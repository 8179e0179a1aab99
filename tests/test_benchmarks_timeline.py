"""The timeline experiment's ablations switch off what they say, and only that."""
import sys
from pathlib import Path
from typing import Any, Dict, Sequence, Set

import pytest
import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.models.unet import unet  # noqa: E402
from benchmarks.timeline import components, without_portals  # noqa: E402
from torchgpipe import GPipe  # noqa: E402
from torchgpipe.skip.portal import PortalCopy  # noqa: E402
from torchgpipe.runtime.traits import RunState  # noqa: E402
from torchgpipe.foundation.stream import current_stream  # noqa: E402


def node_names(output: Tensor) -> Set[str]:
    names, stack, seen = set(), [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        stack.extend(n for n, _ in node.next_functions)
    return names


def test_without_portals_is_the_same_model_carrying_its_skips() -> None:
    model = unet(depth=2, num_convs=1, base_channels=4)
    carried = without_portals(model)
    input = torch.rand(4, 3, 16, 16)
    assert torch.equal(carried(input), model(input))

    # In a pipeline, the skips cross partitions in the batch, not in portals.
    pipe = GPipe(carried, balance=[10, len(carried) - 10], devices=['cpu', 'cpu'], chunks=2)
    output = pipe(input)
    assert torch.allclose(output, model(input), atol=1e-6)
    # (The layout still sees the skippable layers inside the wrappers, which
    # carry the skips themselves through dispatch(): no portal is made.)
    assert PortalCopy.__name__ + 'Backward' not in node_names(output)
    with_portals = GPipe(model, balance=[10, len(model) - 10], devices=['cpu', 'cpu'], chunks=2)
    assert PortalCopy.__name__ + 'Backward' in node_names(with_portals(input))


def ordered(output: Tensor) -> bool:
    """Whether a micro-batch's backward waits for another's: a fork, or a checkpoint taking
    the phony of the one before (its first input)."""
    stack, seen = [output.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        kids = [n for n, _ in node.next_functions if n is not None]
        if type(node).__name__ == 'ForkBackward' or type(node).__name__ == 'CheckpointBackward' \
                and type(node.next_functions[0][0]).__name__ == 'CheckpointBackward':
            return True
        stack.extend(kids)
    return False


@pytest.mark.parametrize('checkpoint', ['never', 'always'])
def test_components_switch_off_the_dependencies_and_the_copy_streams(checkpoint: str) -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    pipe = GPipe(model, balance=[2, 1], devices=['cpu', 'cpu'], chunks=2, checkpoint=checkpoint)
    input = torch.rand(4, 4)
    assert ordered(pipe(input))
    with components(dependency=False, streams=True):
        assert not ordered(pipe(input))
    original = RunState.ensure_copy_streams
    with components(dependency=True, streams=False):
        # (On CPU every stream is the same: check the switch is in place.)
        assert RunState.ensure_copy_streams is not original
        streams = pipe.core.state.ensure_copy_streams(pipe.devices, pipe.chunks)
    assert RunState.ensure_copy_streams is original
    # Copies go on each partition's compute stream, one per micro-batch.
    assert streams == [[current_stream(d)] * 2 for d in pipe.devices]
    assert ordered(pipe(input))


def test_plot_shares_the_time_axis_and_keeps_the_legend_off_its_label() -> None:
    import pytest
    matplotlib = pytest.importorskip('matplotlib')
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt

    from benchmarks.timeline import plot

    def row(name: str, length: float, kinds: Sequence[str]) -> Dict[str, Any]:
        events = [{'kind': kind, 'micro_batch': 0, 'partition': 0, 'device': 'cpu:0',
                   'track': 'cpu:0', 'thread': 't', 'start': k * length / len(kinds),
                   'end': (k + 1) * length / len(kinds), 'step': 0,
                   'pieces': [[k * length / len(kinds), (k + 1) * length / len(kinds)]],
                   'failed': False, 'detail': ''} for k, kind in enumerate(kinds)]
        return {'name': name, 'traced_step_time': length, 'utilization': 1.0,
                'events': events}

    document = {'results': [row('long', 0.4, ['forward', 'recompute', 'backward']),
                            row('short', 0.1, ['forward', 'backward'])]}
    plt.figure()
    try:
        plot(document, plt)
        plt.tight_layout()  # as benchmarks.report.save_plot does after drawing
        figure = plt.gcf()
        figure.canvas.draw()
        renderer = figure.canvas.get_renderer()
        first, last = figure.axes
        label = last.xaxis.label.get_window_extent(renderer)
        legend = last.get_legend()
        box = legend.get_window_extent(renderer)
        texts = [t.get_text() for t in legend.get_texts()]
        limits = first.get_xlim(), last.get_xlim()
    finally:
        plt.close('all')
    # One time scale, set by the longest step (in ms).
    assert limits[0] == limits[1] == pytest.approx((0, 400))
    # The legend names every kind drawn, and lies wholly below the time label.
    assert texts == ['forward F', "recompute F'", 'backward B']
    assert box.y1 < label.y0

"""The timeline experiment's ablations switch off what they say, and only that."""
import sys
from pathlib import Path
from typing import Set

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.models.unet import unet  # noqa: E402
from benchmarks.timeline import components, without_portals  # noqa: E402
from torchgpipe import GPipe  # noqa: E402
from torchgpipe.skip.portal import PortalCopy  # noqa: E402
from torchgpipe.stream import current_stream  # noqa: E402


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


def test_components_switch_off_the_dependencies_and_the_copy_streams() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    pipe = GPipe(model, balance=[2, 1], devices=['cpu', 'cpu'], chunks=2)
    input = torch.rand(4, 4)
    assert 'ForkBackward' in node_names(pipe(input))
    with components(dependency=False, streams=True):
        assert 'ForkBackward' not in node_names(pipe(input))
    original = GPipe._ensure_copy_streams
    with components(dependency=True, streams=False):
        # (On CPU every stream is the same: check the switch is in place.)
        assert GPipe._ensure_copy_streams is not original
        streams = pipe._ensure_copy_streams()
    assert GPipe._ensure_copy_streams is original
    # Copies go on each partition's compute stream, one per micro-batch.
    assert streams == [[current_stream(d)] * 2 for d in pipe.devices]
    assert 'ForkBackward' in node_names(pipe(input))

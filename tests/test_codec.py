"""The wire's headers: data only, so that a peer's bytes never run code.

Every kind of value a pipeline sends goes through the header and back; what
the library does not write is refused with :class:`Unreadable`, and a
message that ``pickle`` would have turned into code (a file created here)
makes the receiving rank raise instead, touching nothing.
"""
import math
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any, List, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from torchgpipe import NoChunk
from torchgpipe.distributed.channels import SMALL, Channels
from torchgpipe.distributed.codec import (Unreadable, Unsendable, decode, dump_header, encode,
                                          load_header)
from torchgpipe.engine.mailbox import Activation, ForwardMessage, Gradient, Reply
from torchgpipe.foundation.copy import Ready
from torchgpipe.foundation.microbatch import Batch

pytestmark = pytest.mark.timeout(120)


def round_trip(message: Any) -> Any:
    tensors: List[Tensor] = []
    body = encode(message, tensors)
    offsets = [64 * k for k in range(len(tensors))]
    kind, metas, size, body, at = load_header(dump_header('message', tensors, offsets, 99, body,
                                                          ['arena', 128]))
    assert kind == 'message' and size == 99 and at == ['arena', 128]
    assert [(shape, dtype, offset) for shape, dtype, offset in metas] == \
        [(list(t.shape), t.dtype, offset) for t, offset in zip(tensors, offsets)]
    return decode(body, tensors, torch.device('cpu'))


def test_every_value_a_pipeline_sends_comes_back_as_it_went() -> None:
    x, y = torch.randn(2, 3), torch.arange(4).to(torch.int8)
    message = (Activation(3, 1), ForwardMessage(Batch((x, None, 2.5, 'scale', True, NoChunk(y))),
                                        [True, False], Ready(torch.device('cpu'))))
    key, (batch, requires_grad, ready) = round_trip(message)
    assert key == Activation(3, 1) and requires_grad == [True, False]
    assert isinstance(ready, Ready) and isinstance(batch, Batch)
    values = batch.values
    assert values[0] is x and values[1:5] == (None, 2.5, 'scale', True)
    assert isinstance(values[5], NoChunk) and values[5].tensor is y
    reply = round_trip(Reply([x, None], Ready(torch.device('cpu'))))
    assert isinstance(reply, Reply) and reply.grads == [x, None]
    other = (Gradient(0, 2), ('Skip', 1, 0), {'a': [1, (2, 3)], 4: torch.Size([2, 3])},
             torch.float16, torch.device('cpu'), -7, 2 ** 70, math.inf, '')
    assert round_trip(other) == other
    assert math.isnan(round_trip(math.nan))
    assert round_trip([]) == [] and round_trip(()) == () and round_trip(None) is None


def test_another_value_is_refused_when_sent() -> None:
    with pytest.raises(Unsendable, match=r'object cannot go to another rank: a message holds '
                                         r'tensors, tuples'):
        encode((torch.zeros(1), object()), [])


@pytest.mark.parametrize('data, why', [
    (pickle.dumps(('message', [], None)), 'not a header'),
    (b'{"kind": 1}', 'not a header'),
    (b'["message", [[[-1], "float32", 0]], 4, null, null]', 'not a tensor'),
    (b'["message", [[[1], "object", 0]], 8, null, null]', 'not a tensor'),
    (b'["message", [[[1], "float32", -64]], 4, null, null]', 'not a tensor'),
    (b'["message", [[[1], "float32"]], 4, null, null]', 'not a tensor'),
    (b'["message", [], -1, null, null]', 'no kind, tensors, payload size and place'),
    (b'["message", [], 4, null, ["arena"]]', 'no kind, tensors, payload size and place'),
    (b'["message", [], 4, null, [0, 64]]', 'no kind, tensors, payload size and place'),
    (b'["message", [], 4, null]', 'not a header'),
    (b'[' * 100000 + b']' * 100000, 'not a header'),
    (b'5', 'not a header'),
])
def test_a_header_of_other_bytes_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(Unreadable, match=why):
        load_header(data)


def test_a_lone_tensor_is_sent_as_it_is() -> None:
    """The payload of a message with one contiguous tensor is that tensor's own
    memory, without a copy; tensors it cannot be (several, strided, a
    conjugate view) are copied into a buffer of their own."""
    sender = SimpleNamespace(device=torch.device('cpu'),
                             buffer=lambda size: torch.empty(size, dtype=torch.uint8))
    x = torch.randn(4, 3)
    payload, offsets = Channels.payload(cast(Any, sender), [x])
    assert payload.data_ptr() == x.data_ptr() and offsets == [0]
    assert payload.numel() == x.numel() * x.element_size()
    for tensors in ([x, x], [x.t()], [torch.randn(3, dtype=torch.complex64).conj()]):
        payload, offsets = Channels.payload(cast(Any, sender), tensors)
        assert all(payload.data_ptr() != t.data_ptr() for t in tensors)
        for t, offset in zip(tensors, offsets):
            received = payload[offset:offset + t.numel() * t.element_size()].view(t.dtype)
            assert torch.equal(received.view(t.shape), t.resolve_conj())


@pytest.mark.parametrize('capacities', [[8, SMALL], [SMALL, 1 << 41], [SMALL, 1.5]])
def test_a_raise_of_capacities_no_rank_sends_is_refused(capacities: Any) -> None:
    """A capacity below the smallest a channel starts with, or beyond any a
    rank could use: no rank of the pipeline raises a channel to it."""
    data = dump_header('grow', [], [], 1, capacities)
    buffer = torch.zeros(SMALL, dtype=torch.uint8)
    buffer[:8 + len(data)] = torch.tensor(list(len(data).to_bytes(8, 'little') + data),
                                          dtype=torch.uint8)
    with pytest.raises(Unreadable, match="a message of kind 'grow'"):
        Channels.parse(cast(Any, None), buffer)  # reads nothing of its channels


@pytest.mark.parametrize('body, why', [
    ({'T': 0}, 'tensor 0 of 0'),
    ([1, 2], 'a bare list'),
    ({'Z': 1}, "unknown tag 'Z'"),
    ({'t': [1], 'l': [2]}, 'dict where a tagged value'),
    ({'P': [1]}, "'P'"),
    ({'dt': 'os.system'}, "'dt'"),
    ({'d': [[1]]}, 'not pairs'),
])
def test_a_body_of_other_data_is_refused(body: Any, why: str) -> None:
    with pytest.raises(Unreadable, match=why):
        decode(body, [], torch.device('cpu'))


class Exploit:
    """What a hostile peer sends: unpickled, it creates a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (open, (self.path, 'w'))


def hostile_peer(rank: int, world_size: int, path: str) -> str:
    """Both ranks build the pipeline (they agree on its layout); rank 0 trains, and
    rank 1 answers its first word with a crafted pickle."""
    from torchgpipe.distributed import DistributedGPipe
    torch.manual_seed(0)
    pipe = DistributedGPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1])
    if rank == 0:
        try:
            pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
        except Unreadable as exc:
            return str(exc)
        return 'no error'
    # The header of rank 0's first word (the step it runs), where rank 0
    # waits for rank 1's.
    dist.recv(torch.empty(SMALL, dtype=torch.uint8), 0)
    payload = pickle.dumps(('message', [], pickle.dumps(Exploit(path))))
    buffer = torch.zeros(SMALL, dtype=torch.uint8)
    buffer[:8] = torch.tensor(list(len(payload).to_bytes(8, 'little')), dtype=torch.uint8)
    buffer[8:8 + len(payload)] = torch.tensor(list(payload), dtype=torch.uint8)
    dist.send(buffer, 0)
    dist.recv(torch.empty(SMALL, dtype=torch.uint8), 0)  # that word's payload
    return 'sent'


def test_a_hostile_message_runs_no_code_and_is_refused(tmp_path: Path) -> None:
    path = tmp_path / 'pwned'
    error, sent = run_distributed(hostile_peer, str(path), timeout=60)
    assert sent == 'sent'
    assert not path.exists()
    assert error.startswith('a message from rank 1 is none this library writes (not a '
                            'header: '), error
    assert error.endswith('only the ranks of the pipeline may reach its ports'), error

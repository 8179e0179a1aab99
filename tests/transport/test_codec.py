"""The wire's headers: data only, so that a peer's bytes never run code.

Every kind of value a pipeline sends goes through the header and back; what
the library does not write is refused with :class:`Unreadable`, and a
message that ``pickle`` would have turned into code (a file created here)
makes the receiving rank raise instead, touching nothing.
"""
import json
import math
import pickle
from pathlib import Path
from typing import Any, List

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from process_group import no_child_left  # noqa: F401 (an autouse fixture)
from process_group import run_distributed
from torchgpipe import NoChunk
from torchgpipe.engine.mailbox import Activation, ForwardMessage, Gradient, Reply
from torchgpipe.foundation.copy import Ready
from torchgpipe.foundation.microbatch import Batch
from torchgpipe.transport.channels import WORD_LIMIT, metas_of, read_word, wired
from torchgpipe.transport.codec import Unreadable, Unsendable, decode, encode
from torchgpipe.transport.faults import read_header

pytestmark = [pytest.mark.timeout(120), pytest.mark.slow]


def round_trip(message: Any) -> Any:
    """``message`` through a header and back, its tensors beside it."""
    tensors: List[Tensor] = []
    header = json.dumps([['Activation', 0, 1], encode(message, tensors), metas_of(tensors)])
    _, body, metas = read_header(header.encode(), 1)
    assert metas == [[list(t.shape), str(t.dtype).split('.')[-1]] for t in tensors]
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


def test_a_value_of_one_element_goes_inline_exactly() -> None:
    """A step's end carries its loss in its word: each real type's value comes back
    bit for bit, on the receiver's device; other tensors are sent as tensors."""
    values = [torch.tensor(1 / 3, dtype=t) for t in (torch.float64, torch.float32,
                                                     torch.float16, torch.bfloat16)]
    values += [torch.tensor(math.nan), torch.tensor(-math.inf), torch.tensor(2 ** 62),
               torch.tensor(True)]
    tensors: List[Tensor] = []
    body = json.loads(json.dumps(encode((values, torch.zeros(2)), tensors, inline=True)))
    assert len(tensors) == 1
    received, _ = decode(body, tensors, torch.device('cpu'))
    for value, back in zip(values, received):
        assert back.dtype == value.dtype and back.shape == ()
        assert torch.equal(back, value) or (back.isnan() and value.isnan())


def test_another_value_is_refused_when_sent() -> None:
    with pytest.raises(Unsendable, match=r'object cannot go to another rank: a message holds '
                                         r'tensors, tuples'):
        encode((torch.zeros(1), object()), [])


@pytest.mark.parametrize('data, why', [
    (pickle.dumps(('message', [], None)), 'not a header'),
    (b'{"kind": 1}', 'not a header'),
    (b'[1, null, [[[-1], "float32"]]]', 'not tensors'),
    (b'[1, null, [[[1], "object"]]]', 'not tensors'),
    (b'[1, null, [[[1], "float32", 0]]]', 'not tensors'),
    (b'[1, null, [[[1.5], "float32"]]]', 'not tensors'),
    (b'[1, null]', 'not a header'),
    (b'[' * 100000 + b']' * 100000, 'not a header'),
    (b'5', 'not a header'),
])
def test_a_header_of_other_bytes_is_refused(data: bytes, why: str) -> None:
    with pytest.raises(Unreadable, match=why):
        read_header(data, 1)


@pytest.mark.parametrize('length', [0, WORD_LIMIT + 1, 1 << 62])
def test_a_word_of_another_length_is_refused(length: int) -> None:
    buffer = length.to_bytes(8, 'little') + bytes(WORD_LIMIT)
    with pytest.raises(Unreadable, match=f'a word of {length} bytes from rank 1'):
        read_word(buffer, 1)


def test_tensors_are_sent_as_their_values_without_a_copy_where_they_can_be() -> None:
    """A contiguous tensor goes as it is; a strided one, or a conjugate or
    negative view, goes as a contiguous copy of its values."""
    x = torch.randn(4, 3)
    assert wired(x).data_ptr() == x.data_ptr()
    z = torch.randn(3, dtype=torch.complex64)
    for t in (x.t(), z.conj(), z.conj().imag):
        sent = wired(t)
        assert sent.is_contiguous() and not sent.is_conj() and not sent.is_neg()
        assert torch.equal(sent, t.resolve_conj().resolve_neg())


@pytest.mark.parametrize('body, why', [
    ({'T': 0}, 'tensor 0 of 0'),
    ([1, 2], 'a bare list'),
    ({'Z': 1}, "unknown tag 'Z'"),
    ({'t': [1], 'l': [2]}, 'dict where a tagged value'),
    ({'P': [1]}, "'P'"),
    ({'dt': 'os.system'}, "'dt'"),
    ({'d': [[1]]}, 'not pairs'),
    ({'v': [1.5, 'object']}, "'v' of"),
    ({'v': ['1', 'float32']}, "'v' of"),
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


def hostile_peer(rank: int, world_size: int, path: str, length: int) -> str:
    """Both ranks build the pipeline (they agree on its layout); rank 0 trains, and
    rank 1, agreeing on the step, answers its first message with a crafted header:
    a pickle of ``length`` bytes (or its length alone, if none could be sent)."""
    from torchgpipe.distributed import DistributedGPipe
    torch.manual_seed(0)
    pipe = DistributedGPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), [1, 1])
    if rank == 0:
        try:
            pipe.train_step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
        except Unreadable as exc:
            return str(exc)
        return 'no error'
    word = torch.empty(8 + WORD_LIMIT, dtype=torch.uint8)
    channels = pipe.core.channels
    dist.recv(word, 0, group=channels.words, tag=channels.word_tag)  # rank 0's step: the same
    dist.send(word[:8 + int.from_bytes(bytes(word[:8].tolist()), 'little')], 0,
              group=channels.words, tag=channels.word_tag)
    dist.send(torch.tensor([length]), 0, group=channels.group)
    if length < 1 << 20:
        payload = pickle.dumps(Exploit(path))
        dist.send(torch.tensor(list(payload.ljust(length)), dtype=torch.uint8), 0,
                  group=channels.group)
    return 'sent'


@pytest.mark.parametrize('length, error', [
    (1000, 'a message from rank 1 is none this library writes (not a header: '),
    (1 << 40, 'a message from rank 1 has a header of 1099511627776 bytes')])
def test_a_hostile_message_runs_no_code_and_is_refused(tmp_path: Path, length: int,
                                                      error: str) -> None:
    path = tmp_path / 'pwned'
    raised, sent = run_distributed(hostile_peer, str(path), length, timeout=60)
    assert sent == 'sent'
    assert not path.exists()
    assert raised.startswith(error), raised

"""The mailbox of a training step: typed messages, and waits that a stop ends."""
import threading
from typing import List

import pytest

from torchgpipe.engine.mailbox import Activation, Gradient, Mailbox, Skip, SkipGradient
from torchgpipe.runtime.worker import Stopped
from torchgpipe.skip import Namespace


def test_messages_of_different_kinds_never_share_a_key() -> None:
    """An output and a gradient of the same micro-batch and partition are two messages."""
    key = (Namespace(), 'skip')
    keys = [Activation(0, 1), Gradient(0, 1), Skip(0, key), SkipGradient(0, key)]
    mailbox = Mailbox()
    for k, message in enumerate(keys):
        mailbox.put(message, k)
    assert [mailbox.take(message) for message in reversed(keys)] == [3, 2, 1, 0]
    assert len(set(keys)) == len(keys)


def test_take_waits_for_its_message() -> None:
    mailbox = Mailbox()
    got: List[object] = []
    thread = threading.Thread(target=lambda: got.append(mailbox.take(Gradient(2, 0))))
    thread.start()
    mailbox.put(Gradient(1, 0), 'other')
    mailbox.put(Gradient(2, 0), 'this')
    thread.join(timeout=10)
    assert got == ['this'] and mailbox.take(Gradient(1, 0)) == 'other'


def test_stop_ends_every_wait_now_and_later() -> None:
    mailbox = Mailbox()
    outcome: List[BaseException] = []

    def wait() -> None:
        try:
            mailbox.take(Activation(0, 1))
        except Stopped as exc:
            outcome.append(exc)

    thread = threading.Thread(target=wait)
    thread.start()
    mailbox.stop()
    thread.join(timeout=10)
    assert not thread.is_alive() and len(outcome) == 1 and mailbox.stopped
    with pytest.raises(Stopped):
        mailbox.take(Activation(1, 1))

"""Fork, Join and the phony tensor."""
from typing import Set

import torch

from torchgpipe.foundation.dependency import fork, join
from torchgpipe.foundation.phony import get_phony


def test_phony_is_empty_and_cached() -> None:
    a = get_phony(torch.device('cpu'), requires_grad=False)
    assert a.numel() == 0 and not a.requires_grad
    assert get_phony(torch.device('cpu'), requires_grad=False) is a
    b = get_phony(torch.device('cpu'), requires_grad=True)
    assert b.requires_grad and b is not a


def reachable(node: object) -> Set[object]:
    """Every autograd node reachable from ``node`` in the backward graph."""
    seen: Set[object] = set()
    stack = [node]
    while stack:
        current = stack.pop()
        if current is None or current in seen:
            continue
        seen.add(current)
        stack.extend(next_node for next_node, _ in current.next_functions)  # type: ignore
    return seen


def test_join_links_the_fork_into_the_backward_graph() -> None:
    """The backward of the joined tensor leads to the fork: its backward waits for it.

    (tests/engine/test_order.py shows the effect on a pipeline's backward order.)
    """
    a = torch.ones(1, requires_grad=True) * 1
    b = torch.ones(1, requires_grad=True) * 1
    a2, phony = fork(a)
    b2 = join(b, phony)
    assert type(a2.grad_fn).__name__ == 'ForkBackward'
    assert a2.grad_fn in reachable(b2.grad_fn)
    assert b2.grad_fn not in reachable(a2.grad_fn)
    # Without the join, b's backward never meets a's.
    assert a2.grad_fn not in reachable((b * 1).grad_fn)


def test_fork_join_pass_values_and_gradients() -> None:
    x = torch.randn(3, requires_grad=True)
    y, phony = fork(x)
    assert phony.numel() == 0 and phony.requires_grad
    z = join(y * 2, phony)
    torch.testing.assert_close(z, x * 2)
    z.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_no_graph_without_grad() -> None:
    x = torch.randn(3)
    y, phony = fork(x)
    assert y is x and not phony.requires_grad
    assert join(x, phony) is x
    with torch.no_grad():
        x = torch.randn(3, requires_grad=True)
        y, phony = fork(x)
        assert y is x and join(y, phony) is y

"""Nested jagged tensors (issue 17.2): torch's compiled autograd refuses them; subclass_ca says so clearly.

torch 2.13-2.15's C++ compiled-autograd graph walk raises ``NotImplementedError: NestedTensor
support not implemented`` for an NJT backward, before any node runs (stock refuses the same
way).  Inside ``enable()`` that becomes an ``UnsupportedSubclassError`` naming NJT and the way
out, with no gradient produced; outside the block (eager backward) NJT trains == eager.
"""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from subclass_ca import _compat


def _problem():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    rows = [torch.randn(n, 4) for n in (2, 3, 5)]

    def loss_fn(nested: torch.Tensor) -> torch.Tensor:
        return (nested @ weight).sin().values().sum()

    return weight, rows, loss_fn


def _njt(rows):
    return torch.nested.nested_tensor(rows, layout=torch.jagged)


def test_nested_jagged_backward_inside_enable_raises_a_clear_error_before_any_gradient():
    weight, rows, loss_fn = _problem()
    loss = torch.compile(loss_fn, backend="aot_eager")(_njt(rows))
    with pytest.raises(subclass_ca.UnsupportedSubclassError, match=r"nested jagged tensors \(NJT") as info:
        with subclass_ca.enable():
            loss.backward()
    assert isinstance(info.value.__cause__, NotImplementedError)
    assert "outside subclass_ca.enable()" in str(info.value)
    assert weight.grad is None


def test_stock_compiled_autograd_refuses_nested_jagged_the_same_way():
    weight, rows, loss_fn = _problem()
    loss = torch.compile(loss_fn, backend="aot_eager")(_njt(rows))
    with pytest.raises(NotImplementedError, match="NestedTensor support not implemented"):
        with _compat.enable_compiled_autograd(_compat.stock_ca_compiler("aot_eager")):
            loss.backward()
    assert weight.grad is None


def test_nested_jagged_with_compiled_forward_and_eager_backward_matches_eager():
    weight, rows, loss_fn = _problem()
    loss_fn(_njt(rows)).backward()
    want, weight.grad = weight.grad, None
    torch.compile(loss_fn, backend="aot_eager")(_njt(rows)).backward()
    torch.testing.assert_close(weight.grad, want)

"""Regression: scenario ``warmup_recompiles`` — 5 steps with the same shapes: exactly one compiled-autograd capture."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_warmup_recompiles_matches_eager(name):
    check_zoo_scenario("warmup_recompiles", name)


def test_five_same_shape_steps_capture_once_by_torch_counters():
    """The torch counter itself stays at 1 capture over 5 identical steps (not just our reports)."""
    import torch

    import subclass_ca
    from subclass_ca.testing.subclasses import make_pair

    counters = torch._dynamo.utils.counters
    w = make_pair(torch.randn(4, 4)).requires_grad_()
    x = make_pair(torch.randn(3, 4))
    step = torch.compile(lambda x, w: torch.tanh(x @ w), backend="aot_eager")
    for _ in range(5):
        out = step(x, w)
        with subclass_ca.enable("aot_eager"):
            out.backward(make_pair(torch.ones(3, 4)))
        w.grad = None
    assert counters["compiled_autograd"]["captures"] == 1

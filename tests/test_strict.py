"""strict=True: every rebuilt subclass is checked against the metadata recorded at capture."""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from subclass_ca.testing.subclasses import PairTensor, make_pair
from tests.helpers import assert_same_grad


class Drift:
    """Makes a rebuild drift from capture-time behaviour once switched on (simulates a handler bug)."""

    on = False


def drifting_rebuild(inner, ctx, outer_size, outer_stride):
    a, b = inner["a"], inner["b"]
    if Drift.on:
        a, b = a.double(), b.double()
    return PairTensor(a, b, outer_size, outer_stride)


@pytest.fixture
def drifting_opaque_handler():
    subclass_ca.register_handler(PairTensor, rebuild=drifting_rebuild, mode="opaque")
    yield
    subclass_ca.unregister_handler(PairTensor)
    Drift.on = False


def _steps(strict, n_steps):
    torch.manual_seed(0)
    w = torch.nn.Parameter(make_pair(torch.randn(5, 5)))
    step = torch.compile(lambda x: (x @ w).sum(), backend="aot_eager")
    x = torch.randn(3, 5)
    with subclass_ca.enable(strict=strict):
        for i in range(n_steps):
            Drift.on = i > 0  # capture on step 0 is clean; the rebuild drifts afterwards
            w.grad = None
            step(x).backward()
    return w


def test_strict_mode_catches_a_rebuild_that_drifts_after_capture(drifting_opaque_handler):
    with pytest.raises(subclass_ca.MetadataMismatchError, match=r"PairTensor whose dtype torch.float64 != expected torch.float32"):
        _steps(strict=True, n_steps=2)


def test_strict_mode_passes_and_matches_eager_on_a_correct_handler():
    torch.manual_seed(0)
    dense, x = torch.randn(5, 5), torch.randn(3, 5)
    eager_w = torch.nn.Parameter(make_pair(dense))
    (x @ eager_w).tanh().sum().backward()
    ca_w = torch.nn.Parameter(make_pair(dense))
    loss = torch.compile(lambda x: (x @ ca_w).tanh().sum(), backend="aot_eager")(x)
    with subclass_ca.enable(strict=True):
        loss.backward()
    assert_same_grad(eager_w.grad, ca_w.grad)


def test_strict_mode_is_off_by_default():
    assert subclass_ca.enable().config.strict is False

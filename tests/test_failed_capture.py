"""A failed capture leaves the process usable (issue 21.1, Note [Failed captures and the verbose logger]).

torch 2.13 leaves a cache node without a compiled graph behind a failed capture; with compiled
autograd's C++ verbose logger installed the next backward of that graph then fails with
``!vlogger.has_value() || compile_reason.has_value() INTERNAL ASSERT FAILED`` until the cache is cleared.
"""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from subclass_ca.testing.subclasses import PairTensor, make_pair


def _fixed_step():
    g = torch.Generator().manual_seed(0)
    w = torch.nn.Parameter(make_pair(torch.randn(4, 4, generator=g)))
    x = torch.randn(3, 4, generator=g)
    eager = torch.nn.Parameter(make_pair(w.a.detach().clone()))
    (x @ eager).sin().sum().backward()
    return w, x, eager.grad, torch.compile(lambda x, w: (x @ w).sin().sum(), backend="aot_eager")


def _assert_pair_equal(got, want):
    assert type(got) is PairTensor
    torch.testing.assert_close(got.a, want.a, atol=0, rtol=0)
    torch.testing.assert_close(got.b, want.b, atol=0, rtol=0)


@pytest.mark.parametrize("report", [False, True], ids=["default", "report"])
def test_refused_double_backward_can_be_retried(report: bool):
    w, x, want, step = _fixed_step()
    with subclass_ca.enable(report=report):
        for _ in range(2):  # the retry gets torch's refusal again, not an internal assert
            with pytest.raises(RuntimeError, match="higher order gradients"):
                step(x, w).backward(create_graph=True)
        w.grad = None
        step(x, w).backward()
    _assert_pair_equal(w.grad, want)


@pytest.mark.parametrize("report", [False, True], ids=["default", "report"])
def test_rebuild_error_then_fixed_handler_recaptures_without_reset(report: bool):
    w, x, want, step = _fixed_step()

    def broken(inner, ctx, size, stride):
        raise ValueError("handler bug")

    subclass_ca.register_handler(PairTensor, rebuild=broken)
    try:
        with subclass_ca.enable(report=report):
            for _ in range(2):
                with pytest.raises(subclass_ca.RebuildError, match="handler bug"):
                    step(x, w).backward()
            subclass_ca.register_handler(PairTensor, replace=True)  # the fix: the protocol rebuild
            w.grad = None
            step(x, w).backward()
    finally:
        subclass_ca.unregister_handler(PairTensor)
    _assert_pair_equal(w.grad, want)
    if report:
        assert subclass_ca.last_report().miss_reasons


def test_failure_without_reasons_then_a_report_block():
    """A dangling node from a default block must not trip the logger a later report block installs."""
    w, x, want, step = _fixed_step()
    subclass_ca.register_handler(PairTensor, rebuild=lambda inner, ctx, size, stride: 1 / 0)
    try:
        with subclass_ca.enable(), pytest.raises(subclass_ca.RebuildError):
            step(x, w).backward()
        subclass_ca.register_handler(PairTensor, replace=True)
        with subclass_ca.enable(report=True):
            step(x, w).backward()
    finally:
        subclass_ca.unregister_handler(PairTensor)
    _assert_pair_equal(w.grad, want)
    assert subclass_ca.last_report().miss_reasons

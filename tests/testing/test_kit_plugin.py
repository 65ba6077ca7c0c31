"""The pytest plugin (pytest11 entry point): ca_backend, assert_ca_matches_eager, ca_check_subclass."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from subclass_ca.testing.subclasses import make_int8, make_pair, make_tagged

from .kit_broken import make_scale_dropping


def test_ca_backend_defaults_to_aot_eager(ca_backend):
    assert ca_backend == "aot_eager"


def test_assert_ca_matches_eager_passes_on_a_pair_weight(assert_ca_matches_eager):
    w = make_pair(torch.randn(4, 4)).requires_grad_()
    x = torch.randn(3, 4)
    results = assert_ca_matches_eager(lambda x, w: torch.tanh(x @ w).sum(), x, w)
    assert "inputs[1].grad" in results["ca"] and "inputs[0].grad" not in results["ca"]


def test_assert_ca_matches_eager_with_a_subclass_tangent(assert_ca_matches_eager):
    w = make_tagged(torch.randn(4, 4)).requires_grad_()
    x = make_tagged(torch.randn(3, 4)).requires_grad_()
    assert_ca_matches_eager(lambda x, w: x @ w, x, w, gradient=make_tagged(torch.ones(3, 4)))


def test_assert_ca_matches_eager_restores_the_callers_grads(assert_ca_matches_eager):
    w = make_int8(torch.randn(4, 4)).requires_grad_()
    assert_ca_matches_eager(lambda w: (w * 2.0).sum(), w)
    assert w.grad is None


def test_assert_ca_matches_eager_fails_on_a_broken_subclass_naming_the_value(assert_ca_matches_eager):
    torch.manual_seed(0)
    w = make_scale_dropping(torch.randn(4, 4)).requires_grad_()
    x = make_scale_dropping(torch.randn(3, 4))
    with pytest.raises(AssertionError, match=r"(?s)subclass_ca \[aot_eager\] differs from eager for .*<lambda>:\n.*- out\.data_int8: values differ"):
        assert_ca_matches_eager(lambda x, w: x @ w, x, w, gradient=make_scale_dropping(torch.ones(3, 4)))


def test_ca_check_subclass_fixture_uses_the_ca_backend(ca_check_subclass, ca_backend):
    report = ca_check_subclass(make_pair, scenarios=["param_grad"])
    assert [(r.backend, r.status) for r in report] == [(ca_backend, "pass")]


def test_ca_backend_option_selects_the_backend(tmp_path):
    """``--ca-backend`` reaches the fixture (a pytest run in a subprocess, plugin via its entry point)."""
    (tmp_path / "test_option.py").write_text(textwrap.dedent("""
        def test_backend(ca_backend):
            assert ca_backend == "eager"
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--ca-backend=eager", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout

"""The pytest plugin (pytest11 entry point): ca_backend, assert_ca_matches_eager, ca_check_subclass.

The entry point is the top-level module ``_subclass_ca_pytestplugin``, which imports neither torch nor
subclass_ca until a test requests a fixture (Note [A plugin that costs nothing until used]): the
tests below that say so run in fresh processes, since this one has imported both.
"""

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


def _pytest_in(tmp_path, source: str, *options: str) -> subprocess.CompletedProcess:
    """pytest in a fresh process on one test file, in a folder of its own (its own rootdir: no conftest, no
    pyproject of this checkout), with the plugin loaded through its entry point as in a user's project."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_user.py").write_text(textwrap.dedent(source))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *options, "test_user.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )


def test_loading_the_entry_point_imports_neither_torch_nor_subclass_ca(tmp_path):
    code = textwrap.dedent("""
        import sys
        from importlib.metadata import entry_points

        (entry,) = [e for e in entry_points(group="pytest11") if e.name == "subclass_ca"]
        plugin = entry.load()
        assert entry.value == "_subclass_ca_pytestplugin", entry.value
        assert {"ca_backend", "assert_ca_matches_eager", "ca_check_subclass", "pytest_addoption"} <= set(vars(plugin))
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "subclass_ca"))
        sys.exit(f"loading the pytest11 entry point imported {heavy[:10]}" if heavy else 0)
    """)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_run_whose_tests_use_no_fixture_imports_neither_torch_nor_subclass_ca(tmp_path):
    run = _pytest_in(tmp_path, """
        import sys

        def test_plain(request):
            assert request.config.pluginmanager.has_plugin("subclass_ca")
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "subclass_ca"))
            assert not heavy, heavy[:10]
    """)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "1 passed" in run.stdout


def test_every_fixture_and_the_option_work_through_the_entry_point(tmp_path):
    """``--ca-backend`` reaches the fixtures, and each fixture imports subclass_ca when requested (a fresh run)."""
    run = _pytest_in(tmp_path, """
        import sys

        def test_1_backend_alone_imports_nothing(ca_backend):
            assert ca_backend == "eager"
            assert "subclass_ca" not in sys.modules and "torch" not in sys.modules

        def test_2_assert_ca_matches_eager(assert_ca_matches_eager):
            import torch
            from subclass_ca.testing.subclasses import make_pair

            w = make_pair(torch.randn(4, 4)).requires_grad_()
            results = assert_ca_matches_eager(lambda x, w: (x @ w).sum(), torch.randn(3, 4), w)
            assert "inputs[1].grad" in results["ca"]

        def test_3_ca_check_subclass(ca_check_subclass):
            from subclass_ca.testing.subclasses import make_pair

            report = ca_check_subclass(make_pair, scenarios=["param_grad"])
            assert [(r.backend, r.status) for r in report] == [("eager", "pass")]
    """, "--ca-backend=eager")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 passed" in run.stdout


def test_the_plugins_options_and_markers_are_registered(tmp_path):
    run = _pytest_in(tmp_path, "def test_nothing():\n    pass\n", "--help")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "--ca-backend=CA_BACKEND" in run.stdout
    markers = _pytest_in(tmp_path, "def test_nothing():\n    pass\n", "--markers")
    assert "@pytest.mark.inductor:" in markers.stdout and "@pytest.mark.cuda:" in markers.stdout

"""activate()/deactivate() reproduce torch's compiled_autograd._enable exactly, or defer to it.

Note [Entering compiled autograd without a generator] in ``_compat/compiled_autograd.py``.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca.testing.subclasses import PairTensor, make_pair


def _state() -> dict:
    compiler, dynamic = _compat.autograd_compiler()
    return {
        "flags": _compat.compiled_autograd_state(),
        "compiler": (getattr(compiler, "func", compiler), getattr(compiler, "args", None), dynamic),
        "multithreading": torch._C._is_multithreading_enabled(),
        "verbose_logger": _compat.ca_verbose_log(),
    }


def _compiler_fn(gm):
    return gm


def _stock_enable():
    enable = _compat.lookup(_compat.CA_MODULE + ":_enable")
    return getattr(enable, "__subclass_ca_original__", enable)


def test_this_torch_has_an_enable_we_reproduce():
    assert _compat.fast_activation_supported(), (
        f"torch {torch.__version__}: compiled_autograd._enable changed; read it, then add its fingerprint to "
        "KNOWN_ENABLE_SOURCES if activate() still reproduces it"
    )


@pytest.mark.parametrize("dynamic", [True, False])
def test_activation_leaves_the_same_state_as_torch_enable_inside_and_after(dynamic):
    before = _state()
    with _stock_enable()(_compiler_fn, dynamic=dynamic):
        stock_inside = _state()
    assert _state() == before
    activation = _compat.activate(_compiler_fn, _compat.compiler_factory(_compiler_fn), dynamic=dynamic)
    assert activation.torch_context is None, "the fast path was not taken"
    ours_inside = _state()
    assert _compat.deactivate(activation, (None, None, None)) is False
    assert ours_inside == stock_inside
    assert _state() == before


def test_activation_nests_with_torch_enable_both_ways():
    before = _state()
    with _stock_enable()(_compiler_fn):
        outer = _state()
        activation = _compat.activate(_compiler_fn, _compat.compiler_factory(_compiler_fn), dynamic=True)
        _compat.deactivate(activation, (None, None, None))
        assert _state() == outer
    activation = _compat.activate(_compiler_fn, _compat.compiler_factory(_compiler_fn), dynamic=True)
    outer = _state()
    with _stock_enable()(_compiler_fn):
        pass
    assert _state() == outer
    _compat.deactivate(activation, (None, None, None))
    assert _state() == before


def test_unbalanced_depth_raises_like_torch():
    ca = _compat.lookup(_compat.CA_MODULE)
    activation = _compat.activate(_compiler_fn, _compat.compiler_factory(_compiler_fn), dynamic=True)
    ca.depth += 1
    try:
        with pytest.raises(AssertionError, match="Nested Compiled Autograd Contexts"):
            _compat.deactivate(activation, (None, None, None))
    finally:
        ca.depth -= 1
    assert ca.depth == 0


def test_an_enable_we_have_not_read_goes_through_torch(monkeypatch):
    """A torch whose _enable differs: enable() still trains, through torch's own context manager."""
    stock = _stock_enable()
    entered = []

    @contextlib.contextmanager
    def changed_enable(compiler_fn, dynamic=True, ignore_active_disable_ctx=True):
        entered.append(compiler_fn)
        with stock(compiler_fn, dynamic=dynamic, ignore_active_disable_ctx=ignore_active_disable_ctx):
            yield

    subclass_ca.reset()  # swap torch's attribute while nothing of ours wraps it
    monkeypatch.setattr(_compat.lookup(_compat.CA_MODULE), "_enable", changed_enable)
    assert not _compat.fast_activation_supported()
    torch.manual_seed(0)
    weight = torch.nn.Parameter(make_pair(torch.randn(4, 4)))
    step = torch.compile(lambda x: (x @ weight).tanh().sum(), backend="aot_eager")
    before = _state()
    with subclass_ca.enable():
        step(torch.randn(2, 4)).backward()
    assert entered, "torch's own _enable was not used"
    assert isinstance(weight.grad, PairTensor)
    assert _state() == before
    subclass_ca.reset()  # our gate wraps the stand-in: restore it before monkeypatch restores torch's


def test_force_eager_stance_goes_through_torch_and_runs_eagerly():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(make_pair(torch.randn(4, 4)))
    x = torch.randn(2, 4)
    captures = _compat.ca_counters().get("captures", 0)
    with torch.compiler.set_stance("force_eager"):
        with subclass_ca.enable():
            assert _compat.lookup(_compat.CA_MODULE).compiled_autograd_enabled_force_eager
            (x @ weight).tanh().sum().backward()
    assert not _compat.lookup(_compat.CA_MODULE).compiled_autograd_enabled_force_eager
    assert _compat.ca_counters().get("captures", 0) == captures
    assert isinstance(weight.grad, PairTensor)

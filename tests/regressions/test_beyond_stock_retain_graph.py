"""Beyond stock CA, case 1: a second backward (``retain_graph=True``) on a model with a TwoTensor parameter.

Stock compiled autograd fails the *second* capture with ``AssertionError: Expected
SubclassSymbolicContext or None, got StatefulSymbolicContext``: after the first backward a
*plain* parameter (the Linear after the TwoTensor matmul) holds a TwoTensor ``.grad``, and
torch 2.13's FakeTensor conversion reuses the parameter's plain symbolic context for that
subclass grad.  ``enable()`` installs the ``_compat`` workaround (upstream fix
pytorch/pytorch#186427) only while it is active.  See docs/design.md.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from tests.helpers import assert_same_grad
from tests.regressions._models import PairThenLinear

TwoTensor = _compat.two_tensor_type()
pytestmark = pytest.mark.skipif(TwoTensor is None, reason="torch.testing._internal.two_tensor is missing")


def _inputs() -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(3))


def _stock_ca(backend: str) -> contextlib.AbstractContextManager:
    def compiler_fn(gm: torch.fx.GraphModule):
        return torch.compile(gm, backend=backend, fullgraph=True)

    return _compat.enable_compiled_autograd(compiler_fn, dynamic=True)


def _run_twice_backward(model: torch.nn.Module, backend: str | None, context: contextlib.AbstractContextManager):
    forward = torch.compile(model, backend=backend) if backend else model
    loss = forward(_inputs())
    with context:
        loss.backward(retain_graph=True)
        first = {name: p.grad.clone() for name, p in model.named_parameters()}
        loss.backward()
    return first, {name: p.grad for name, p in model.named_parameters()}


def _run_grad_twice(model: torch.nn.Module, backend: str | None, context: contextlib.AbstractContextManager):
    forward = torch.compile(model, backend=backend) if backend else model
    params = list(model.parameters())
    loss = forward(_inputs())
    with context:
        first = torch.autograd.grad(loss, params, retain_graph=True)
        second = torch.autograd.grad(loss, params)
    return first, second


def test_second_backward_with_retain_graph_matches_eager(backend):
    eager_first, eager_second = _run_twice_backward(PairThenLinear(), None, contextlib.nullcontext())
    assert type(eager_second["lin.weight"]) is TwoTensor  # the situation this case is about
    first, second = _run_twice_backward(PairThenLinear(), backend, subclass_ca.enable(backend=backend))
    exact = backend == "aot_eager"
    for name in eager_second:
        assert_same_grad(eager_first[name], first[name], exact=exact)
        assert_same_grad(eager_second[name], second[name], exact=exact)
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] == 2


def test_autograd_grad_twice_matches_eager(backend):
    eager_first, eager_second = _run_grad_twice(PairThenLinear(), None, contextlib.nullcontext())
    first, second = _run_grad_twice(PairThenLinear(), backend, subclass_ca.enable(backend=backend))
    exact = backend == "aot_eager"
    for want, got in zip((*eager_first, *eager_second), (*first, *second)):
        assert_same_grad(want, got, exact=exact)


def test_grad_accumulation_across_steps_matches_eager():
    """Same root cause without retain_graph: step 2 fakeifies plain params holding TwoTensor grads."""

    def train(model: torch.nn.Module, backend: str | None, context_factory) -> dict[str, torch.Tensor]:
        forward = torch.compile(model, backend=backend) if backend else model
        for _ in range(3):
            loss = forward(_inputs())
            with context_factory():
                loss.backward()
        return {name: p.grad for name, p in model.named_parameters()}

    eager = train(PairThenLinear(), None, contextlib.nullcontext)
    ours = train(PairThenLinear(), "aot_eager", lambda: subclass_ca.enable(backend="aot_eager"))
    for name in eager:
        assert_same_grad(eager[name], ours[name])


def test_stock_compiled_autograd_fails_exactly_where_the_workaround_applies():
    """The probe in _compat agrees with torch: stock CA fails iff the workaround is needed."""
    needed = _compat.needed_workarounds()
    model = PairThenLinear()
    if needed:
        with pytest.raises(Exception, match="|".join(f"(?:{w.stock_error})" for w in needed)):
            _run_twice_backward(model, "aot_eager", _stock_ca("aot_eager"))
    else:
        _run_twice_backward(model, "aot_eager", _stock_ca("aot_eager"))


def test_workaround_is_scoped_to_ca_graph_runs_not_to_the_enable_block():
    """Note [Workaround scopes]: entering enable() alone changes nothing in meta_utils."""
    meta_utils = pytest.importorskip("torch._subclasses.meta_utils")
    original = meta_utils._grad_context_compatible
    workaround = _compat.workarounds.GRAD_CONTEXT
    with subclass_ca.enable():
        assert meta_utils._grad_context_compatible is original
        with subclass_ca.enable():
            assert meta_utils._grad_context_compatible is original
    assert meta_utils._grad_context_compatible is original
    with pytest.raises(RuntimeError, match="boom"), subclass_ca.enable():
        raise RuntimeError("boom")
    assert meta_utils._grad_context_compatible is original
    assert workaround.patches.holders == 0
    if workaround.needed:
        with workaround.patches.applied():
            assert meta_utils._grad_context_compatible is not original
        assert meta_utils._grad_context_compatible is original
    converter = meta_utils.MetaConverter
    meta_tensor = converter.__dict__["meta_tensor"]
    with subclass_ca.enable():
        assert converter.__dict__["meta_tensor"] is meta_tensor
    for each in _compat.needed_workarounds():
        with each.patches.applied():
            assert each.patches.installed()
        assert not each.patches.installed()
    assert converter.__dict__["meta_tensor"] is meta_tensor

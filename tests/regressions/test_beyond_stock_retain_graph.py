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
    # the workarounds for a subclass .grad on a plain tensor (the grad-dtype one has its own, tests/test_accumulate.py)
    about_this = (_compat.workarounds.GRAD_CONTEXT, _compat.workarounds.GRAD_STATIC_CONTEXT)
    needed = [w for w in _compat.needed_workarounds() if w in about_this]
    model = PairThenLinear()
    if needed:
        with pytest.raises(Exception, match="|".join(f"(?:{w.stock_error})" for w in needed)):
            _run_twice_backward(model, "aot_eager", _stock_ca("aot_eager"))
    else:
        _run_twice_backward(model, "aot_eager", _stock_ca("aot_eager"))


def test_workaround_is_scoped_to_ca_graph_runs_not_to_the_enable_block():
    """Note [Workaround scopes]: a workaround acts only while our CA graph runs, never in the block around it."""
    meta_utils = pytest.importorskip("torch._subclasses.meta_utils")
    needed = _compat.needed_workarounds()
    for each in needed:
        each.patches.install()
        for swap, _original, _replacement in each.patches._saved:  # every installed value is gated by its scope
            assert swap.read().__subclass_ca_gate__ is _compat.workarounds.SCOPES[each.scope], swap.describe()
    workarounds = _compat.workarounds
    if hasattr(meta_utils, "_grad_context_compatible"):  # the check torch 2.13 on has (its bug: GRAD_CONTEXT)
        probe = lambda: workarounds._probe_grad_context_bug(meta_utils._grad_context_compatible)  # noqa: E731
        buggy = workarounds.GRAD_CONTEXT in needed
    else:  # up to torch 2.12: no check, the .grad recycles its parent's context (fixed by GRAD_STATIC_CONTEXT)
        probe = lambda: workarounds._probe_grad_context_recycled(None)  # noqa: E731
        buggy = workarounds.GRAD_STATIC_CONTEXT in needed
    with subclass_ca.enable():
        with subclass_ca.enable():
            # inside the blocks but outside a CA graph run: torch's own (buggy up to 2.13) behaviour
            assert probe() is buggy
            if hasattr(meta_utils, "_grad_context_compatible"):
                assert _compat.torch_state_snapshot()["grad_context_compatible"] is getattr(
                    meta_utils._grad_context_compatible, "__subclass_ca_original__", meta_utils._grad_context_compatible)
        _compat.CA_GRAPH_RUN.enter()
        try:
            assert probe() is False  # fixed (or never broken) during a run
        finally:
            _compat.CA_GRAPH_RUN.exit()
    assert probe() is buggy
    with pytest.raises(RuntimeError, match="boom"), subclass_ca.enable():
        raise RuntimeError("boom")
    assert _compat.CA_GRAPH_RUN.depth == 0 and _compat.BLOCKS.depth == 0

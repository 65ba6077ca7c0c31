"""Note [AOT backwards in their cached form]: the backward compiled autograd pastes is the one a cache hit gives."""

from __future__ import annotations

import re

import torch

import subclass_ca
from subclass_ca._compat import aot_autograd


def _clamped_step(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = x @ weight
    return torch.where(y > 0, y, 0.0).sum()  # its backward: where(gt, grad, full([], 0.0))


def _grads(step, context) -> tuple[torch.Tensor, str | None]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 8))
    loss = step(weight, torch.randn(4, 8))
    with context:
        loss.backward()
    report = subclass_ca.last_report()
    return weight.grad, report.graph_code if report else None


def test_a_fresh_backward_is_pasted_as_a_cache_hit_would_give_it_with_eagers_gradients():
    eager, _ = _grads(_clamped_step, torch.enable_grad())
    compiled = torch.compile(_clamped_step, backend="aot_eager")
    ours, code = _grads(compiled, subclass_ca.enable())
    # the round trip's marks: a constant for the call without tensor inputs, overload-named nodes
    assert "_tensor_constant" in code and "aten.full" not in code and re.search(r"aot\d+_where_self", code)
    torch.testing.assert_close(ours, eager, atol=0, rtol=0)


def test_the_round_trip_is_what_torch_stores_and_reloads():
    traced = torch.fx.symbolic_trace(lambda x: torch.where(x > 0, x, torch.zeros(())))
    graph = traced.graph
    stored = aot_autograd.as_cache_stores(traced)
    assert stored is not traced and traced.graph is graph
    x = torch.randn(5)
    torch.testing.assert_close(stored(x), traced(x), atol=0, rtol=0)
    again = aot_autograd.as_cache_stores(stored)
    assert again.code == stored.code  # idempotent: a cached backward is left in its form


def _graph_of(body) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(body(graph, x))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_random_draws_and_buffers_written_in_place_are_never_frozen_into_constants():
    aten = torch.ops.aten
    pure = _graph_of(lambda g, x: g.call_function(aten.add.Tensor, (x, g.call_function(aten.full.default, ([], 0.0)))))
    drawn = _graph_of(lambda g, x: g.call_function(aten.add.Tensor, (x, g.call_function(aten.rand.default, ([4],)))))
    written = _graph_of(lambda g, x: g.call_function(aten.add_.Tensor, (g.call_function(aten.zeros.default, ([4],)), x)))
    returned = _graph_of(lambda g, x: (x, g.call_function(aten.zeros.default, ([4],))))
    assert aot_autograd._round_trip_keeps_values(pure)
    assert not aot_autograd._round_trip_keeps_values(drawn)
    assert not aot_autograd._round_trip_keeps_values(written)
    assert not aot_autograd._round_trip_keeps_values(returned)  # a returned constant could become a stolen .grad


class _NoisyGrad(torch.autograd.Function):
    """A custom backward drawing fresh noise with a constant shape (stochastic-rounding style)."""

    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        return grad + torch.rand(8) * 1e-3


def test_a_backward_drawing_random_numbers_draws_new_ones_every_step():
    weight = torch.nn.Parameter(torch.zeros(8))
    step = torch.compile(lambda w: _NoisyGrad.apply(w).sum(), backend="aot_eager")
    grads = []
    for _ in range(2):
        weight.grad = None
        loss = step(weight)
        with subclass_ca.enable():
            loss.backward()
        grads.append(weight.grad.clone())
    code = subclass_ca.last_report().graph_code
    assert "rand" in code and not torch.equal(grads[0], grads[1])


def test_the_swap_acts_only_while_one_of_our_proxies_pastes():
    import importlib

    module = importlib.import_module(aot_autograd.BW_MODULE_EXTRACTION.split(":")[0])
    original = module.extract_bw_module
    with aot_autograd.CACHED_FORM_BACKWARDS.applied():
        assert module.extract_bw_module is not original
    assert module.extract_bw_module is original


def test_a_backward_the_round_trip_cannot_rebuild_is_pasted_as_traced():
    def local_scale(x):  # a local function: torch's cache cannot store a graph calling it either
        return x * 2.0

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(local_scale, (x,)))
    traced = torch.fx.GraphModule(torch.nn.Module(), graph)
    assert aot_autograd._cached_form(traced) is traced

"""canonical_form: the CA graph of a cached forward's backward is the fresh forward's (Note [One CA graph for fresh and cached forwards])."""

from __future__ import annotations

import operator
import re
import threading

import torch

import subclass_ca
from subclass_ca._canonical import canonical_form

aten = torch.ops.aten


def _prologue(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return values[0], values[1]


def _ca_like_graph(*, cached: bool) -> torch.fx.GraphModule:
    """One backward pasted into a CA-like graph, as traced (``cached=False``) or as torch's cache rebuilds it."""
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    inputs = graph.placeholder("inputs")
    prologue = graph.call_function(_prologue, (inputs,), name="call_aot_bwd_prologue")
    saved = graph.call_function(operator.getitem, (prologue, 0), name="aot0_mm_2")
    tangent = graph.call_function(operator.getitem, (prologue, 1), name="aot0_tangents_1")
    names = ["aot0_mul_tensor", "aot0_where_self", "aot0_mul_tensor_1"] if cached else ["aot0_mul", "aot0_where", "aot0_mul_1"]
    if cached:  # one get_attr per use of the constant the rebuild's trace made
        root._tensor_constant3 = torch.zeros(())
        zero = graph.get_attr("_tensor_constant3", )
        zero.name = "aot0__tensor_constant3"
    else:
        zero = graph.call_function(aten.full.default, ([], 0.0), {"dtype": torch.float32}, name="aot0_full")
    mul = graph.call_function(aten.mul.Tensor, (saved, tangent), name=names[0])
    where = graph.call_function(aten.where.self, (aten_gt(graph, mul), mul, zero), name=names[1])
    if cached:
        zero = graph.get_attr("_tensor_constant3")
        zero.name = "aot0__tensor_constant3_1"
    again = graph.call_function(aten.mul.Tensor, (where, zero), name=names[2])
    own = graph.call_function(aten.add.Tensor, (again, mul), name="make_pair_tensor")
    graph.output((own,))
    return torch.fx.GraphModule(root, graph)


def aten_gt(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Node:
    return graph.call_function(aten.gt.Scalar, (node, 0.0), name=node.name.replace("mul", "gt"))


def test_a_traced_and_a_cache_rebuilt_backward_give_one_graph_code_and_the_same_values():
    traced, rebuilt = _ca_like_graph(cached=False), _ca_like_graph(cached=True)
    assert traced.code != rebuilt.code
    values = [torch.randn(3), torch.randn(3)]
    expected = traced(list(values))

    assert canonical_form(traced) and canonical_form(rebuilt)

    assert traced.code == rebuilt.code
    for module in (traced, rebuilt):
        torch.testing.assert_close(module(list(values)), expected, atol=0, rtol=0)
    names = [node.name for node in traced.graph.nodes]
    assert names[:4] == ["inputs", "call_aot_bwd_prologue", "aot0_mm_2", "aot0_tangents_1"]  # the pasted graph's inputs keep theirs
    assert "aot0_constant0" in names and names.count("aot0_constant0") == 1  # one read, before its first use
    assert "make_pair_tensor" in names  # not pasted: ours
    assert not hasattr(rebuilt, "_tensor_constant3")


def test_a_graph_already_canonical_or_without_pasted_nodes_is_left_as_it_is():
    canonical = _ca_like_graph(cached=False)
    canonical_form(canonical)
    graph = canonical.graph
    assert not canonical_form(canonical) and canonical.graph is graph

    plain = torch.fx.symbolic_trace(lambda x: (x * 2).sum())
    code = plain.code
    assert not canonical_form(plain) and plain.code == code


def _pasted(body) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(body(graph, x))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_random_draws_and_buffers_written_in_place_or_returned_stay_calls():
    drawn = _pasted(lambda g, x: g.call_function(aten.add.Tensor, (x, g.call_function(aten.rand.default, ([4],), name="aot0_rand"))))
    written = _pasted(lambda g, x: g.call_function(aten.add_.Tensor, (g.call_function(aten.zeros.default, ([4],), name="aot0_zeros"), x)))
    returned = _pasted(lambda g, x: (x, g.call_function(aten.zeros.default, ([4],), name="aot0_zeros")))
    for module in (drawn, written, returned):
        canonical_form(module)
        assert "aten.rand" in module.code or "aten.zeros" in module.code
        assert "constant" not in module.code


def _clamped_step(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    y = x @ weight
    return torch.where(y > 0, y, 0.0).sum()  # its backward: where(gt, grad, full([], 0.0))


def test_a_real_backward_is_compiled_in_canonical_form_with_eagers_gradients():
    torch.manual_seed(0)
    weight, x = torch.nn.Parameter(torch.randn(8, 8)), torch.randn(4, 8)
    _clamped_step(weight, x).backward()
    eager = weight.grad
    weight.grad = None
    loss = torch.compile(_clamped_step, backend="aot_eager")(weight, x)
    with subclass_ca.enable():
        loss.backward()
    code = subclass_ca.last_report().graph_code
    assert re.search(r"aot\d+_constant0 = self\.aot\d+_constant0", code) and "aten.full" not in code
    torch.testing.assert_close(weight.grad, eager, atol=0, rtol=0)


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
    assert "rand" in subclass_ca.last_report().graph_code and not torch.equal(grads[0], grads[1])


def test_the_rewrite_runs_no_tracer_another_threads_compiled_calls_keep_working():
    """FX's symbolic tracer sets a process-wide flag that fails every torch.compile-d call of another thread."""
    from torch.fx import _symbolic_trace

    seen = []
    original = torch.fx.Tracer.trace

    def watched(self, *args, **kwargs):
        seen.append(threading.get_ident())
        return original(self, *args, **kwargs)

    torch.fx.Tracer.trace = watched
    try:
        canonical_form(_ca_like_graph(cached=False))
    finally:
        torch.fx.Tracer.trace = original
    assert seen == []  # so no tracing flag was set (torch 2.13's ``_is_fx_tracing_flag``; renamed later)
    assert not getattr(_symbolic_trace, "_is_fx_tracing_flag", False)

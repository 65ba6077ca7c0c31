"""canonical_names: the CA graph of a cached forward's backward is the fresh forward's, name for name."""

from __future__ import annotations

import operator

import torch

from subclass_ca._canonical import canonical_names

aten = torch.ops.aten


def _prologue(values: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return values[0], values[1]


def _ca_like_graph(pasted_names: list[str]) -> torch.fx.GraphModule:
    """A CA graph's shape: a prologue, its slots as the pasted graph's inputs, pasted aten nodes, our own node."""
    graph = torch.fx.Graph()
    inputs = graph.placeholder("inputs")
    prologue = graph.call_function(_prologue, (inputs,))
    prologue.name = "call_aot_bwd_prologue"
    saved = graph.call_function(operator.getitem, (prologue, 0), name="aot0_mm_2")
    tangent = graph.call_function(operator.getitem, (prologue, 1), name="aot0_tangents_1")
    mul = graph.call_function(aten.mul.Tensor, (saved, tangent), name=pasted_names[0])
    mul_again = graph.call_function(aten.mul.Tensor, (mul, mul), name=pasted_names[1])
    pair = graph.call_function(torch.stack, ([mul, mul_again],), name="aot0_stack_default")
    first = graph.call_function(operator.getitem, (pair, 0), name=pasted_names[2])
    own = graph.call_function(aten.add.Tensor, (first, mul_again), name="make_pair_tensor")
    graph.output((own,))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def test_two_namings_of_one_backward_give_one_graph_code_and_the_same_values():
    traced = _ca_like_graph(["aot0_mul", "aot0_mul_1", "aot0_getitem_3"])
    deserialized = _ca_like_graph(["aot0_mul_tensor", "aot0_mul_tensor_1", "aot0_getitem"])
    assert traced.code != deserialized.code
    values = [torch.randn(3), torch.randn(3)]
    expected = traced(list(values))

    assert canonical_names(traced) and canonical_names(deserialized)

    assert traced.code == deserialized.code
    torch.testing.assert_close(traced(list(values)), expected, atol=0, rtol=0)
    names = [node.name for node in traced.graph.nodes]
    assert names[:4] == ["inputs", "call_aot_bwd_prologue", "aot0_mm_2", "aot0_tangents_1"]  # the pasted graph's inputs keep theirs
    assert names[4:8] == ["aot0_mul", "aot0_mul_1", "aot0_stack", "aot0_getitem"]  # operation + position
    assert "make_pair_tensor" in names  # not pasted: ours


def test_a_graph_already_canonical_or_without_pasted_nodes_is_left_as_it_is():
    canonical = _ca_like_graph(["aot0_mul", "aot0_mul_1", "aot0_getitem"])
    canonical_names(canonical)
    graph = canonical.graph
    assert not canonical_names(canonical) and canonical.graph is graph

    plain = torch.fx.symbolic_trace(lambda x: (x * 2).sum())
    code = plain.code
    assert not canonical_names(plain) and plain.code == code

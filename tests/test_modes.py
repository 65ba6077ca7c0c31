"""The three handler modes: what lands in the CA graph and in Dynamo's graph, and correct grads."""

from __future__ import annotations

import re

import pytest
import torch

import subclass_ca
from subclass_ca.testing.subclasses import PairTensor, make_pair
from tests.helpers import GraphRecorder, assert_same_grad


@pytest.fixture
def pair_mode(request):
    subclass_ca.register_handler(PairTensor, mode=request.param)
    yield request.param
    subclass_ca.unregister_handler(PairTensor)


def _run(backend, device="cpu"):
    torch.manual_seed(0)
    dense, x = torch.randn(6, 6).to(device), torch.randn(4, 6).to(device)
    eager_w = torch.nn.Parameter(make_pair(dense))
    (x @ eager_w).sin().sum().backward()
    ca_w = torch.nn.Parameter(make_pair(dense))
    loss = torch.compile(lambda x: (x @ ca_w).sin().sum(), backend="aot_eager")(x)
    with subclass_ca.enable(backend):
        loss.backward()
    return eager_w.grad, ca_w.grad


def _dynamo_code(recorder):
    return "\n".join(gm.code for gm in recorder.graphs)


def _our_callables_in(code):
    return re.findall(r"subclass_ca_(?:make|inline|opaque)_\w+", code)


@pytest.mark.parametrize("pair_mode", ["proxy"], indirect=True)
def test_proxy_mode_is_one_named_node_in_both_graphs(pair_mode):
    recorder = GraphRecorder()
    expected, actual = _run(recorder)
    assert_same_grad(expected, actual)
    report = subclass_ca.last_report()
    assert report.nodes_for("PairTensor", "proxy") == 1 and report.fullgraph
    assert "subclass_ca_make_PairTensor(" in report.graph_code
    assert len(recorder.graphs) == 1
    assert _our_callables_in(_dynamo_code(recorder)) == ["subclass_ca_make_PairTensor"]


@pytest.mark.parametrize("pair_mode", ["inline"], indirect=True)
def test_inline_mode_is_traced_through_by_dynamo(pair_mode):
    recorder = GraphRecorder()
    expected, actual = _run(recorder)
    assert_same_grad(expected, actual)
    report = subclass_ca.last_report()
    assert report.nodes_for("PairTensor", "inline") == 1 and report.fullgraph
    assert "subclass_ca_inline_PairTensor(" in report.graph_code
    assert len(recorder.graphs) == 1
    assert _our_callables_in(_dynamo_code(recorder)) == []  # Dynamo inlined the rebuild


@pytest.mark.parametrize("pair_mode", ["opaque"], indirect=True)
def test_opaque_mode_runs_eagerly_behind_a_graph_break(pair_mode):
    recorder = GraphRecorder()
    expected, actual = _run(recorder)
    assert_same_grad(expected, actual)
    report = subclass_ca.last_report()
    assert report.nodes_for("PairTensor", "opaque") == 1
    assert report.fullgraph is False
    assert "subclass_ca_opaque_PairTensor(" in report.graph_code
    assert len(recorder.graphs) >= 2  # the graph break splits the CA graph
    assert _our_callables_in(_dynamo_code(recorder)) == []  # ran eagerly, outside any graph


@pytest.mark.inductor
@pytest.mark.parametrize("pair_mode", ["proxy", "inline", "opaque"], indirect=True)
def test_every_mode_matches_eager_on_inductor(pair_mode, device):
    expected, actual = _run("inductor", device)
    assert_same_grad(expected, actual, exact=False)

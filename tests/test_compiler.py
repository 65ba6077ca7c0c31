"""Static-first CA graphs (Note [Static-first CA graphs] in ``_compiler.py``): captures, compiles, gradients."""

from __future__ import annotations

import re

import pytest
import torch
import torch._dynamo.testing

import subclass_ca
from subclass_ca import _compat
from tests.helpers import assert_same_grad

TwoTensor = _compat.two_tensor_type()
LENGTHS = (8, 9, 10, 11, 12)
"""Five sequence lengths, then one seen before."""


@pytest.fixture(autouse=True)
def no_earlier_reports():
    subclass_ca.clear_reports()


def _without_ids(graph_code: str) -> str:
    """A CA graph's code without the per-process AOT ids in its names."""
    return re.sub(r"aot\d+_", "aot_", graph_code)


def _symbolic(graph_code: str) -> bool:
    """Whether a CA graph reads sizes as inputs: compiled autograd made some of them dynamic."""
    return "sizes[" in graph_code


def _train(dynamic, *, compile_forward, backend="aot_eager", lengths=(*LENGTHS, 9)):
    """A TwoTensor MLP over a sequence of varying length; the gradients of every step.

    ``compile_forward``: False for an eager forward, else the forward's ``torch.compile`` backend.
    """
    torch.manual_seed(0)
    dense = torch.randn(16, 16)
    weight = torch.nn.Parameter(TwoTensor(dense.clone(), dense * 2.0))

    def loss_of(x):
        return torch.nn.functional.gelu(x @ weight).sum(dim=1).pow(2).sum()

    forward = torch.compile(loss_of, backend=compile_forward) if compile_forward else loss_of
    grads = []
    for length in lengths:
        x = torch.randn(2, length, 16, requires_grad=True)
        weight.grad = None
        with subclass_ca.enable(backend=backend, dynamic=dynamic):
            forward(x).backward()
        grads.append((x.grad, weight.grad))
    return grads


def test_default_is_static_first_and_recaptures_once_for_five_lengths():
    static_first = _train(None, compile_forward=False)
    reports = subclass_ca.reports()
    assert len(reports) == 2, [r.graph_code for r in reports]
    assert not _symbolic(reports[0].graph_code), "the first capture must specialise every size"
    assert _symbolic(reports[1].graph_code), "the recapture must take the changed sizes as inputs"
    assert subclass_ca.cache_stats()["captures"] == 2

    subclass_ca.reset()
    subclass_ca.clear_reports()
    all_dynamic = _train(True, compile_forward=False)  # torch's default, subclass_ca's before
    assert len(subclass_ca.reports()) == 1 and _symbolic(subclass_ca.reports()[0].graph_code)
    for (x_grad, w_grad), (x_expected, w_expected) in zip(static_first, all_dynamic, strict=True):
        assert_same_grad(x_expected, x_grad)  # bitwise on aot_eager
        assert_same_grad(w_expected, w_grad)


def test_a_compiled_forward_costs_one_capture_per_forward_graph_and_one_recapture():
    """Dynamo's own automatic dynamic gives the forward a second, dynamic graph (a new autograd structure,
    captured static first as well); its static sizes change once more, then every length hits."""
    forward_compiles = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    static_first = _train(None, compile_forward=forward_compiles)
    reports = subclass_ca.reports()
    assert forward_compiles.frame_count == 2
    assert len(reports) <= forward_compiles.frame_count + 1, [r.graph_code for r in reports]
    assert not _symbolic(reports[0].graph_code), "the first capture must specialise every size"
    assert all(r.subclass_nodes[("TwoTensor", "proxy")] >= 1 for r in reports)

    subclass_ca.reset()
    all_dynamic = _train(True, compile_forward="aot_eager")
    for (x_grad, w_grad), (x_expected, w_expected) in zip(static_first, all_dynamic, strict=True):
        assert_same_grad(x_expected, x_grad)
        assert_same_grad(w_expected, w_grad)


def test_fixed_shape_training_never_gets_a_symbolic_graph():
    _train(None, compile_forward="aot_eager", lengths=(8, 8, 8))
    (report,) = subclass_ca.reports()
    assert not _symbolic(report.graph_code)
    assert report.runs == 3

    subclass_ca.reset()
    subclass_ca.clear_reports()
    _train(False, compile_forward="aot_eager", lengths=(8, 8, 8))
    assert _without_ids(subclass_ca.reports()[0].graph_code) == _without_ids(report.graph_code)


def test_dynamic_false_compiles_one_static_graph_per_length():
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    static = _train(False, compile_forward=False, backend=counter)
    assert counter.frame_count == len(LENGTHS), "one Dynamo compile of the CA graph per distinct length"
    for graph in counter.graphs:
        assert not any(node.op == "placeholder" and isinstance(node.meta.get("example_value"), torch.SymInt)
                       for node in graph.graph.nodes), graph.code

    subclass_ca.reset()
    subclass_ca.clear_reports()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    static_first = _train(None, compile_forward=False, backend=counter)
    # static first; the recaptured graph's first run is static in the CA graph's tensor inputs too, so Dynamo's
    # automatic dynamic compiles it once more on the next length (as it does torch's all-dynamic first graph)
    assert len(subclass_ca.reports()) == 2
    assert counter.frame_count == 3
    for (x_grad, w_grad), (x_expected, w_expected) in zip(static, static_first, strict=True):
        assert_same_grad(x_expected, x_grad)
        assert_same_grad(w_expected, w_grad)


def test_settings_of_different_dynamic_never_share_a_graph():
    # the settings' cache token reaches compiled autograd's key through the AOT backward (a compiled forward)
    _train(None, compile_forward="aot_eager", lengths=(8,))
    _train(True, compile_forward="aot_eager", lengths=(8,))
    _train(False, compile_forward="aot_eager", lengths=(8,))
    assert len(subclass_ca.reports()) == 3


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"dynamic": 1}, "Config.dynamic must be None, True or False, got 1"),
        ({"dynamic": "auto"}, "Config.dynamic must be None, True or False, got 'auto'"),
        ({"compile_kwargs": {"dynamic": True}}, r"must not set \['dynamic'\]"),
    ],
)
def test_bad_dynamic_settings_are_refused_naming_the_setting(settings, message):
    with pytest.raises(ValueError, match=message):
        subclass_ca.Config(**settings)


@pytest.mark.parametrize("canonical_changes", [True, False])
def test_the_capture_generates_the_graphs_code_once_and_it_holds_the_steal(monkeypatch, canonical_changes):
    """The steal (Note [Subclass gradients and AccumulateGrad]) and the canonical form share one regeneration of the
    CA graph's code (0.1-0.2 s for 64 blocks); a canonical form that changes nothing still leaves the steal in it."""
    from subclass_ca import _compiler

    generated: list[int] = []
    real_recompile = torch.fx.GraphModule.recompile

    def counted(self: torch.fx.GraphModule):
        generated.append(len(self.graph.nodes))
        return real_recompile(self)

    if not canonical_changes:
        monkeypatch.setattr(_compiler, "canonical_form", lambda graph_module: False)
    weight = torch.nn.Parameter(TwoTensor(torch.randn(4, 4), torch.randn(4, 4)))
    eager_weight = torch.nn.Parameter(TwoTensor(weight.a.clone(), weight.b.clone()))
    x = torch.randn(3, 4)
    (x @ eager_weight).sum().backward()
    loss = torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")(x)
    monkeypatch.setattr(torch.fx.GraphModule, "recompile", counted)
    with subclass_ca.enable(backend="aot_eager"):
        loss.backward()
    report = subclass_ca.last_report()
    assert "assign_subclass_grad" in report.graph_code or "accumulate_subclass_grad" in report.graph_code
    assert generated.count(report.graph_nodes) == 2  # compiled autograd's own, then ours once
    assert_same_grad(eager_weight.grad, weight.grad, exact=True)

"""Kept Dynamo traces of CA graphs (Note [Skipping Dynamo's trace of an unchanged CA graph]): the key, the refusal path.

The cross-process replay itself is in ``tests/test_cache.py`` (a restart that traces nothing, and one
whose guards refuse the kept trace).
"""

from __future__ import annotations

import operator

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca._warm_start import keys, traced
from subclass_ca.config import Config
from subclass_ca.testing.subclasses import PairTensor

CONFIG = Config(backend="inductor")
BEHAVIOUR = "a behaviour key"


def _graph(*, scale: float = 2.0, constant: torch.Tensor | None = None, target=torch.mul) -> torch.fx.GraphModule:
    """A small graph module shaped like a CA graph's: a placeholder, a call, maybe a constant."""
    root = torch.nn.Module()
    graph = torch.fx.Graph()
    inputs = graph.placeholder("inputs")
    value = graph.call_function(operator.getitem, (inputs, 0))
    value = graph.call_function(target, (value, scale))
    if constant is not None:
        root.aot0_constant0 = constant
        value = graph.call_function(torch.add, (value, graph.get_attr("aot0_constant0")))
    graph.output(value)
    return torch.fx.GraphModule(root, graph)


def test_equal_graphs_have_one_key_and_any_change_is_another():
    key = keys.graph_key(_graph(), CONFIG, BEHAVIOUR)
    assert key is not None and key == keys.graph_key(_graph(), CONFIG, BEHAVIOUR)
    assert keys.graph_key(_graph(scale=3.0), CONFIG, BEHAVIOUR) != key  # the code
    assert keys.graph_key(_graph(), Config(backend="inductor", dynamic=False), BEHAVIOUR) != key  # the settings
    assert keys.graph_key(_graph(target=torch.div), CONFIG, BEHAVIOUR) != key  # a global the code reads
    assert keys.graph_key(_graph(), CONFIG, "another behaviour key") != key  # what the graph traces to


def test_the_values_of_constants_are_part_of_the_key():
    zeros = keys.graph_key(_graph(constant=torch.zeros(3)), CONFIG, BEHAVIOUR)
    assert zeros == keys.graph_key(_graph(constant=torch.zeros(3)), CONFIG, BEHAVIOUR)
    assert zeros != keys.graph_key(_graph(constant=torch.ones(3)), CONFIG, BEHAVIOUR)
    assert keys.graph_key(_graph(constant=torch.zeros((), dtype=torch.bfloat16)), CONFIG, BEHAVIOUR) is not None


def test_a_graph_reading_what_has_no_description_is_not_kept():
    def local_function(value, scale):  # known by its address only
        return value * scale

    assert keys.graph_key(_graph(target=local_function), CONFIG, BEHAVIOUR) is None
    assert keys.graph_key(_graph(constant=PairTensor(torch.zeros(2), torch.zeros(2))), CONFIG, BEHAVIOUR) is None


def test_the_compile_configs_are_part_of_the_key():
    key = keys.graph_key(_graph(), CONFIG, BEHAVIOUR)
    with torch._inductor.config.patch(max_fusion_size=torch._inductor.config.max_fusion_size + 1):
        assert keys.graph_key(_graph(), CONFIG, BEHAVIOUR) != key
    assert keys.graph_key(_graph(), CONFIG, BEHAVIOUR) == key


def test_only_inductor_graphs_compiled_whole_with_options_only_are_kept():
    graph = _graph()
    assert traced.compile_traced(graph, Config(backend="aot_eager"), {}, BEHAVIOUR) is None
    assert traced.compile_traced(graph, CONFIG, {"mode": "max-autotune-no-cudagraphs"}, BEHAVIOUR) is None


def test_a_graph_without_a_behaviour_key_is_never_kept():
    """None (enable(cache=False)) or this process's nonce (Note [Keys by behaviour]): no record, none looked up."""
    from subclass_ca._warm_start.fingerprint import NONCE

    assert traced.compile_traced(_graph(), CONFIG, {}, None) is None
    assert traced.compile_traced(_graph(), CONFIG, {}, f"process-local {NONCE}") is None


def test_sets_in_the_configs_are_keyed_in_sorted_order(monkeypatch):
    """A set's order differs between processes (torch's Dynamo config holds one): the key sorts it."""
    monkeypatch.setattr(_compat, "portable_compile_configs", lambda: [{"k": {"b", "a", "c"}, "nested": {"x": {2, 1}}}])
    first = keys._configs()
    monkeypatch.setattr(_compat, "portable_compile_configs", lambda: [{"nested": {"x": {1, 2}}, "k": {"c", "a", "b"}}])
    assert keys._configs() == first and "'a', 'b', 'c'" in first


def test_a_config_value_known_by_its_address_leaves_the_graph_unkept(monkeypatch):
    monkeypatch.setattr(_compat, "portable_compile_configs", lambda: [{"hook": object()}])
    assert keys.graph_key(_graph(), CONFIG, BEHAVIOUR) is None


@pytest.mark.inductor
@pytest.mark.skipif(not _compat.precompile_supported(), reason="this torch cannot record a Dynamo trace")
def test_a_graph_that_calls_hooks_is_never_kept(monkeypatch):
    """A tensor hook is Python the CA graph calls, which may act outside the graph (FSDP2's unshard, an
    optimizer step): no behaviour key can be traced for it, so the graph is compiled without a recording
    (Note [Keys by behaviour]); its gradients are eager's."""
    monkeypatch.setattr(traced, "stats", {"recorded": 0, "replayed": 0, "refused": 0})
    scale = torch.tensor(3.0)

    def run(hooked: list[torch.Tensor]) -> list[torch.Tensor]:
        weight = torch.nn.Parameter(PairTensor(torch.ones(4, 4), torch.full((4, 4), 2.0)))
        weight.register_hook(lambda grad: grad * scale)
        loss = (hooked[0] @ weight).tanh().sum()
        loss.backward()
        return [weight.grad.a, weight.grad.b]

    x = [PairTensor(torch.randn(2, 4), torch.randn(2, 4))]
    expected = run(x)
    with subclass_ca.enable(backend="inductor"):
        got = run(x)
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert traced.stats == {"recorded": 0, "replayed": 0, "refused": 0}, traced.stats
    assert "hooks" in subclass_ca._warm_start.fingerprint.uncacheable_reasons().get("a CA graph", "")


@pytest.mark.inductor
@pytest.mark.skipif(not _compat.precompile_supported(), reason="this torch cannot record a Dynamo trace")
def test_a_record_this_torch_cannot_load_is_ignored_and_the_graph_recorded_anew(monkeypatch):
    monkeypatch.setattr(traced, "stats", {"recorded": 0, "replayed": 0, "refused": 0})
    monkeypatch.setattr(traced, "_pending", {})
    monkeypatch.setattr(traced, "_find", lambda key: b"not a record")

    def run() -> list[torch.Tensor]:
        torch.manual_seed(0)
        weight = torch.nn.Parameter(PairTensor(torch.randn(4, 4), torch.randn(4, 4)))
        x = PairTensor(torch.randn(3, 4), torch.randn(3, 4))
        (x @ weight).sin().sum().backward()
        return [weight.grad.a, weight.grad.b]

    expected = run()
    with subclass_ca.enable(backend="inductor"):
        got = run()
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    assert traced.stats == {"recorded": 1, "replayed": 0, "refused": 0}, traced.stats
    assert len(traced._pending) == 1

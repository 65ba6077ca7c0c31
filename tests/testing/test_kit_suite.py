"""check_subclass / CheckReport / SubclassCATestSuite: the kit passes on good subclasses and fails on broken ones."""

from __future__ import annotations

import json

import pytest
import torch

import subclass_ca.testing as kit
from subclass_ca.testing import CheckReport, ScenarioResult, SubclassCATestSuite, SubclassSpec, check_subclass
from subclass_ca.testing.scenarios import Scenario, ScenarioSkip
from subclass_ca.testing.subclasses import make_pair, make_tagged
from subclass_ca.testing.suite import run_scenario

from .kit_broken import TAG_FORGETTING_SPEC, make_scale_dropping

# --- broken subclasses are caught, with the scenario named ----------------------------


def test_unflatten_dropping_scale_fails_and_the_error_names_subclass_and_scenarios():
    report = check_subclass(make_scale_dropping, scenarios=["param_grad", "gradient_type"])
    assert [r.scenario for r in report.failures] == ["param_grad", "gradient_type"]
    assert all(r.subclass == "ScaleDroppingInt8" for r in report)
    with pytest.raises(AssertionError) as caught:
        report.raise_for_failures()
    message = str(caught.value)
    assert "2 subclass_ca check failure(s)" in message
    assert "ScaleDroppingInt8 / param_grad [aot_eager, cpu]" in message
    assert "ScaleDroppingInt8 / gradient_type [aot_eager, cpu]" in message
    assert "w.grad" in message and "values differ" in message


def test_unflatten_ignoring_context_fails_only_metadata_change():
    report = check_subclass(TAG_FORGETTING_SPEC)
    failed = {r.scenario for r in report.failures}
    assert failed == {"metadata_change"}
    reason = report.get("metadata_change").reason
    assert "flatten context 'v1' under CA, 'v2' in eager" in reason
    needs_spec_parts = {"module_swap", "optimizer_state"}  # need make_module / make_optimizer, which this spec has not
    assert {r.scenario for r in report.passed} == set(kit.SCENARIOS) - {"metadata_change"} - needs_spec_parts
    assert {r.scenario for r in report.skipped} == needs_spec_parts
    assert all("the spec has no make_" in r.reason for r in report.skipped)


def test_good_tagged_tensor_passes_metadata_change_with_a_recompile():
    result = check_subclass(make_tagged, scenarios=["metadata_change"],
                            make_variant=lambda d: make_tagged(d, tag="v2")).results[0]
    assert result.status == "pass", result.reason
    assert result.ca_compiles == 2  # base and variant; the third step reuses the first graph
    assert result.subclass_nodes and result.subclass_nodes > 0


def test_make_variant_with_unchanged_metadata_is_a_failure_naming_the_fix():
    result = check_subclass(make_tagged, scenarios=["metadata_change"], make_variant=make_tagged).results[0]
    assert result.status == "fail"
    assert "misconfigured: make_variant builds TaggedTensor tensors with the same flatten context" in result.reason
    assert "must change the constant metadata" in result.reason


# --- skips carry reasons, never hide failures ----------------------------------------


def test_metadata_change_skips_with_reason_without_constant_metadata():
    result = check_subclass(make_pair, scenarios=["metadata_change"]).results[0]
    assert result.status == "skip"
    assert "no constant metadata" in result.reason


def test_metadata_change_skips_when_metadata_exists_but_no_variant_is_given():
    result = check_subclass(make_tagged, scenarios=["metadata_change"]).results[0]
    assert result.status == "skip"
    assert "make_variant" in result.reason


def _failing_program(ctx):
    w = ctx.leaf(ctx.dense(2, 2))
    out = ctx.compile(lambda w: w * 2.0)(w)
    ctx.backward(out.sum())
    # a deliberate difference between the runs: the CA run sees a different value
    return {"value": torch.tensor(1.0 if ctx.mode == "eager" else 2.0)}


def test_known_failure_is_reported_as_skip_carrying_the_error():
    scenario = Scenario(name="always_differs", description="test", program=_failing_program, known_failure="issue X")
    result = run_scenario(scenario, make_pair, subclass="pair")
    assert result.status == "skip"
    assert result.reason.startswith("known failure (issue X): value: values differ")


def test_without_known_failure_the_same_difference_fails():
    scenario = Scenario(name="always_differs", description="test", program=_failing_program)
    result = run_scenario(scenario, make_pair, subclass="pair")
    assert result.status == "fail"
    assert "value: values differ" in result.reason


def test_spec_known_failures_turn_a_failure_into_a_named_skip():
    report = check_subclass(make_scale_dropping, scenarios=["param_grad"], known_failures={"param_grad": "tracked in #1"})
    assert report.results[0].status == "skip"
    assert report.results[0].reason.startswith("known failure (tracked in #1): ")


def test_eager_failure_is_a_skip_that_says_eager_failed():
    def no_tanh(dense):
        return _NoTanh(dense)

    result = check_subclass(no_tanh, scenarios=["param_grad"]).results[0]
    assert result.status == "skip"
    assert "eager reference run raised" in result.reason and "tanh not supported" in result.reason


class _NoTanh(torch.Tensor):
    """A subclass whose dispatch refuses tanh: eager cannot run param_grad."""

    @staticmethod
    def __new__(cls, elem):
        return torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=elem.device)

    def __init__(self, elem):
        self.elem = elem

    def __tensor_flatten__(self):
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return _NoTanh(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.tanh.default:
            raise NotImplementedError("tanh not supported")
        unwrap = lambda t: t.elem if isinstance(t, _NoTanh) else t  # noqa: E731
        out = func(*torch.utils._pytree.tree_map(unwrap, args), **torch.utils._pytree.tree_map(unwrap, kwargs or {}))
        return torch.utils._pytree.tree_map_only(torch.Tensor, _NoTanh, out)


def test_scenario_skip_raised_by_a_program_becomes_skip():
    def program(ctx):
        raise ScenarioSkip("not for this one")

    result = run_scenario(Scenario(name="s", description="d", program=program), make_pair, subclass="pair")
    assert (result.status, result.reason) == ("skip", "not for this one")


def test_cuda_device_skips_cleanly_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this checks the no-CUDA path")
    result = check_subclass(make_pair, scenarios=["param_grad"], devices=["cuda"]).results[0]
    assert (result.status, result.reason) == ("skip", "CUDA is not available")


# --- comparison details ------------------------------------------------------------


def test_compare_values_reports_grad_type_mismatch():
    problems, _, _ = kit.compare_values({"g": make_pair(torch.ones(2))}, {"g": torch.ones(2)})
    assert problems == ["g: type Tensor under CA, PairTensor in eager"]


def test_compare_values_walks_nested_inner_tensors():
    from subclass_ca.testing.subclasses import make_nested_pair

    eager = make_nested_pair(torch.ones(2))
    ca = make_nested_pair(torch.ones(2))
    ca.b.a.add_(1.0)
    problems, abs_err, _ = kit.compare_values(eager, ca)
    assert len(problems) == 1 and problems[0].startswith("b.a: values differ")
    assert abs_err == pytest.approx(1.0)


def test_compare_values_tolerances_are_honoured():
    eager, ca = torch.ones(3), torch.ones(3) + 1e-6
    assert kit.compare_values(eager, ca, atol=0.0, rtol=0.0)[0]
    assert not kit.compare_values(eager, ca, atol=1e-5, rtol=0.0)[0]


# --- the report --------------------------------------------------------------------


def _result(status, scenario="param_grad", subclass="pair", err=0.0):
    return ScenarioResult(subclass=subclass, scenario=scenario, backend="aot_eager", device="cpu", status=status,
                          reason="" if status == "pass" else f"{status} reason", max_abs_error=err)


def test_report_json_holds_every_cell_and_the_summary():
    report = CheckReport([_result("pass"), _result("fail", "hook"), _result("skip", "metadata_change")])
    data = json.loads(report.to_json())
    assert data["summary"] == {"pass": 1, "fail": 1, "skip": 1}
    assert [r["scenario"] for r in data["results"]] == ["param_grad", "hook", "metadata_change"]
    assert {"max_abs_error", "max_rel_error", "ca_compiles", "subclass_nodes", "reason"} <= set(data["results"][0])
    assert not report.ok and report.summary() == "1 passed, 1 failed, 1 skipped"


def test_report_table_marks_pass_fail_skip_with_max_error():
    report = CheckReport([_result("pass", err=2.5e-7), _result("fail", "hook"), _result("skip", "metadata_change"),
                          _result("pass", subclass="int8")])
    lines = report.table().splitlines()
    assert lines[0].split() == ["scenario", "pair", "int8"]
    rows = {line.split()[0]: line for line in lines[2:]}
    assert "✓ 2.5e-07" in rows["param_grad"] and "✓ 0" in rows["param_grad"]
    assert "✗" in rows["hook"] and "skip" in rows["metadata_change"]
    assert "FAIL" in report.table(unicode=False)


def test_raise_for_failures_is_silent_without_failures():
    CheckReport([_result("pass"), _result("skip")]).raise_for_failures()


def test_unknown_scenario_names_the_allowed_values():
    with pytest.raises(ValueError, match="unknown scenario 'nope'; allowed values are .*param_grad"):
        check_subclass(make_pair, scenarios=["nope"])


def test_spec_validation_names_the_field():
    with pytest.raises(ValueError, match="SubclassSpec.make_variant must be callable"):
        SubclassSpec(make_tensor=make_pair, make_variant=3)
    with pytest.raises(ValueError, match="expected a factory"):
        SubclassSpec.coerce("not a factory")


# --- the base test class -----------------------------------------------------------


class TestTaggedThroughTheSuite(SubclassCATestSuite):
    """A user's five lines: this expands into real tests that pytest runs here."""

    make_tensor = staticmethod(make_tagged)
    make_variant = staticmethod(lambda dense: make_tagged(dense, tag="v2"))
    scenarios = ("gradient_type", "metadata_change")


def test_suite_expands_one_test_per_scenario_backend_and_device():
    class Expanded(SubclassCATestSuite):
        make_tensor = staticmethod(make_pair)
        backends = ("aot_eager", "inductor")

    names = sorted(n for n in vars(Expanded) if n.startswith("test_"))
    assert len(names) == 2 * len(kit.SCENARIOS)
    assert "test_param_grad__aot_eager__cpu" in names and "test_warmup_recompiles__inductor__cpu" in names
    marks = {m.name for m in getattr(Expanded.test_param_grad__inductor__cpu, "pytestmark", [])}
    assert marks == {"inductor"}
    assert not hasattr(Expanded.test_param_grad__aot_eager__cpu, "pytestmark")


def test_suite_base_without_factory_expands_nothing():
    class Intermediate(SubclassCATestSuite):
        backends = ("aot_eager",)

    assert not [n for n in vars(Intermediate) if n.startswith("test_")]


def test_suite_failure_raises_the_report_assertion():
    class Broken(SubclassCATestSuite):
        make_tensor = staticmethod(make_scale_dropping)
        scenarios = ("param_grad",)

    with pytest.raises(AssertionError, match=r"Broken / param_grad \[aot_eager, cpu\]"):
        Broken().test_param_grad__aot_eager__cpu()


def test_a_suite_without_make_tensor_says_so_when_checked():
    """``check()`` on a suite that sets no ``make_tensor`` names the suite and the attribute to set (it used to
    surface as check_subclass's "expected a factory ... got None")."""

    class NoFactory(SubclassCATestSuite):
        pass

    with pytest.raises(TypeError, match=r"NoFactory\.check\(\): the suite has no make_tensor"):
        NoFactory().check("param_grad", "aot_eager", "cpu")

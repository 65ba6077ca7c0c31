"""enable(): context manager and decorator, exact state restoration, validation, clear errors."""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca.testing.subclasses import PairTensor, make_pair
from tests.helpers import GraphRecorder, assert_same_grad


def _pair_model():
    torch.manual_seed(0)
    w = torch.nn.Parameter(make_pair(torch.randn(6, 6)))
    step = torch.compile(lambda x: (x @ w).tanh().sum(), backend="aot_eager")
    return w, step, torch.randn(4, 6)


def test_enable_restores_state_exactly_after_normal_exit():
    before = _compat.torch_state_snapshot()
    w, step, x = _pair_model()
    with subclass_ca.enable():
        assert _compat.torch_state_snapshot() != before  # something really was switched on
        step(x).backward()
    assert _compat.torch_state_snapshot() == before
    assert isinstance(w.grad, PairTensor)


def test_enable_restores_state_exactly_after_exception():
    before = _compat.torch_state_snapshot()
    w, step, x = _pair_model()
    with pytest.raises(ZeroDivisionError):
        with subclass_ca.enable():
            step(x).backward()
            raise ZeroDivisionError("raised inside the block")
    assert _compat.torch_state_snapshot() == before
    assert _compat.BLOCKS.depth == 0


def test_nested_enable_blocks_restore_each_level():
    before = _compat.torch_state_snapshot()
    w, step, x = _pair_model()
    with subclass_ca.enable():
        outer = _compat.torch_state_snapshot()
        with subclass_ca.enable(strict=True):
            step(x).backward()
        assert _compat.torch_state_snapshot()["proxy_call_aot_backward"] is outer["proxy_call_aot_backward"]
        assert _compat.BLOCKS.depth > 0
    assert _compat.torch_state_snapshot() == before


def test_decorator_form_runs_backward_through_ca_and_restores_on_raise():
    before = _compat.torch_state_snapshot()
    w, step, x = _pair_model()

    @subclass_ca.enable()
    def backward_step():
        step(x).backward()
        return torch._dynamo.utils.counters["compiled_autograd"]["captures"]

    assert backward_step() == 1
    assert _compat.torch_state_snapshot() == before

    @subclass_ca.enable()
    def failing_step():
        raise KeyError("boom")

    with pytest.raises(KeyError):
        failing_step()
    assert _compat.torch_state_snapshot() == before


def test_same_enable_object_is_reusable_and_reentrant():
    w, step, x = _pair_model()
    ctx = subclass_ca.enable()
    with ctx:
        with ctx:
            step(x).backward()
        assert _compat.BLOCKS.depth > 0
    assert _compat.BLOCKS.depth == 0


def test_backend_callable_receives_the_ca_graph():
    w, step, x = _pair_model()
    recorder = GraphRecorder("aot_eager")
    with subclass_ca.enable(recorder):
        step(x).backward()
    assert recorder.graphs, "the backend callable was never called"
    code = "\n".join(gm.code for gm in recorder.graphs)
    assert "subclass_ca_make_PairTensor" in code  # Dynamo keeps our callable's qualified name


def test_grads_match_eager_through_enable():
    torch.manual_seed(0)
    dense_w, x = torch.randn(6, 6), torch.randn(4, 6)
    eager_w = torch.nn.Parameter(make_pair(dense_w))
    (x @ eager_w).tanh().sum().backward()
    ca_w = torch.nn.Parameter(make_pair(dense_w))
    loss = torch.compile(lambda x: (x @ ca_w).tanh().sum(), backend="aot_eager")(x)
    with subclass_ca.enable():
        loss.backward()
    assert_same_grad(eager_w.grad, ca_w.grad)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"backend": "no_such_backend"}, "backend"),
        ({"backend": 3}, "backend"),
        ({"on_unsupported": "ignore"}, "on_unsupported"),
        ({"strict": "yes"}, "strict"),
        ({"dynamic": 1}, "dynamic"),
        ({"fullgraph": "no"}, "fullgraph"),
    ],
)
def test_invalid_arguments_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        subclass_ca.enable(**kwargs)


def test_config_is_frozen_and_keyword_only():
    config = subclass_ca.Config(backend="aot_eager")
    with pytest.raises(AttributeError):
        config.strict = True  # type: ignore[misc]
    with pytest.raises(TypeError):
        subclass_ca.Config("aot_eager")  # type: ignore[misc]


def test_missing_torch_feature_fails_at_enable_naming_version_and_piece(monkeypatch):
    monkeypatch.setitem(_compat.FEATURES, "AOT backward proxy", "torch._dynamo.compiled_autograd:AutogradCompilerInstance.NoSuchThing")
    _compat.forget_support_check()
    try:
        with pytest.raises(subclass_ca.UnsupportedTorchError) as info:
            with subclass_ca.enable():
                pass
    finally:
        monkeypatch.undo()
        _compat.forget_support_check()
    message = str(info.value)
    assert torch.__version__ in message and "AOT backward proxy" in message and "pip install torch==" in message
    assert _compat.BLOCKS.depth == 0


def test_supported_torch_has_no_missing_features():
    assert _compat.missing_features() == ()


def test_enable_never_reuses_a_graph_captured_by_stock_compiled_autograd():
    w, step, x = _pair_model()
    with _compat.enable_compiled_autograd(_compat.stock_ca_compiler("aot_eager")):
        step(x).backward()
    subclass_ca.clear_reports()
    w.grad = None
    with subclass_ca.enable():
        step(x).backward()
    report = subclass_ca.last_report()
    assert report is not None, "enable() ran the stock graph without capturing"
    assert report.nodes_for("PairTensor", "proxy") == 1


def test_blocks_with_different_backends_each_capture_their_own_graph():
    w, step, x = _pair_model()
    first, second = GraphRecorder(), GraphRecorder()
    with subclass_ca.enable(first):
        step(x).backward()
    with subclass_ca.enable(second):
        step(x).backward()
    with subclass_ca.enable(second):  # same configuration: the cached graph is reused
        step(x).backward()
    assert len(first.graphs) == 1 and len(second.graphs) == 1
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] == 2


def test_bare_decorator_runs_the_step_under_compiled_autograd():
    """@subclass_ca.enable without parentheses (issue 25.4): the step runs inside a default block."""
    w, step, x = _pair_model()

    @subclass_ca.enable
    def backward_step(batch):
        step(batch).backward()

    assert backward_step.__name__ == "backward_step"
    backward_step(x)
    assert isinstance(w.grad, PairTensor)
    assert subclass_ca.last_report() is not None and subclass_ca.last_report().nodes_for("PairTensor") == 1
    assert _compat.BLOCKS.depth == 0


def test_bare_decorator_on_a_two_argument_step_is_not_taken_for_a_backend():
    w, step, x = _pair_model()

    @subclass_ca.enable
    def backward_step(batch, scale):  # binds (gm, example_inputs) too: ambiguous until called
        (step(batch) * scale).backward()

    backward_step(x, 2.0)
    assert isinstance(w.grad, PairTensor)
    assert subclass_ca.last_report().nodes_for("PairTensor") == 1


def test_bare_decorator_on_a_method_binds_like_the_method():
    w, step, x = _pair_model()

    class Trainer:
        @subclass_ca.enable
        def backward_step(self, batch):
            step(batch).backward()

    Trainer().backward_step(x)
    assert isinstance(w.grad, PairTensor)


def test_calling_an_enable_object_like_a_function_raises_a_clear_error():
    with pytest.raises(TypeError, match=r"decorates one function .*with subclass_ca.enable\(\)"):
        subclass_ca.enable()(torch.ones(2))

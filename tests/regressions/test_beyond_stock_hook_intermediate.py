"""Beyond stock CA, case 2: a tensor hook on a subclass intermediate created inside the compiled region.

When the forward is compiled with compiled autograd on (inside ``enable()``), Dynamo defers
``y.register_hook(fn)`` to the backward through the ``trace_wrapped`` HOP, which has no
subclass rule: stock raises ``NotImplementedError: There was no rule registered for HOP
trace_wrapped and subclass TwoTensor`` while compiling the forward.  ``enable()`` desugars
the subclass gradient for that HOP (Note [Hooks on subclass intermediates] in _capture.py).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca.testing.subclasses import PairTensor, make_nested_pair
from tests.helpers import assert_same_grad

TwoTensor = _compat.two_tensor_type()
pytestmark = pytest.mark.skipif(TwoTensor is None, reason="torch.testing._internal.two_tensor is missing")

STEPS = 2


def _weight(kind: str, device: str = "cpu") -> torch.Tensor:
    dense = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)).to(device)
    if kind == "two_tensor":
        return TwoTensor(dense.clone(), dense * 2.0)
    return make_nested_pair(dense)


def triple(grad: torch.Tensor) -> torch.Tensor:
    return grad * 3.0


def observe(grad: torch.Tensor) -> None:
    return None


def _train(kind: str, hook, backend: str | None, context_factory, device: str = "cpu") -> tuple[torch.Tensor, list[str]]:
    weight = torch.nn.Parameter(_weight(kind, device))
    seen: list[str] = []

    def recording_hook(grad: torch.Tensor):
        seen.append(type(grad).__name__)
        return hook(grad)

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x @ weight
        y.register_hook(recording_hook)
        return y.sin().sum()

    forward = torch.compile(step, backend=backend) if backend else step
    for index in range(STEPS):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + index)).to(device)
        with context_factory():
            forward(x).backward()  # the forward is traced with compiled autograd on
    return weight.grad, seen


@pytest.mark.parametrize("kind", ["two_tensor", "nested_pair"])
@pytest.mark.parametrize("hook", [triple, observe], ids=["returns_grad", "returns_none"])
def test_hook_on_subclass_intermediate_matches_eager(kind, hook, backend, device):
    eager_grad, eager_seen = _train(kind, hook, None, contextlib.nullcontext, device)
    grad, seen = _train(kind, hook, backend, lambda: subclass_ca.enable(backend=backend), device)
    assert_same_grad(eager_grad, grad, exact=backend == "aot_eager")
    assert seen == eager_seen == [type(eager_grad).__name__] * STEPS


def test_stock_compiled_autograd_has_no_subclass_rule_for_trace_wrapped():
    def compiler_fn(gm: torch.fx.GraphModule):
        return torch.compile(gm, backend="aot_eager", fullgraph=True)

    with pytest.raises(Exception, match="no rule registered for HOP trace_wrapped"):
        _train("two_tensor", triple, "aot_eager", lambda: _compat.enable_compiled_autograd(compiler_fn, dynamic=True))


def test_trace_wrapped_is_swapped_only_inside_enable():
    tensor_variables = pytest.importorskip("torch._dynamo.variables.tensor")
    subclass_ca.reset()
    original = tensor_variables.trace_wrapped
    with subclass_ca.enable():
        with subclass_ca.enable():
            assert _compat.torch_state_snapshot()["trace_wrapped"][tensor_variables.__name__] is not original
        assert _compat.torch_state_snapshot()["trace_wrapped"][tensor_variables.__name__] is not original
    # resident between blocks (Note [Resident patches]): a gate that calls torch's own trace_wrapped
    assert _compat.torch_state_snapshot()["trace_wrapped"][tensor_variables.__name__] is original
    assert tensor_variables.trace_wrapped.__subclass_ca_original__ is original
    subclass_ca.reset()
    assert tensor_variables.trace_wrapped is original


def test_hook_returning_a_different_type_names_the_subclass_and_the_fix():
    def densify(grad: torch.Tensor) -> torch.Tensor:
        return torch.ones(grad.shape)

    with pytest.raises(Exception) as info:
        _train("two_tensor", densify, "aot_eager", lambda: subclass_ca.enable(backend="aot_eager"))
    chain = [info.value]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    message = "\n".join(str(e) for e in chain)
    assert "TwoTensor" in message and "must return None or a gradient of the same subclass" in message


def test_hook_with_dynamic_outer_shape_fails_at_capture_with_the_workaround():
    weight = torch.nn.Parameter(_weight("two_tensor"))

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x @ weight
        y.register_hook(triple)
        return y.sin().sum()

    x = torch.randn(3, 4)
    torch._dynamo.mark_dynamic(x, 0)
    with pytest.raises(Exception) as info, subclass_ca.enable():
        torch.compile(step, backend="aot_eager")(x).backward()
    error = info.value
    while not isinstance(error, subclass_ca.HookOnSubclassError) and (error.__cause__ or error.__context__):
        error = error.__cause__ or error.__context__
    assert isinstance(error, subclass_ca.HookOnSubclassError), repr(info.value)
    assert "TwoTensor" in str(error) and "symbolic" in str(error) and "outside" in str(error)
    assert weight.grad is None


def test_pair_tensor_zoo_type_is_covered_too():
    grad, seen = _train("nested_pair", triple, "aot_eager", lambda: subclass_ca.enable(backend="aot_eager"))
    assert type(grad) is PairTensor and type(grad.a) is PairTensor

"""A torch.compile-d train step that calls loss.backward() inside (issue 16.1), both ways of turning CA on.

* without the flag: Dynamo graph-breaks at ``backward()``; the backward runs under the
  surrounding ``subclass_ca.enable()`` block;
* with ``torch._dynamo.config.compiled_autograd = True``: Dynamo enters compiled autograd
  around each call of the step with its own compiler; inside ``enable()`` that capture is
  routed through subclass_ca (``_runtime._adopt_flag_style_compiler``).
Either way the report shows the capture and its named nodes, and training == eager.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from tests.helpers import assert_same_grad

TwoTensor = _compat.two_tensor_type()
pytestmark = pytest.mark.skipif(TwoTensor is None, reason="torch.testing._internal.two_tensor is missing")


def _model(kind: str, device: str = "cpu") -> torch.nn.Linear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4).to(device)
    if kind == "two_tensor":
        dense = linear.weight.detach()
        linear.weight = torch.nn.Parameter(TwoTensor(dense.clone(), dense * 2))
    return linear


def _train(kind: str, style: str, steps: int = 3, device: str = "cpu"):
    linear = _model(kind, device)
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)

    def train_step(x):
        loss = linear(x).sin().sum()
        loss.backward()
        return loss.detach()

    # the flag is read when torch.compile(...) builds the step, not when the step is called
    flag = torch._dynamo.config.patch(compiled_autograd=True) if style == "flag" else contextlib.nullcontext()
    block = subclass_ca.enable() if style != "eager" else contextlib.nullcontext()
    grads = []
    with flag, block:
        step = train_step if style == "eager" else torch.compile(train_step, backend="aot_eager")
        for index in range(steps):
            step(torch.randn(2, 4, generator=torch.Generator().manual_seed(index)).to(device))
            grads.append([p.grad.detach().clone() if type(p.grad) is torch.Tensor else p.grad.detach() for p in linear.parameters()])
            optimizer.step()
            optimizer.zero_grad()
    return linear, grads


@pytest.mark.parametrize("kind", ["plain", "two_tensor"])
@pytest.mark.parametrize("style", ["graph_break", "flag"])
def test_compiled_train_step_trains_like_eager_through_subclass_ca(kind, style, device):
    eager_model, eager_grads = _train(kind, "eager", device=device)
    before = len(subclass_ca.reports())
    model, grads = _train(kind, style, device=device)
    for want_step, got_step in zip(eager_grads, grads):
        for want, got in zip(want_step, got_step):
            assert_same_grad(want, got, exact=False)
    for want, got in zip(eager_model.parameters(), model.parameters()):
        assert_same_grad(want.detach(), got.detach(), exact=False)
    new = subclass_ca.reports()[before:]
    assert new, "the backward never reached subclass_ca"
    if style == "flag":  # captured by Dynamo's own compiled-autograd entry, adopted by our block
        assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] == len(new)
    if kind == "two_tensor":
        assert sum(report.nodes_for("TwoTensor") for report in new) >= 1
        assert "subclass_ca_make_TwoTensor" in new[-1].graph_code or any(
            "subclass_ca_make_TwoTensor" in r.graph_code for r in new
        )


def test_flag_style_outside_enable_stays_stock():
    """Without an enable() block subclass_ca is not involved (nothing patched, no report)."""
    before = len(subclass_ca.reports())
    linear = _model("plain")

    def train_step(x):
        loss = linear(x).sin().sum()
        loss.backward()
        return loss.detach()

    with torch._dynamo.config.patch(compiled_autograd=True):
        step = torch.compile(train_step, backend="aot_eager")
        step(torch.randn(2, 4))
    assert len(subclass_ca.reports()) == before
    assert torch._dynamo.utils.counters["compiled_autograd"]["captures"] >= 1


def _our_code_compiled_by_dynamo() -> list[str]:
    """subclass_ca functions Dynamo holds compiled frames for (it must never trace our runtime)."""
    import gc
    import types

    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    found = set()
    for obj in gc.get_objects():
        try:
            if type(obj) is types.FunctionType and "/subclass_ca/" in obj.__code__.co_filename:
                if _debug_get_cache_entry_list(obj.__code__):
                    found.add(obj.__qualname__)
        except ReferenceError:
            continue
    return sorted(found)


@pytest.mark.parametrize("style", ["graph_break", "flag"])
def test_dynamo_never_traces_the_runtime_inside_a_compiled_train_step(style, recwarn):
    """Dynamo's frame callback is active while a compiled step's backward runs: our frames must be skipped."""
    _train("two_tensor", style)
    assert _our_code_compiled_by_dynamo() == []
    dynamo_warnings = [str(w.message) for w in recwarn if "Dynamo" in str(w.message)]
    assert dynamo_warnings == []

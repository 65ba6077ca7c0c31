"""Beyond stock CA, case 3: the ``.grad`` type of a subclass leaf whose subclass lacks ``new_empty_strided``/``copy_``.

``BareInt8Tensor`` below implements its compute ops in ``__torch_dispatch__`` and answers
everything else (``new_empty_strided`` and ``copy_`` included) by dequantizing to a plain
tensor.  Eager AccumulateGrad steals the fresh gradient, so ``.grad`` is a
``BareInt8Tensor``; stock compiled autograd allocates with ``new_empty_strided`` and
copies, so ``.grad`` is a dense ``torch.Tensor``.  ``enable()`` steals every rebuilt subclass
gradient like eager (Note [Subclass gradients and AccumulateGrad] in ``_accumulate.py``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

import subclass_ca
from subclass_ca import _compat
from tests.helpers import assert_same_grad


def _steals(graph_code: str) -> bool:
    """The CA graph accumulates through our stealing AccumulateGrad (either torch shape: Note [Two shapes of
    AccumulateGrad under compiled autograd])."""
    return "accumulate_subclass_grad" in graph_code or "assign_subclass_grad" in graph_code

aten = torch.ops.aten


class BareInt8Tensor(torch.Tensor):
    """Row-wise int8 data + float scale; compute ops requantize, any other op returns dense."""

    COMPUTE_OPS = {
        aten.mm.default, aten.t.default, aten.add.Tensor, aten.mul.Tensor, aten.expand.default,
        aten.view.default, aten._unsafe_view.default, aten.clone.default,
    }

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, outer_size: Any = None, outer_stride: Any = None) -> Any:
        size = qdata.size() if outer_size is None else outer_size
        stride = qdata.stride() if outer_stride is None else outer_stride
        return torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, dtype=scale.dtype, device=qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, outer_size: Any = None, outer_stride: Any = None) -> None:
        self.qdata = qdata
        self.scale = scale

    def __repr__(self) -> str:
        return f"BareInt8Tensor(shape={tuple(self.shape)})"

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["qdata", "scale"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any) -> Any:
        return BareInt8Tensor(inner["qdata"], inner["scale"], outer_size, outer_stride)

    @classmethod
    def quantize(cls, dense: torch.Tensor) -> BareInt8Tensor:
        scale = dense.abs().amax(dim=-1, keepdim=True).clamp(min=1e-8) / 127.0
        return cls(torch.round(dense / scale).clamp(-127, 127).to(torch.int8), scale)

    def dequantize(self) -> torch.Tensor:
        return self.qdata.to(self.scale.dtype) * self.scale

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in (aten.detach.default, aten.alias.default):
            source = args[0]
            return cls(source.qdata, source.scale, source.size(), source.stride())
        dense_args, dense_kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs))
        out = func(*dense_args, **dense_kwargs)
        if func in cls.COMPUTE_OPS and isinstance(out, torch.Tensor) and out.dim() == 2:
            return cls.quantize(out)
        return out


def _dense(seed: int, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _step(backend: str | None, context: contextlib.AbstractContextManager) -> tuple[torch.Tensor, torch.Tensor]:
    weight = torch.nn.Parameter(BareInt8Tensor.quantize(_dense(0, 4, 4)))
    plain = torch.nn.Parameter(_dense(4, 4, 4))

    def model(x: torch.Tensor) -> torch.Tensor:
        return x @ weight + (x.dequantize() @ plain).sin().sum()

    forward = torch.compile(model, backend=backend) if backend else model
    out = forward(BareInt8Tensor.quantize(_dense(1, 3, 4)))
    with context:
        out.backward(BareInt8Tensor.quantize(_dense(2, 3, 4)))
    return weight.grad, plain.grad


def test_eager_gives_a_subclass_grad():
    weight_grad, plain_grad = _step(None, contextlib.nullcontext())
    assert type(weight_grad) is BareInt8Tensor
    assert type(plain_grad) is torch.Tensor


def test_subclass_leaf_grad_type_and_values_match_eager(backend):
    eager = _step(None, contextlib.nullcontext())
    ours = _step(backend, subclass_ca.enable(backend=backend))
    for want, got in zip(eager, ours):
        assert_same_grad(want, got, exact=backend == "aot_eager")
    report = subclass_ca.last_report()
    assert report is not None and _steals(report.graph_code)


def test_stock_compiled_autograd_densifies_the_grad():
    """Why the steal exists: torch's AccumulateGrad path allocates with new_empty_strided."""

    def compiler_fn(gm: torch.fx.GraphModule):
        return torch.compile(gm, backend="aot_eager", fullgraph=True)

    eager_grad, _ = _step(None, contextlib.nullcontext())
    stock_grad, _ = _step("aot_eager", _compat.enable_compiled_autograd(compiler_fn, dynamic=True))
    assert type(stock_grad) is torch.Tensor
    torch.testing.assert_close(stock_grad, eager_grad.dequantize(), atol=0, rtol=0)


def test_subclass_with_type_preserving_allocation_is_stolen_too_without_a_copy():
    """TwoTensor's new_empty_strided keeps the type, but eager still steals: so do we, whatever the allocation does.

    The rule reads only the graph, never fake values a cached forward lacks (Note [One CA graph for
    fresh and cached forwards]): ``.grad`` is the rebuilt gradient itself, bitwise eager's.
    """
    two_tensor = _compat.two_tensor_type()
    if two_tensor is None:
        pytest.skip("torch.testing._internal.two_tensor is missing")

    def step(context) -> tuple[torch.nn.Parameter, Any]:
        weight = torch.nn.Parameter(two_tensor(_dense(0, 4, 4), _dense(1, 4, 4)))
        forward = (lambda x: (x @ weight).sum()) if context is None else torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")
        loss = forward(_dense(2, 3, 4))
        with context or contextlib.nullcontext():
            loss.backward()
        return weight, subclass_ca.last_report()

    eager, _ = step(None)
    weight, report = step(subclass_ca.enable())
    assert type(weight.grad) is two_tensor and weight.grad.stride() == weight.stride()
    assert _steals(report.graph_code) and "external_utils_call_accumulate_grad" not in report.graph_code
    torch.testing.assert_close(weight.grad.a, eager.grad.a, atol=0, rtol=0)
    torch.testing.assert_close(weight.grad.b, eager.grad.b, atol=0, rtol=0)


def _two_steps(backend: str | None, context_factory) -> torch.Tensor:
    weight = torch.nn.Parameter(BareInt8Tensor.quantize(_dense(0, 4, 4)))
    forward = torch.compile(lambda x: x @ weight, backend=backend) if backend else (lambda x: x @ weight)
    for _ in range(2):
        out = forward(BareInt8Tensor.quantize(_dense(1, 3, 4)))
        with context_factory():
            out.backward(BareInt8Tensor.quantize(_dense(2, 3, 4)))
    return weight.grad


def test_existing_grad_accumulation_matches_eager():
    """The second accumulation (``.grad`` already set) keeps torch's path, and matches eager."""
    eager = _two_steps(None, contextlib.nullcontext)
    ours = _two_steps("aot_eager", lambda: subclass_ca.enable(backend="aot_eager"))
    assert_same_grad(eager, ours)
    report = subclass_ca.last_report()
    if _compat.accumulate_grad_is_functional():
        assert not _steals(report.graph_code)
    else:  # up to torch 2.12 the node reads .grad when it runs: the first-or-not decision is made there, as eager's
        assert "assign_subclass_grad" in report.graph_code


# --- issue 16.4: no fake backward outputs to probe (AOTAutograd cache) ------------------------
# Note [AOTAutograd cache and backward metadata] in _compat.py: saving an AOTAutograd cache entry
# (inductor) strips node.meta from the live backward module, and a cache hit loads a stripped one.


def test_grad_type_kept_when_the_capture_has_no_backward_examples(monkeypatch):
    """No fake outputs to probe (an AOTAutograd cache hit): the first accumulation still steals."""
    monkeypatch.setattr(_compat, "backward_output_examples", lambda ctx: None)
    eager = _step(None, contextlib.nullcontext())
    ours = _step("aot_eager", subclass_ca.enable(backend="aot_eager"))
    for want, got in zip(eager, ours):
        assert_same_grad(want, got, exact=True)
    assert _steals(subclass_ca.last_report().graph_code)


def test_type_preserving_subclass_without_backward_examples_matches_eager(monkeypatch):
    two_tensor = _compat.two_tensor_type()
    if two_tensor is None:
        pytest.skip("torch.testing._internal.two_tensor is missing")
    monkeypatch.setattr(_compat, "backward_output_examples", lambda ctx: None)

    def run(context):
        weight = torch.nn.Parameter(two_tensor(_dense(0, 4, 4), _dense(1, 4, 4)))
        loss = (torch.compile(lambda x: (x @ weight).sin().sum(), backend="aot_eager") if context else
                (lambda x: (x @ weight).sin().sum()))(_dense(2, 3, 4))
        with context or contextlib.nullcontext():
            loss.backward()
        return weight.grad

    eager, ours = run(None), run(subclass_ca.enable())
    assert type(ours) is two_tensor
    torch.testing.assert_close(ours.a, eager.a, atol=0, rtol=0)
    torch.testing.assert_close(ours.b, eager.b, atol=0, rtol=0)


def test_stripped_backward_metadata_is_recovered_by_fake_propagation(monkeypatch):
    """The live backward module lost node.meta (as after an AOTAutograd cache save): examples are recomputed."""
    ca = torch._dynamo.compiled_autograd
    extract = ca.extract_bw_module

    def stripped(compiled_function):
        module = extract(compiled_function)
        for node in module.graph.nodes:
            node.meta = {}
        return module

    monkeypatch.setattr(ca, "extract_bw_module", stripped)
    seen = []
    original = _compat.backward_output_examples
    monkeypatch.setattr(_compat, "backward_output_examples", lambda ctx: seen.append(original(ctx)) or seen[-1])
    eager = _step(None, contextlib.nullcontext())
    ours = _step("aot_eager", subclass_ca.enable(backend="aot_eager"))
    assert seen and all(examples is not None for examples in seen)
    for want, got in zip(eager, ours):
        assert_same_grad(want, got, exact=True)


@pytest.mark.inductor
def test_grad_type_kept_after_a_backward_outside_enable_inductor():
    """A backward outside enable() compiles the AOT backward and saves its cache entry (stripping node.meta)."""
    eager = _step(None, contextlib.nullcontext())
    weight = torch.nn.Parameter(BareInt8Tensor.quantize(_dense(0, 4, 4)))
    forward = torch.compile(lambda x: x @ weight, backend="inductor")
    forward(BareInt8Tensor.quantize(_dense(1, 3, 4))).backward(BareInt8Tensor.quantize(_dense(2, 3, 4)))
    weight.grad = None
    out = forward(BareInt8Tensor.quantize(_dense(1, 3, 4)))
    with subclass_ca.enable(backend="inductor"):
        out.backward(BareInt8Tensor.quantize(_dense(2, 3, 4)))
    assert type(weight.grad) is BareInt8Tensor
    torch.testing.assert_close(weight.grad.dequantize(), eager[0].dequantize())

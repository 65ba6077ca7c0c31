"""AccumulateGrad under subclass_ca honours a parameter's ``grad_dtype`` as eager does (torch >= 2.15).

Note [Gradient dtype at accumulation] in subclass_ca/_accumulate.py.  FSDP2's bf16 mixed
precision is the real case (tests/test_fsdp2.py, 2 processes); here one bf16 parameter with
``grad_dtype = torch.float32`` shows the rule in one process.
"""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from subclass_ca import _compat

pytestmark = pytest.mark.skipif(
    not hasattr(torch.Tensor, "grad_dtype"), reason=f"torch {torch.__version__} has no Tensor.grad_dtype"
)


def _bf16_param_with_fp32_grads(device: str = "cpu") -> tuple[torch.nn.Parameter, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16).to(device))
    weight.grad_dtype = torch.float32
    return weight, torch.randn(3, 4, dtype=torch.bfloat16).to(device)


def _refused_by_this_torch(run) -> bool:
    """Run ``run``; True where it was refused with our clear error, as it must be up to torch 2.12 (the
    assigning AccumulateGrad shape: Note [Two shapes of AccumulateGrad under compiled autograd])."""
    if _compat.accumulate_grad_is_functional():
        run()
        return False
    with pytest.raises(subclass_ca.UnsupportedTorchError, match=r"grad_dtype differs from its dtype.*torch >= 2\.13"):
        run()
    return True


def test_bf16_param_with_fp32_grad_dtype_gets_eager_fp32_grad(device) -> None:
    weight, x = _bf16_param_with_fp32_grads(device)
    (x @ weight).square().sum().backward()
    want = weight.grad
    assert want.dtype == torch.float32  # eager casts before accumulating
    weight.grad = None
    forward = torch.compile(lambda x: (x @ weight).square().sum(), backend="aot_eager")

    def run() -> None:
        with subclass_ca.enable():
            forward(x).backward()

    if _refused_by_this_torch(run):
        assert weight.grad is None
        return
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad, want, atol=0, rtol=0)
    assert weight.dtype == torch.bfloat16 and weight.grad_dtype == torch.float32


def test_stock_compiled_autograd_refuses_the_bf16_grad() -> None:
    """What the rule fixes: if this starts passing, torch applies grad_dtype itself (drop the swap)."""
    weight, x = _bf16_param_with_fp32_grads()
    forward = torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")
    loss = forward(x)
    # torch 2.13 on: the .grad setter's dtype check; up to 2.12: Dynamo refuses the assigning AccumulateGrad
    with pytest.raises(RuntimeError, match="grad_dtype" if _compat.accumulate_grad_is_functional() else "Attempt to trace generator"):
        with _compat.enable_compiled_autograd(_compat.stock_ca_compiler("aot_eager")):
            loss.backward()


def test_bf16_param_accumulating_fp32_grads_over_micro_batches_is_bitwise_eager(device) -> None:
    """From the second micro-batch on the bf16 leaf holds a float32 .grad, which torch cannot fakeify
    (Note [A .grad of another dtype than its leaf] in _compat/workarounds.py): one more capture, then steady."""
    from torch._dynamo.utils import counters

    weight, _ = _bf16_param_with_fp32_grads(device)
    start = weight.detach().clone()
    batches = [torch.randn(3, 4, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(i)).to(device) for i in range(4)]
    for x in batches:
        (x @ weight).square().sum().backward()
    want = weight.grad
    ours = torch.nn.Parameter(start.clone())
    ours.grad_dtype = torch.float32
    forward = torch.compile(lambda x: (x @ ours).square().sum(), backend="aot_eager")
    captures = counters["compiled_autograd"]["captures"]

    def first() -> None:
        with subclass_ca.enable():
            forward(batches[0]).backward()

    if _refused_by_this_torch(first):
        assert ours.grad is None
        return
    for x in batches[1:]:
        with subclass_ca.enable():
            forward(x).backward()
    assert ours.grad.dtype == torch.float32 and ours.grad_dtype == torch.float32
    torch.testing.assert_close(ours.grad, want, atol=0, rtol=0)
    assert counters["compiled_autograd"]["captures"] - captures == 2  # no .grad yet, then a float32 .grad


def test_stock_compiled_autograd_cannot_fakeify_the_accumulated_fp32_grad() -> None:
    """What the workaround fixes, with the message that points away from the cause; if this starts
    passing, torch fakeifies such a leaf itself (its probe then says so and nothing is patched)."""
    from subclass_ca._compat.workarounds import GRAD_DTYPE_FAKEIFY

    weight, x = _bf16_param_with_fp32_grads()
    weight.grad = torch.zeros(4, 4, dtype=torch.float32)  # an earlier micro-batch's gradient
    forward = torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")
    loss = forward(x)
    assert GRAD_DTYPE_FAKEIFY.needed
    with pytest.raises(Exception, match=GRAD_DTYPE_FAKEIFY.stock_error):
        with _compat.enable_compiled_autograd(_compat.stock_ca_compiler("aot_eager")):
            loss.backward()


def test_grad_dtype_workaround_acts_only_while_compiled_autograd_fakeifies() -> None:
    """Note [Workaround scopes]: inside an enable() block but outside a capture or a CA graph run, torch's own conversion."""
    from torch._subclasses.fake_tensor import FakeTensorConverter, FakeTensorMode

    from subclass_ca._compat.workarounds import GRAD_DTYPE_FAKEIFY, SCOPES

    GRAD_DTYPE_FAKEIFY.patches.install()
    gate = FakeTensorConverter.__dict__["from_real_tensor"]
    assert gate.__subclass_ca_gate__ is SCOPES["ca-capture-and-graph-run"]
    weight, _ = _bf16_param_with_fp32_grads()
    weight.grad = torch.ones(4, 4, dtype=torch.float32)
    with subclass_ca.enable():
        with pytest.raises(RuntimeError, match="grad_dtype"):
            FakeTensorMode().from_tensor(weight)
        for scope in (_compat.CA_CAPTURE, _compat.CA_GRAPH_RUN):
            scope.enter()
            try:
                fake = FakeTensorMode().from_tensor(weight)
            finally:
                scope.exit()
            assert fake.dtype == torch.bfloat16 and fake.grad_dtype == torch.float32
            assert fake.grad.dtype == torch.float32 and fake.grad.shape == weight.shape
            assert weight.grad.dtype == torch.float32 and torch.equal(weight.grad, torch.ones(4, 4))  # the real one is back


def test_grad_dtype_workaround_reaches_the_leaf_behind_a_view() -> None:
    """A view lifted before its leaf (FSDP2's unsharded parameters) fakeifies the leaf as the view's base."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from subclass_ca._compat.workarounds import GRAD_DTYPE_FAKEIFY

    GRAD_DTYPE_FAKEIFY.patches.install()
    weight, _ = _bf16_param_with_fp32_grads()
    weight.grad = torch.ones(4, 4, dtype=torch.float32)
    view = weight[:, :3]
    with pytest.raises(RuntimeError, match="grad_dtype"):
        FakeTensorMode().from_tensor(view)
    _compat.CA_CAPTURE.enter()
    try:
        fake = FakeTensorMode().from_tensor(view)
    finally:
        _compat.CA_CAPTURE.exit()
    assert fake._is_view() and fake.shape == (4, 3) and fake._base.shape == (4, 4)
    assert fake._base.grad_dtype == torch.float32 and fake._base.grad.dtype == torch.float32
    assert weight.grad.dtype == torch.float32 and torch.equal(weight.grad, torch.ones(4, 4))


def test_without_the_workaround_the_error_names_the_cause_not_the_type(monkeypatch) -> None:
    """Note [Known torch refusals]: torch's 'Found tensor of type Parameter, which is not supported by
    FakeTensorMode' hides its cause; leaving the block it becomes a BackwardCompileError that names it."""
    from subclass_ca._compat import compiled_autograd as ca_compat
    from subclass_ca._compat.workarounds import GRAD_DTYPE_FAKEIFY

    monkeypatch.setattr(ca_compat, "ca_capture_patches", lambda: [])
    GRAD_DTYPE_FAKEIFY.patches.uninstall()  # a later capture installs it again
    weight, x = _bf16_param_with_fp32_grads()
    weight.grad = torch.zeros(4, 4, dtype=torch.float32)  # an earlier micro-batch's gradient
    forward = torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")
    with pytest.raises(subclass_ca.BackwardCompileError) as raised:
        with subclass_ca.enable():
            forward(x).backward()
    message = str(raised.value)
    assert "Parameter" in message and "grad_dtype" in message and "RuntimeError" in message
    assert "outside subclass_ca.enable()" in message
    assert isinstance(raised.value.__cause__, NotImplementedError)
    assert torch.equal(weight.grad, torch.zeros(4, 4))  # nothing was accumulated


def test_the_grad_dtype_refusal_names_the_tensor_the_torch_and_the_fix(monkeypatch) -> None:
    """The clear error for the assigning AccumulateGrad shape, checked on every lane (the shape is faked here)."""
    from subclass_ca import _translate

    weight, _ = _bf16_param_with_fp32_grads()
    plain = torch.nn.Parameter(torch.randn(2))
    monkeypatch.setattr(_compat, "accumulate_grad_is_functional", lambda: False)
    error = _translate.grad_dtype_refusal(([plain, weight], [], [], (), ()))
    assert isinstance(error, subclass_ca.UnsupportedTorchError)
    text = str(error)
    assert "(4, 4) torch.bfloat16 with grad_dtype torch.float32" in text and _compat.TORCH_VERSION in text
    assert "outside subclass_ca.enable()" in text and "torch >= 2.13" in text
    assert _translate.grad_dtype_refusal(([plain], [], [], (), ())) is None
    monkeypatch.setattr(_compat, "accumulate_grad_is_functional", lambda: True)
    assert _translate.grad_dtype_refusal(([weight], [], [], (), ())) is None

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


def _bf16_param_with_fp32_grads() -> tuple[torch.nn.Parameter, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 4, dtype=torch.bfloat16))
    weight.grad_dtype = torch.float32
    return weight, torch.randn(3, 4, dtype=torch.bfloat16)


def test_bf16_param_with_fp32_grad_dtype_gets_eager_fp32_grad() -> None:
    weight, x = _bf16_param_with_fp32_grads()
    (x @ weight).square().sum().backward()
    want = weight.grad
    assert want.dtype == torch.float32  # eager casts before accumulating
    weight.grad = None
    forward = torch.compile(lambda x: (x @ weight).square().sum(), backend="aot_eager")
    with subclass_ca.enable():
        forward(x).backward()
    assert weight.grad.dtype == torch.float32
    torch.testing.assert_close(weight.grad, want, atol=0, rtol=0)
    assert weight.dtype == torch.bfloat16 and weight.grad_dtype == torch.float32


def test_stock_compiled_autograd_refuses_the_bf16_grad() -> None:
    """What the rule fixes: if this starts passing, torch applies grad_dtype itself (drop the swap)."""
    weight, x = _bf16_param_with_fp32_grads()
    forward = torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")
    loss = forward(x)
    with pytest.raises(RuntimeError, match="grad_dtype"):
        with _compat.enable_compiled_autograd(_compat.stock_ca_compiler("aot_eager")):
            loss.backward()

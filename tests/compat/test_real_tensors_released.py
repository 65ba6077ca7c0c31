"""A captured backward leaves no weak reference on the model's tensors (Note [A capture lets go of the real tensors]):
a subclass parameter can still be swapped (``module.to()``, ``.cpu()``: Lightning's teardown) after a capture, and
after a capture whose compile failed while the user holds the error."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch.testing._internal.two_tensor import TwoTensor

import subclass_ca
from subclass_ca import _compat


def _model_and_loss():
    dense = torch.randn(8, 8)
    model = torch.nn.Linear(8, 8, bias=False)
    model.weight = torch.nn.Parameter(TwoTensor(dense.clone(), dense * 2.0))
    loss = torch.compile(lambda x: model(x).sum(), backend="aot_eager")(torch.randn(4, 8))
    return model, loss


def test_a_subclass_parameter_can_be_swapped_after_a_captured_backward():
    model, loss = _model_and_loss()
    with subclass_ca.enable(backend="aot_eager"):
        loss.backward()
    assert isinstance(model.weight.grad, TwoTensor)
    gc.collect()
    assert weakref.getweakrefcount(model.weight) == 0
    model.to(torch.float64)  # swaps the TwoTensor parameter (torch.utils.swap_tensors)
    assert model.weight.dtype == torch.float64 and isinstance(model.weight, TwoTensor)


def test_stock_compiled_autograd_keeps_the_weak_reference():
    """What the note fixes: the same backward under stock compiled autograd leaves the parameter unswappable (if a
    torch release fixes it, this fails and the note can go)."""
    model, loss = _model_and_loss()
    with _compat.enable_compiled_autograd(_compat.stock_ca_compiler("aot_eager")):
        loss.backward()
    gc.collect()
    with pytest.raises(RuntimeError, match="Couldn't swap"):
        model.to(torch.float64)


def test_a_failed_compile_leaves_no_weak_reference_on_the_error_holders_parameters():
    model, loss = _model_and_loss()

    def fail(grad):
        raise RuntimeError("a hook failed")

    loss.register_hook(fail)
    with pytest.raises(subclass_ca.BackwardCompileError, match="a hook failed") as raised:
        with subclass_ca.enable(backend="aot_eager"):
            loss.backward()
    gc.collect()
    assert raised.value.__cause__ is not None  # Dynamo's error is still chained, with its message
    assert weakref.getweakrefcount(model.weight) == 0
    model.to(torch.float64)

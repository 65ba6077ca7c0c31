"""Errors raised while compiling the CA graph name the real cause (issue 25.3).

Only real graph breaks become GraphBreakError (whose fix is ``fullgraph=False``); an exception
the backward code raises, and a wrapper subclass without the flatten protocol, get their own
errors (Note [Only real graph breaks become GraphBreakError] in subclass_ca/_translate.py).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils import _pytree as pytree

import subclass_ca
from subclass_ca import _compat

TwoTensor = _compat.two_tensor_type()


class WrapperWithoutFlatten(torch.Tensor):
    """A wrapper subclass with its own dispatch and no __tensor_flatten__/__tensor_unflatten__."""

    @staticmethod
    def __new__(cls, data):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=data.dtype, device=data.device, requires_grad=data.requires_grad
        )

    def __init__(self, data):
        self.data_ = data

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        args, kwargs = pytree.tree_map_only(WrapperWithoutFlatten, lambda t: t.data_, (args, kwargs or {}))
        return pytree.tree_map_only(torch.Tensor, WrapperWithoutFlatten, func(*args, **kwargs))


def _two_outputs_backward_on_one(under_enable: bool):
    torch.manual_seed(0)
    weight = torch.nn.Parameter(TwoTensor(torch.randn(4, 4), torch.randn(4, 4)))
    both = torch.compile(lambda x: ((x @ weight).sum(), (x @ weight).sin().sum()), backend="aot_eager")
    first, _second = both(torch.randn(3, 4))
    if under_enable:
        with subclass_ca.enable():
            first.backward()
    else:
        first.backward()
    return weight


@pytest.mark.skipif(TwoTensor is None, reason="needs TwoTensor")
def test_exception_in_torchs_backward_code_is_not_called_a_graph_break():
    # compile-only fails too: torch's own error (worded "tangent ..." from 2.13, "guessed its metadata incorrectly" before)
    with pytest.raises(RuntimeError, match=r"tangent|guessed its\s+metadata incorrectly"):
        _two_outputs_backward_on_one(under_enable=False)
    with pytest.raises(subclass_ca.BackwardCompileError) as caught:
        _two_outputs_backward_on_one(under_enable=True)
    text = str(caught.value)
    assert not isinstance(caught.value, subclass_ca.GraphBreakError)
    assert "IndexError" in text  # what raised
    assert "not a graph break" in text and "fullgraph=False) would not fix it" in text
    assert "torch's own backward code" in text and "not subclass_ca's" in text  # whose it is
    assert "torch.compile alone" in text and ".detach()" in text  # what to do
    assert isinstance(caught.value.__cause__, torch._dynamo.exc.Unsupported)


def test_wrapper_without_flatten_protocol_is_named_at_capture():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(WrapperWithoutFlatten(torch.randn(4, 4)))
    step = torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")
    loss = step(torch.randn(3, 4))
    with pytest.raises(subclass_ca.UnsupportedSubclassError) as caught:
        with subclass_ca.enable():
            loss.backward()
    text = str(caught.value)
    assert "WrapperWithoutFlatten" in text and "without __tensor_flatten__/__tensor_unflatten__" in text
    assert "Define __tensor_flatten__" in text and "outside subclass_ca.enable()" in text
    assert "fullgraph=False" not in text
    assert weight.grad is None  # no gradient produced


def test_wrapper_without_flatten_protocol_trains_outside_enable():
    """Compile-only trains it: the error above is about compiled autograd only (and says so)."""
    weight = torch.nn.Parameter(WrapperWithoutFlatten(torch.randn(4, 4)))
    torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")(torch.randn(3, 4)).backward()
    assert isinstance(weight.grad, WrapperWithoutFlatten)


def _raising_hook(grad):
    raise ValueError("boom from the user's hook")


def test_hook_that_raises_is_reported_as_the_users_exception_not_a_graph_break():
    x = torch.randn(4, 3)
    weight = torch.randn(3, 2, requires_grad=True)
    weight.register_hook(_raising_hook)
    loss = torch.compile(lambda a, b: (a @ b).tanh().sum(), backend="aot_eager")(x, weight)
    with pytest.raises(subclass_ca.BackwardCompileError) as caught:
        with subclass_ca.enable():
            loss.backward()
    text = str(caught.value)
    assert "ValueError" in text and "boom from the user's hook" in text
    assert "your code (_raising_hook in test_errors_compile.py:" in text
    assert "not a graph break" in text

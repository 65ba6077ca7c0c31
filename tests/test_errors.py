"""The error table: every bad input raises a SubclassCAError naming the subclass/handler and the fix."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._subclasses.functional_tensor import FunctionalTensor

import subclass_ca
from subclass_ca.testing.subclasses import PairTensor, make_pair


@pytest.fixture
def registered():
    classes = []
    yield classes
    for cls in classes:
        if cls in subclass_ca.handlers():
            subclass_ca.unregister_handler(cls)


def _backward_with_pair_grad(**enable_kwargs):
    torch.manual_seed(0)
    w = torch.nn.Parameter(make_pair(torch.randn(5, 5)))
    loss = torch.compile(lambda x: (x @ w).sum(), backend="aot_eager")(torch.randn(3, 5))
    with subclass_ca.enable(**enable_kwargs):
        loss.backward()
    return w


def test_rebuild_that_raises_is_chained_and_names_the_handler(registered):
    def rebuild(inner, ctx, outer_size, outer_stride):
        raise ValueError("scale missing")

    subclass_ca.register_handler(PairTensor, rebuild=rebuild)
    registered.append(PairTensor)
    with pytest.raises(subclass_ca.RebuildError, match=r"registered handler for .*PairTensor failed.*scale missing") as info:
        _backward_with_pair_grad()
    assert isinstance(info.value.__cause__, ValueError)
    assert "Fix the handler's rebuild" in str(info.value)


def test_rebuild_returning_the_wrong_type_is_rejected(registered):
    subclass_ca.register_handler(PairTensor, rebuild=lambda inner, ctx, size, stride: inner["a"])
    registered.append(PairTensor)
    with pytest.raises(subclass_ca.RebuildError, match=r"returned a plain Tensor, expected an instance of PairTensor"):
        _backward_with_pair_grad()


def test_rebuild_with_wrong_outer_shape_is_rejected(registered):
    def rebuild(inner, ctx, outer_size, outer_stride):
        return PairTensor(inner["a"][:2], inner["b"][:2])

    subclass_ca.register_handler(PairTensor, rebuild=rebuild)
    registered.append(PairTensor)
    with pytest.raises(subclass_ca.MetadataMismatchError, match=r"PairTensor whose size \[2, 5\] != expected \[5, 5\]"):
        _backward_with_pair_grad()


def test_rebuild_with_wrong_dtype_is_rejected(registered):
    def rebuild(inner, ctx, outer_size, outer_stride):
        return PairTensor(inner["a"].double(), inner["b"].double(), outer_size, outer_stride)

    subclass_ca.register_handler(PairTensor, rebuild=rebuild)
    registered.append(PairTensor)
    with pytest.raises(subclass_ca.MetadataMismatchError, match=r"dtype torch.float64 != expected torch.float32"):
        _backward_with_pair_grad()


def test_rebuild_with_wrong_device_is_rejected(registered):
    def rebuild(inner, ctx, outer_size, outer_stride):
        return PairTensor(inner["a"].to("meta"), inner["b"].to("meta"), outer_size, outer_stride)

    subclass_ca.register_handler(PairTensor, rebuild=rebuild)
    registered.append(PairTensor)
    with pytest.raises(subclass_ca.MetadataMismatchError, match=r"device meta != expected cpu"):
        _backward_with_pair_grad()


class HostilePair(PairTensor):
    """A PairTensor whose gradients are rebuilt by a constructor that cannot be compiled."""

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        out = PairTensor.__torch_dispatch__.__func__(cls, func, types, args, kwargs)
        return torch.utils._pytree.tree_map_only(
            PairTensor, lambda t: HostilePair(t.a, t.b) if type(t) is PairTensor else t, out
        )

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return HostilePair(inner["a"], inner["b"], outer_size, outer_stride)


def hostile_rebuild(inner, ctx, outer_size, outer_stride):
    """Needs real storage: refuses functionalized tensors, i.e. cannot be traced by AOTAutograd."""
    if isinstance(inner["a"], FunctionalTensor):
        raise RuntimeError("HostilePair's constructor cannot be traced")
    return HostilePair(inner["a"], inner["b"], outer_size, outer_stride)


@pytest.fixture
def hostile_handler():
    subclass_ca.register_handler(HostilePair, rebuild=hostile_rebuild)
    yield
    subclass_ca.unregister_handler(HostilePair)


def _hostile_backward(**enable_kwargs):
    torch.manual_seed(0)
    dense, x = torch.randn(5, 5), torch.randn(3, 5)
    w = torch.nn.Parameter(HostilePair(dense, dense * 2))
    loss = torch.compile(lambda x: (x @ w).sum(), backend="aot_eager")(x)
    with subclass_ca.enable(**enable_kwargs):
        loss.backward()
    eager_w = torch.nn.Parameter(HostilePair(dense, dense * 2))
    (x @ eager_w).sum().backward()
    return eager_w.grad, w


def test_untraceable_rebuild_errors_by_default_before_any_grad(hostile_handler):
    torch.manual_seed(0)
    w = torch.nn.Parameter(HostilePair(torch.randn(5, 5), torch.randn(5, 5)))
    loss = torch.compile(lambda x: (x @ w).sum(), backend="aot_eager")(torch.randn(3, 5))
    with pytest.raises(subclass_ca.UnsupportedSubclassError, match=r"\['HostilePair'\].*on_unsupported='eager'") as info:
        with subclass_ca.enable():
            loss.backward()
    assert "cannot be traced" in str(info.value.__cause__)
    assert w.grad is None  # failed while compiling: no gradient was produced, right or wrong


def test_untraceable_rebuild_falls_back_to_opaque_with_one_warning(hostile_handler):
    with pytest.warns(UserWarning, match="HostilePair") as caught:
        expected, w = _hostile_backward(on_unsupported="eager")
    assert sum("HostilePair" in str(item.message) for item in caught) == 1
    report = subclass_ca.last_report()
    assert report.fullgraph is False
    assert any("HostilePair" in reason for reason in report.fallbacks)
    actual = w.grad
    assert type(actual) is HostilePair
    torch.testing.assert_close(actual.a, expected.a, atol=0, rtol=0)
    torch.testing.assert_close(actual.b, expected.b, atol=0, rtol=0)
    subclass_ca.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the warning is once per subclass per process
        _hostile_backward(on_unsupported="eager")


def test_metadata_key_that_raises_names_the_handler(registered):
    def bad_key(ctx):
        raise RuntimeError("no key")

    subclass_ca.register_handler(PairTensor, metadata_key=bad_key)
    registered.append(PairTensor)
    with pytest.raises(subclass_ca.RebuildError, match=r"metadata_key of the registered handler for .*PairTensor raised"):
        _backward_with_pair_grad()


def test_errors_share_one_base_class():
    for error in (
        subclass_ca.UnsupportedTorchError,
        subclass_ca.RegistrationError,
        subclass_ca.DuplicateHandlerError,
        subclass_ca.RebuildError,
        subclass_ca.MetadataMismatchError,
        subclass_ca.UnsupportedSubclassError,
        subclass_ca.FSDP2UnsupportedError,
        subclass_ca.DDPUnsupportedError,
        subclass_ca.GraphBreakError,
        subclass_ca.BackwardCompileError,
    ):
        assert issubclass(error, subclass_ca.SubclassCAError)

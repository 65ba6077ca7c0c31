"""Regression (issue 25, item 5): a subclass parameter that does not implement ``empty_like``.

Compiled autograd's ``accumulate_grad`` gives the parameter a capture-time placeholder
``.grad`` with ``torch.empty_like(param)``; a subclass implementing only its compute ops
(torchao's int8 quantized-training weight) raised torch's raw ``NotImplementedError`` there,
while eager and compile-only train it.  Inside ``enable()`` it trains == eager (Note
[Parameters that cannot allocate] in ``subclass_ca/_accumulate.py``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import subclass_ca
from subclass_ca import _accumulate, _compat
from tests.helpers import assert_same_grad

aten = torch.ops.aten
STEPS = 3


class ComputeOnlyWeight(torch.Tensor):
    """A weight that implements its compute ops and nothing else (no ``empty_like``), as torchao's do."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor, outer_size=None, outer_stride=None):
        size = inner.size() if outer_size is None else outer_size
        stride = inner.stride() if outer_stride is None else outer_stride
        return torch.Tensor._make_wrapper_subclass(cls, size, strides=stride, dtype=inner.dtype, device=inner.device)

    def __init__(self, inner: torch.Tensor, outer_size=None, outer_stride=None) -> None:
        self.inner = inner

    def __repr__(self) -> str:
        return f"ComputeOnlyWeight({self.inner!r})"

    def __tensor_flatten__(self):
        return ["inner"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return ComputeOnlyWeight(inner["inner"], outer_size, outer_stride)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}

        def plain(value):
            return value.inner if isinstance(value, cls) else value

        if func in (aten.detach.default, aten.alias.default, aten.clone.default):
            return cls(func(args[0].inner, **kwargs))
        if func in (aten.mm.default, aten.t.default, aten.addmm.default):  # compute: a plain result
            return func(*[plain(a) for a in args], **kwargs)
        if func in (aten.add_.Tensor, aten.copy_.default):  # the optimizer's in-place update
            func(args[0].inner, *[plain(a) for a in args[1:]], **kwargs)
            return args[0]
        raise NotImplementedError(f"{cls.__name__} dispatch: attempting to run unimplemented operator/function: {func}")


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        dense = torch.randn(4, 4, generator=torch.Generator().manual_seed(0)) * 0.5
        self.weight = torch.nn.Parameter(ComputeOnlyWeight(dense))
        self.head = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(3, 4, generator=torch.Generator().manual_seed(1)))
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x @ self.weight).relu())


def _train(model: torch.nn.Module, backend: str | None, context_factory, *, features: int = 4) -> torch.nn.Module:
    forward = torch.compile(model, backend=backend) if backend else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, foreach=False)
    torch.manual_seed(0)  # torchao's in-place weight update rounds stochastically
    with context_factory():
        for index in range(STEPS):
            x = torch.randn(3, features, generator=torch.Generator().manual_seed(10 + index))
            optimizer.zero_grad()
            forward(x).sin().sum().backward()
            optimizer.step()
    return model


def _assert_same_params(eager: torch.nn.Module, model: torch.nn.Module, *, exact: bool) -> None:
    for param, eager_param in zip(model.parameters(), eager.parameters()):
        assert_same_grad(eager_param.grad, param.grad, exact=exact)
        assert type(param) is type(eager_param)
        torch.testing.assert_close(_plain(param), _plain(eager_param), **({"atol": 0, "rtol": 0} if exact else {}))


def _plain(param: torch.Tensor) -> torch.Tensor:
    return param.inner if isinstance(param, ComputeOnlyWeight) else param.detach()


def test_the_weight_really_lacks_empty_like():
    with pytest.raises(NotImplementedError, match="empty_like"):
        torch.empty_like(ComputeOnlyWeight(torch.ones(2, 2)))


@pytest.mark.parametrize("style", ["enable", "compile_only"])
def test_parameter_without_empty_like_trains_like_eager(style):
    eager = _train(Model(), None, contextlib.nullcontext)
    context = (lambda: subclass_ca.enable(backend="aot_eager")) if style == "enable" else contextlib.nullcontext
    model = _train(Model(), "aot_eager", context)
    assert type(model.weight.grad) is type(eager.weight.grad) is torch.Tensor
    _assert_same_params(eager, model, exact=True)


@pytest.mark.skipif(
    not _compat.accumulate_grad_is_functional(),
    reason="this torch's compiled autograd gives no placeholder .grad (assigning AccumulateGrad shape): nothing to fix",
)
def test_stock_compiled_autograd_calls_empty_like_on_the_parameter():
    """What the fix is for: stock compiled autograd allocates the placeholder with empty_like(param)."""

    def compiler_fn(gm: torch.fx.GraphModule):
        return torch.compile(gm, backend="aot_eager", fullgraph=True)

    with pytest.raises(NotImplementedError, match="empty_like"):
        _train(Model(), "aot_eager", lambda: _compat.enable_compiled_autograd(compiler_fn, dynamic=True))


def test_placeholder_that_cannot_be_built_names_the_subclass_the_op_and_the_fix(monkeypatch):
    param = torch.nn.Parameter(ComputeOnlyWeight(torch.ones(2, 2)))

    def refuse(*args, **kwargs):
        raise RuntimeError("no memory for you")

    monkeypatch.setattr(torch, "empty_strided", refuse)
    with pytest.raises(subclass_ca.UnsupportedSubclassError) as info:
        _accumulate.grad_placeholder(param)
    message = str(info.value)
    assert "ComputeOnlyWeight" in message and "aten.empty_like" in message
    assert "Implement aten.empty_like in ComputeOnlyWeight.__torch_dispatch__" in message
    assert _accumulate.grad_placeholder(torch.ones(2)) is None  # plain tensors: torch's own error stands


def _torchao_model() -> torch.nn.Module:
    quantized_training = pytest.importorskip("torchao.prototype.quantized_training")
    torchao = pytest.importorskip("torchao")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    torchao.quantize_(model, quantized_training.int8_weight_only_quantized_training())
    return model


def test_torchao_int8_quantized_training_weight_trains_like_eager():
    eager_model, model = _torchao_model(), _torchao_model()
    model.load_state_dict(eager_model.state_dict())
    eager = _train(eager_model, None, contextlib.nullcontext, features=16)
    model = _train(model, "aot_eager", lambda: subclass_ca.enable(backend="aot_eager"), features=16)
    for param, eager_param in zip(model.parameters(), eager.parameters()):
        assert type(param) is type(eager_param)
        assert_same_grad(eager_param.grad, param.grad, exact=False)
        torch.testing.assert_close(_dense(param), _dense(eager_param))


def _dense(param: torch.Tensor) -> torch.Tensor:
    return param.dequantize() if hasattr(param, "dequantize") else param.detach()

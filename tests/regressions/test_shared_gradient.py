"""Two parameters that receive the same gradient tensor each get their own ``.grad`` (issue 45.1).

``W_eff = W0 + dW``: the add's backward hands one gradient to both AccumulateGrads. Eager's first
AccumulateGrad clones it (it is still referenced), the second steals it; stealing for both would make
the two ``.grad`` one storage, and an in-place ``clip_grad_norm_(foreach=True)`` would scale it twice.
Compared with eager bitwise on aot_eager over three SGD steps (the parity suite runs stock beside it).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import subclass_ca
from subclass_ca import _compat

TwoTensor = _compat.two_tensor_type()
pytestmark = pytest.mark.skipif(TwoTensor is None, reason="torch.testing._internal.two_tensor is missing")


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    if _compat.is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in _inner(getattr(t, name))]
    return [t]


def _train(make, mode: str, foreach: bool, steps: int = 3):
    torch.manual_seed(0)
    base = torch.nn.Parameter(make(torch.randn(6, 6)))
    delta = torch.nn.Parameter(make(torch.randn(6, 6) * 0.1))
    params = [base, delta]
    optimizer = torch.optim.SGD(params, lr=0.5)

    def loss_fn(x):
        return (x @ (base + delta)).tanh().sum()

    forward = loss_fn if mode == "eager" else torch.compile(loss_fn, backend="aot_eager")
    block = subclass_ca.enable(backend="aot_eager") if mode == "ours" else contextlib.nullcontext()
    losses, aliased = [], []
    with block:
        for step in range(steps):
            x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
            loss = forward(x)
            loss.backward()
            own = {t.untyped_storage().data_ptr() for t in _inner(base.grad)}
            aliased.append(any(t.untyped_storage().data_ptr() in own for t in _inner(delta.grad)))
            torch.nn.utils.clip_grad_norm_(params, max_norm=0.05, foreach=foreach)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return losses, [p.detach() for p in params], aliased


@pytest.mark.parametrize("foreach", [True, False])
def test_a_gradient_shared_by_two_parameters_is_cloned_once_like_eager(foreach):
    make = lambda dense: TwoTensor(dense, dense * 2)  # noqa: E731
    eager_losses, eager_params, eager_aliased = _train(make, "eager", foreach)
    losses, params, aliased = _train(make, "ours", foreach)
    assert not any(eager_aliased)
    assert not any(aliased), "the two parameters' .grad share storage (both AccumulateGrads stole one gradient)"
    for got, expected in zip([*losses, *params], [*eager_losses, *eager_params], strict=True):
        for g, e in zip(_inner(got), _inner(expected), strict=True):
            torch.testing.assert_close(g, e, rtol=0, atol=0)

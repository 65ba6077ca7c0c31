"""Gradient accumulation with a tied subclass parameter, clip_grad_norm_ and in-place updates (issue 16.5)."""

from __future__ import annotations

import contextlib

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca.testing.subclasses import make_pair
from tests.helpers import assert_same_grad

TwoTensor = _compat.two_tensor_type()
FACTORIES = {
    "two_tensor": (lambda dense: TwoTensor(dense, dense * 2)) if TwoTensor is not None else None,
    "pair": make_pair,
}


def _train(make, compiled: bool, steps: int = 2, micro_batches: int = 2):
    torch.manual_seed(0)
    tied = torch.nn.Parameter(make(torch.randn(6, 4)))
    linear = torch.nn.Linear(4, 4)
    params = [tied, *linear.parameters()]

    def loss_fn(x):
        return linear(x @ tied @ tied.t() @ tied).sin().sum()  # the tied weight is used three times

    forward = torch.compile(loss_fn, backend="aot_eager") if compiled else loss_fn
    grads = []
    with subclass_ca.enable() if compiled else contextlib.nullcontext():
        for step in range(steps):
            for micro in range(micro_batches):
                x = torch.randn(3, 6, generator=torch.Generator().manual_seed(step * micro_batches + micro))
                forward(x).backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            grads.append([p.grad.detach().clone() if type(p.grad) is torch.Tensor else p.grad.detach() for p in params])
            with torch.no_grad():
                for p in params:
                    p.add_(p.grad, alpha=-0.1)  # in-place update of the subclass parameter
            for p in params:
                p.grad = None
    return [p.detach() for p in params], grads


@pytest.mark.parametrize("subclass", list(FACTORIES))
def test_tied_accumulation_with_clipping_and_inplace_updates_matches_eager(subclass):
    make = FACTORIES[subclass]
    if make is None:
        pytest.skip("torch.testing._internal.two_tensor is missing")
    eager_params, eager_grads = _train(make, compiled=False)
    params, grads = _train(make, compiled=True)
    for want_step, got_step in zip(eager_grads, grads):
        for want, got in zip(want_step, got_step):
            assert_same_grad(want, got, exact=False)
    for want, got in zip(eager_params, params):
        assert_same_grad(want, got, exact=False)

"""A torch.compile-d train step with loss.backward() inside, batch size changing every step.

Dynamo graph-breaks at ``backward()`` and keeps its frame callback active while the backward
runs eagerly under ``subclass_ca.enable()``.  Our capture-time Python (the epilogue override
behind ``proxy_call_aot_backward``) used to be compiled by Dynamo as user frames; when the batch
size changed, a recompiled resume function reused the weight's argument slice for the bias's
``subclass_ca_make_TwoTensor`` node (``make(t_6, t_7)`` twice) and the next Dynamo compile
failed in the bias's AccumulateGrad (``expand: the requested shape has too few dimensions``).
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

BATCHES = (2, 3, 4)


def _train(compiled: bool):
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4)  # TwoTensor weight, plain bias
    dense = linear.weight.detach()
    linear.weight = torch.nn.Parameter(TwoTensor(dense.clone(), dense * 2))
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)

    def train_step(x):
        loss = linear(x).sin().sum()
        loss.backward()
        return loss.detach()

    step = torch.compile(train_step, backend="aot_eager") if compiled else train_step
    losses, grads = [], []
    with subclass_ca.enable() if compiled else contextlib.nullcontext():
        for index, batch in enumerate(BATCHES):
            x = torch.randn(batch, 4, generator=torch.Generator().manual_seed(index))
            losses.append(step(x))
            grads.append([p.grad.detach() for p in linear.parameters()])
            optimizer.step()
            optimizer.zero_grad()
    return linear, losses, grads


def test_compiled_train_step_with_changing_batch_matches_eager():
    eager_model, eager_losses, eager_grads = _train(compiled=False)
    before = len(subclass_ca.reports())
    model, losses, grads = _train(compiled=True)
    for want, got in zip(eager_losses, losses):
        assert_same_grad(want, got, exact=False)
    for want_step, got_step in zip(eager_grads, grads):
        for want, got in zip(want_step, got_step):
            assert_same_grad(want, got, exact=False)
    for want, got in zip(eager_model.parameters(), model.parameters()):
        assert_same_grad(want.detach(), got.detach(), exact=False)
    new = subclass_ca.reports()[before:]
    assert new, "the backward never reached subclass_ca"
    # each make node takes its own gradient's inner tensors: never one argument list twice
    for report in new:
        calls = [line.split("subclass_ca_make_TwoTensor(", 1)[1].split(", recipe")[0]
                 for line in report.graph_code.splitlines() if "subclass_ca_make_TwoTensor(" in line]
        assert len(calls) == len(set(calls)), report.graph_code

"""Beyond stock CA, case 5: post-accumulate-grad hooks on a subclass parameter.

The hook is the "optimizer in backward" pattern (update the parameter from its ``.grad``
inside ``register_post_accumulate_grad_hook``).  Under ``enable()`` the whole backward,
hooks included, is one compiled-autograd capture and the CA graph compiles once: after the
warm-up step neither captures nor Dynamo graphs grow, and the parameters match eager.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from tests.helpers import assert_same_grad
from tests.regressions._models import PairThenLinear

TwoTensor = _compat.two_tensor_type()
pytestmark = pytest.mark.skipif(TwoTensor is None, reason="torch.testing._internal.two_tensor is missing")

STEPS = 4
LR = 0.1


def sgd_in_backward(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.sub_(param.grad * LR)


def sgd_and_free_grad(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.sub_(param.grad * LR)
    param.grad = None


def scale_grad(param: torch.Tensor) -> None:
    with torch.no_grad():
        param.grad.mul_(0.5)


def make_momentum_hook():
    """SGD with momentum whose buffer is created lazily in a Python dict (Dynamo guards on it)."""
    buffers: dict[torch.Tensor, torch.Tensor] = {}

    def momentum(param: torch.Tensor) -> None:
        with torch.no_grad():
            buffer = buffers.get(param)
            if buffer is None:
                buffer = buffers[param] = param.grad.clone()
            else:
                buffer.mul_(0.9).add_(param.grad)
            param.sub_(buffer * LR)

    return momentum


# (hook factory, warm-up steps): the momentum hook's first step creates its Python-side state,
# which changes Dynamo's guards once; that is the hook's own recompile, in eager-compiled code too.
HOOKS = [
    pytest.param((lambda: sgd_in_backward, 1), id="sgd"),
    pytest.param((lambda: sgd_and_free_grad, 1), id="sgd_free_grad"),
    pytest.param((lambda: scale_grad, 1), id="scale_grad"),
    pytest.param((make_momentum_hook, 2), id="momentum"),
]


def _train(hook_factory, backend: str | None) -> tuple[PairThenLinear, list[tuple[int, int]]]:
    """Run STEPS steps; returns the model and (captures, dynamo graphs) after each step."""
    model = PairThenLinear()
    hook = hook_factory()
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(hook)
    forward = torch.compile(model, backend=backend) if backend else model
    counters = torch._dynamo.utils.counters
    history = []
    for step in range(STEPS):
        model.zero_grad()
        loss = forward(torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + step)))
        with subclass_ca.enable(backend=backend) if backend else contextlib.nullcontext():
            loss.backward()
        history.append((counters["compiled_autograd"]["captures"], counters["stats"]["unique_graphs"]))
    return model, history


@pytest.mark.parametrize("hook", HOOKS)
def test_post_accumulate_hooks_on_subclass_param_match_eager(hook, backend):
    factory, _ = hook
    eager, _ = _train(factory, None)
    ours, _ = _train(factory, backend)
    exact = backend == "aot_eager"
    for (_, want), got in zip(eager.named_parameters(), ours.parameters()):
        assert_same_grad(want.detach(), got.detach(), exact=exact)
        assert_same_grad(want.grad, got.grad, exact=exact)
    assert type(ours.w.detach()) is TwoTensor


@pytest.mark.parametrize("hook", HOOKS)
def test_post_accumulate_hooks_capture_and_compile_once_after_warmup(hook):
    factory, warmup = hook
    _, history = _train(factory, "aot_eager")
    captures = [c for c, _ in history]
    graphs = [g for _, g in history]
    assert captures == [1] * STEPS, f"compiled-autograd captures per step: {captures}"
    after = graphs[warmup - 1 :]
    assert after == [after[0]] * len(after), f"Dynamo graphs kept growing after warm-up: {graphs}"
    report = subclass_ca.last_report()
    assert report is not None and report.nodes_for(TwoTensor.__name__) >= 1
    assert "post_acc_grad_hook" in report.graph_code

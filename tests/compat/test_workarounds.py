"""Workarounds never change results (Note [Workaround scopes]): inventory, value tests, no-leak tests."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from tests.helpers import assert_same_grad
from tests.regressions._models import PairThenLinear

TwoTensor = _compat.two_tensor_type()
pytestmark = pytest.mark.skipif(TwoTensor is None, reason="torch.testing._internal.two_tensor is missing")
DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_every_workaround_declares_what_where_and_why():
    assert _compat.WORKAROUNDS, "the inventory is empty"
    design = (DOCS / "design.md").read_text()
    for workaround in _compat.WORKAROUNDS:
        assert workaround.fixes and workaround.upstream and workaround.scope in _compat.workarounds.SCOPES
        assert isinstance(workaround.needed, bool)
        assert workaround.name in design and workaround.upstream in design, f"docs/design.md misses {workaround.name}"


def test_a_workaround_scope_must_be_known():
    with pytest.raises(ValueError, match="scope"):
        _compat.Workaround(name="x", fixes="y", upstream="z", scope="everywhere", probe=lambda: True, stock_error="e",
                           patches=_compat.PatchSet("x", list))


def _inputs(step: int) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(step))


def _train_accumulating(backend: str | None, steps: int = 3, micro_batches: int = 2) -> PairThenLinear:
    """SGD with gradient accumulation: from step 1 on, the plain Linear holds a TwoTensor .grad."""
    torch.manual_seed(0)
    model = PairThenLinear()
    forward = torch.compile(model, backend=backend) if backend else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    context = subclass_ca.enable(backend=backend) if backend else contextlib.nullcontext()
    for step in range(steps):
        for micro in range(micro_batches):
            loss = forward(_inputs(step * micro_batches + micro))
            with context:
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return model


def test_grad_context_workaround_preserves_values_over_optimizer_steps():
    eager = _train_accumulating(None)
    ours = _train_accumulating("aot_eager")
    for (_, want), (_, got) in zip(eager.named_parameters(), ours.named_parameters()):
        assert_same_grad(want.detach(), got.detach(), exact=False)


def _compiled_adamw_run(inside_enable: bool, compiled_step: bool) -> tuple[list[torch.Tensor], BaseException | None]:
    """The issue-19 pattern: plain params receiving TwoTensor grads, a torch.compile-d AdamW step."""
    torch.manual_seed(0)
    model = PairThenLinear()
    forward = torch.compile(model, backend="aot_eager") if inside_enable else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = torch.compile(optimizer.step, backend="aot_eager") if compiled_step else optimizer.step
    context = subclass_ca.enable() if inside_enable else contextlib.nullcontext()
    error = None
    with context:
        for index in range(3):
            loss = forward(_inputs(index))
            loss.backward()
            try:
                step()
            except Exception as raised:  # noqa: BLE001 - the outcome under test
                error = raised
                break
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], error


def test_grad_context_workaround_does_not_leak_into_a_users_compiled_optimizer_step():
    """Inside enable(), the user's compiled step sees stock torch: torch's own error, ours, or == eager.

    torch 2.13 refuses the step itself (the bug this workaround fixes for our CA graphs only);
    torch 2.14/2.15 would compile it to wrong values (without subclass_ca too), so subclass_ca
    refuses it (Note [Compiled optimizer steps over subclass gradients], tests/test_optimizer_step.py).
    """
    eager, _ = _compiled_adamw_run(inside_enable=False, compiled_step=False)
    ours, error = _compiled_adamw_run(inside_enable=True, compiled_step=True)
    if error is not None:
        assert _compat.CA_GRAPH_RUN.depth == 0
        if _compat.workarounds._grad_context_bug():  # torch 2.13 (its check lets it through) or <= 2.12 (no check)
            assert "SubclassSymbolicContext" in str(error), error  # torch's own refusal, as stock gives
        else:
            assert _compat.compiled_step_on_subclass_grads_is_wrong()
            assert isinstance(error, subclass_ca.CompiledOptimizerStepError), error
        return
    for want, got in zip(eager, ours):
        torch.testing.assert_close(got, want)

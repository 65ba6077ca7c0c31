"""A compiled optimizer step torch would compute wrong raises ours; nothing else does.

Note [Compiled optimizer steps over subclass gradients] in subclass_ca/_optimizer_step.py.
Affected: torch 2.14/2.15 (``_compat.compiled_step_on_subclass_grads_is_wrong()``); torch 2.13
refuses the same step itself, and there behaviour is unchanged.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import subclass_ca
from subclass_ca import _compat, _optimizer_step
from tests.regressions._models import PairThenLinear

TwoTensor = _compat.two_tensor_type()
pytestmark = pytest.mark.skipif(TwoTensor is None, reason="torch.testing._internal.two_tensor is missing")
AFFECTED = _compat.compiled_step_on_subclass_grads_is_wrong()


def _inputs(step: int, batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, 4, generator=torch.Generator().manual_seed(step))


def _adamw_run(model: torch.nn.Module, *, compiled_forward: bool, compiled_step: bool, inside_enable: bool,
               batches: tuple[int, ...] = (3,), steps: int = 3) -> tuple[list[torch.Tensor], BaseException | None]:
    forward = torch.compile(model, backend="aot_eager") if compiled_forward else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    step = torch.compile(optimizer.step, backend="aot_eager") if compiled_step else optimizer.step
    error = None
    with subclass_ca.enable() if inside_enable else contextlib.nullcontext():
        for index in range(steps):
            for micro, batch in enumerate(batches):
                forward(_inputs(index * 10 + micro, batch)).backward()
            try:
                step()
            except Exception as raised:  # noqa: BLE001 - the outcome under test
                error = raised
                break
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()], error


def _fresh() -> PairThenLinear:
    torch.manual_seed(0)
    return PairThenLinear()


def test_compiled_step_over_plain_params_with_subclass_grads_raises_before_any_update():
    model = _fresh()
    before = [p.detach().clone() for p in model.parameters()]
    params, error = _adamw_run(model, compiled_forward=True, compiled_step=True, inside_enable=True)
    if not AFFECTED:  # torch 2.13: torch refuses it itself, as without subclass_ca
        assert error is not None and "SubclassSymbolicContext" in str(error), error
        return
    assert isinstance(error, subclass_ca.CompiledOptimizerStepError), error
    message = str(error)
    assert "AdamW" in message and "TwoTensor" in message and "plain tensor" in message  # what and where
    assert f"torch {torch.__version__}" in message and "wrong" in message  # which torch, the cause
    assert "eagerly" in message and "plain gradients" in message  # the fix
    assert "Nothing was updated" in message
    for got, want in zip(params, before):  # raised at the first step, before Dynamo traced it
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_forward_recompiles_with_subclass_grads_in_place_do_not_raise():
    """Micro-batches of changing size recompile the forward while the plain Linear holds TwoTensor grads."""
    if not AFFECTED:
        # torch 2.13 cannot fakeify such a .grad outside our CA graphs (pytorch#186427): the recompile fails in
        # torch with or without subclass_ca; the frame hook is not even installed there
        assert _optimizer_step.frame_swaps() == []
        pytest.skip(f"torch {torch.__version__} refuses forward recompiles with subclass grads of plain params itself")
    compiles: list[int] = []

    def counting(gm: torch.fx.GraphModule, example_inputs: list) -> object:
        compiles.append(len(example_inputs))
        return gm.forward

    eager, _ = _adamw_run(_fresh(), compiled_forward=False, compiled_step=False, inside_enable=False, batches=(3, 5, 2))
    model = _fresh()
    forward = torch.compile(model, backend=counting)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    with subclass_ca.enable():
        for index in range(3):
            for micro, batch in enumerate((3, 5, 2)):
                forward(_inputs(index * 10 + micro, batch)).backward()
                assert isinstance(model.lin.weight.grad, TwoTensor)
            optimizer.step()
            optimizer.zero_grad()
    assert len(compiles) >= 2, compiles  # at least one recompile happened with subclass grads in place
    for want, got in zip(eager, model.parameters()):
        torch.testing.assert_close(got.detach(), want)


class _AllPairs(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        first = torch.randn(4, 4, generator=torch.Generator().manual_seed(0))
        second = torch.randn(4, 3, generator=torch.Generator().manual_seed(1))
        self.w = torch.nn.Parameter(TwoTensor(first.clone(), first * 2.0))
        self.v = torch.nn.Parameter(TwoTensor(second.clone(), second * 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x @ self.w @ self.v).sin().sum()


def test_compiled_step_over_subclass_params_does_not_raise_and_matches_eager():
    eager, _ = _adamw_run(_AllPairs(), compiled_forward=False, compiled_step=False, inside_enable=False)
    ours, error = _adamw_run(_AllPairs(), compiled_forward=True, compiled_step=True, inside_enable=True)
    assert error is None, error
    for want, got in zip(eager, ours):
        torch.testing.assert_close(got, want)


def test_eager_step_over_plain_params_with_subclass_grads_does_not_raise_and_matches_eager():
    eager, _ = _adamw_run(_fresh(), compiled_forward=False, compiled_step=False, inside_enable=False)
    ours, error = _adamw_run(_fresh(), compiled_forward=True, compiled_step=False, inside_enable=True)
    assert error is None, error
    for want, got in zip(eager, ours):
        torch.testing.assert_close(got, want)


def test_compiled_sgd_step_is_not_refused_where_torch_computes_it_right():
    """SGD over plain params with TwoTensor grads: torch 2.15 compiles it == eager (CORRECT_WHEN_COMPILED)."""
    def run(compiled: bool) -> tuple[list[torch.Tensor], BaseException | None]:
        model = _fresh()
        forward = torch.compile(model, backend="aot_eager") if compiled else model
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        step = torch.compile(optimizer.step, backend="aot_eager") if compiled else optimizer.step
        with subclass_ca.enable() if compiled else contextlib.nullcontext():
            for index in range(3):
                forward(_inputs(index)).backward()
                try:
                    step()
                except Exception as raised:  # noqa: BLE001 - the outcome under test
                    return [], raised
                optimizer.zero_grad()
        return [p.detach().clone() for p in model.parameters()], None

    eager, _ = run(compiled=False)
    ours, error = run(compiled=True)
    assert not isinstance(error, subclass_ca.SubclassCAError), error
    if error is None:
        for want, got in zip(eager, ours):
            torch.testing.assert_close(got, want)
    else:  # torch 2.13 refuses it itself
        assert not AFFECTED and "SubclassSymbolicContext" in str(error), error


def test_compiled_step_outside_a_block_is_torchs_business():
    """No block open: the hook is inert (torch's own outcome, as stock)."""
    _, error = _adamw_run(_fresh(), compiled_forward=False, compiled_step=True, inside_enable=False)
    assert not isinstance(error, subclass_ca.SubclassCAError), error

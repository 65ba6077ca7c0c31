"""Regression (issue 25, item 6): full backward module hooks on a module with subclass gradients.

``register_full_backward_hook`` / ``register_full_backward_pre_hook`` on a submodule of a
``torch.compile``d model whose weights are TwoTensors, with ``enable()`` entered once around
the training loop (so the forward is traced with compiled autograd on).  Dynamo defers the
module hooks through the ``trace_wrapped`` HOP with tuples of gradients (Note [Hooks on
subclass intermediates] in ``subclass_ca/_hooks.py``); before the fix the forward failed to
compile with ``no rule registered for HOP trace_wrapped and subclass TwoTensor``.
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

STEPS = 3


class PairLinear(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        dense = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed)) * 0.5
        self.weight = torch.nn.Parameter(TwoTensor(dense.clone(), dense * 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class TwoLayers(torch.nn.Module):
    """The hooked submodule (``second``) gets a TwoTensor input and gives a TwoTensor output."""

    def __init__(self) -> None:
        super().__init__()
        self.first = PairLinear(0)
        self.second = PairLinear(1)
        self.head = torch.nn.Linear(4, 3)
        with torch.no_grad():
            self.head.weight.copy_(torch.randn(3, 4, generator=torch.Generator().manual_seed(2)))
            self.head.bias.zero_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x).relu()))


def _copies(grads: tuple) -> list:
    return [None if g is None else g.detach().clone() for g in grads]


def _install(module: torch.nn.Module, kind: str, scale: bool, seen: list) -> None:
    if kind == "post":

        def hook(mod, grad_input, grad_output):
            seen.append(("in", _copies(grad_input)))
            seen.append(("out", _copies(grad_output)))
            if scale:
                return tuple(None if g is None else g * 0.5 for g in grad_input)
            return None

        module.register_full_backward_hook(hook)
    else:

        def pre_hook(mod, grad_output):
            seen.append(("out", _copies(grad_output)))
            if scale:
                return tuple(g * 0.5 for g in grad_output)
            return None

        module.register_full_backward_pre_hook(pre_hook)


def _train(kind: str, scale: bool, backend: str | None, context_factory) -> tuple[TwoLayers, list]:
    model = TwoLayers()
    seen: list = []
    _install(model.second, kind, scale, seen)
    forward = torch.compile(model, backend=backend) if backend else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with context_factory():  # entered once around the whole loop
        for index in range(STEPS):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 + index))
            optimizer.zero_grad()
            forward(x).sin().sum().backward()
            optimizer.step()
    return model, seen


def _assert_matches_eager(kind: str, scale: bool, backend: str) -> None:
    eager, eager_seen = _train(kind, scale, None, contextlib.nullcontext)
    model, seen = _train(kind, scale, backend, lambda: subclass_ca.enable(backend=backend))
    exact = backend == "aot_eager"
    assert len(seen) == len(eager_seen) == STEPS * (2 if kind == "post" else 1)
    for (where, grads), (eager_where, eager_grads) in zip(seen, eager_seen):
        assert where == eager_where and len(grads) == len(eager_grads)
        assert any(type(g) is TwoTensor for g in eager_grads)
        for got, want in zip(grads, eager_grads):
            assert_same_grad(want, got, exact=exact)
    for param, eager_param in zip(model.parameters(), eager.parameters()):
        assert_same_grad(eager_param.grad, param.grad, exact=exact)
        assert_same_grad(eager_param.detach(), param.detach(), exact=exact)


@pytest.mark.parametrize("scale", [False, True], ids=["observes", "rescales"])
@pytest.mark.parametrize("kind", ["post", "pre"])
def test_full_backward_module_hook_on_subclass_module_trains_like_eager(kind, scale):
    _assert_matches_eager(kind, scale, "aot_eager")


@pytest.mark.inductor
def test_full_backward_module_hook_on_subclass_module_trains_like_eager_inductor():
    _assert_matches_eager("post", True, "inductor")


def test_stock_compiled_autograd_has_no_subclass_rule_for_module_hooks():
    """What the fix is for: stock compiled autograd refuses the same loop while compiling the forward."""

    def compiler_fn(gm: torch.fx.GraphModule):
        return torch.compile(gm, backend="aot_eager", fullgraph=True)

    with pytest.raises(Exception, match="no rule registered for HOP trace_wrapped"):
        _train("post", False, "aot_eager", lambda: _compat.enable_compiled_autograd(compiler_fn, dynamic=True))


def _error_text(hook) -> str:
    """The error chain's text: the check runs while Dynamo traces the CA graph, which wraps it."""
    model = TwoLayers()
    model.second.register_full_backward_hook(hook)
    forward = torch.compile(model, backend="aot_eager")
    with pytest.raises(Exception) as info, subclass_ca.enable():
        forward(torch.randn(3, 4)).sin().sum().backward()
    assert isinstance(info.value, subclass_ca.HookOnSubclassError), repr(info.value)  # our cause, not a graph break
    chain = [info.value]
    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    assert model.second.weight.grad is None
    return "\n".join(str(e) for e in chain)


def test_module_hook_returning_none_for_a_subclass_gradient_names_the_subclass_and_the_fix():
    text = _error_text(lambda mod, grad_input, grad_output: tuple(None for _ in grad_input))
    assert "returned None in place of a TwoTensor gradient" in text and "Return the gradient unchanged there" in text


def test_module_hook_returning_the_wrong_structure_names_the_cause_and_the_fix():
    text = _error_text(lambda mod, grad_input, grad_output: grad_input[0] * 2.0)
    assert "returned TwoTensor in place of 1 gradients" in text and "return None or a tuple with one gradient per place" in text


# --- a module none of whose inputs requires grad (Note [Post hooks of a module whose inputs need no gradient]) --


class PlainTwoLayers(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(3)
        self.first = torch.nn.Linear(4, 4)
        self.head = torch.nn.Linear(4, 3)
        with torch.no_grad():
            for param in self.parameters():
                param.copy_(torch.randn(param.shape, generator=generator))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.first(x).relu())


def _train_first_hooked(model_type: type, backend: str | None, context_factory) -> tuple[torch.nn.Module, list]:
    """Both hooks on ``model.first``, whose input (the data) requires no grad: torch calls the post hook
    from the output side, with ``grad_input == (None,)``."""
    model = model_type()
    seen: list = []
    model.first.register_full_backward_pre_hook(lambda mod, grad_output: seen.append(("pre", _copies(grad_output))))
    model.first.register_full_backward_hook(
        lambda mod, grad_input, grad_output: seen.append(("post", _copies(grad_input), _copies(grad_output)))
    )
    forward = torch.compile(model, backend=backend) if backend else model
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with context_factory(), pytest.warns(UserWarning, match="no inputs require gradients"):
        for index in range(STEPS):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(20 + index))
            optimizer.zero_grad()
            forward(x).sin().sum().backward()
            optimizer.step()
    return model, seen


def _assert_first_hooked_matches_eager(model_type: type, backend: str) -> None:
    eager, eager_seen = _train_first_hooked(model_type, None, contextlib.nullcontext)
    model, seen = _train_first_hooked(model_type, backend, lambda: subclass_ca.enable(backend=backend))
    exact = backend == "aot_eager"
    assert [entry[0] for entry in eager_seen] == ["pre", "post"] * STEPS
    assert [entry[0] for entry in seen] == ["pre", "post"] * STEPS  # the post hook ran every step, after the pre hook
    for got, want in zip(seen, eager_seen):
        if got[0] == "post":
            assert got[1] == want[1] == [None]  # grad_input: the data needs no gradient
        for got_grad, want_grad in zip(got[-1], want[-1]):
            assert type(got_grad) is type(want_grad)
            assert_same_grad(want_grad, got_grad, exact=exact)
    for param, eager_param in zip(model.parameters(), eager.parameters()):
        assert_same_grad(eager_param.grad, param.grad, exact=exact)
        assert_same_grad(eager_param.detach(), param.detach(), exact=exact)


@pytest.mark.parametrize("model_type", [PlainTwoLayers, TwoLayers], ids=["plain", "two_tensor"])
def test_post_hook_of_a_module_whose_inputs_need_no_grad_runs_every_step_like_eager(model_type):
    _assert_first_hooked_matches_eager(model_type, "aot_eager")


@pytest.mark.inductor
def test_post_hook_of_a_module_whose_inputs_need_no_grad_runs_every_step_like_eager_inductor():
    _assert_first_hooked_matches_eager(TwoLayers, "inductor")


def test_stock_compiled_autograd_drops_the_post_hook_of_a_module_whose_inputs_need_no_grad():
    """What the fix is for: torch's own path loses the post hook silently (plain weights, no subclass)."""

    def compiler_fn(gm: torch.fx.GraphModule):
        return torch.compile(gm, backend="aot_eager", fullgraph=True)

    _, seen = _train_first_hooked(PlainTwoLayers, "aot_eager", lambda: _compat.enable_compiled_autograd(compiler_fn, dynamic=True))
    assert [entry[0] for entry in seen] == ["pre"] * STEPS


def test_post_hook_of_a_module_whose_inputs_need_no_grad_returning_gradients_is_refused_like_eager():
    """Eager raises when that hook returns gradients; so do we, before any gradient exists (not silently ignored)."""
    model = PlainTwoLayers()
    model.first.register_full_backward_hook(lambda mod, grad_input, grad_output: (grad_output[0] * 2.0,))
    with pytest.raises(RuntimeError, match="no input requires gradient should always return None"), pytest.warns(UserWarning):
        model(torch.randn(3, 4)).sum().backward()
    model.zero_grad(set_to_none=True)
    forward = torch.compile(model, backend="aot_eager")
    with pytest.raises(subclass_ca.HookOnSubclassError) as info, pytest.warns(UserWarning), subclass_ca.enable():
        forward(torch.randn(3, 4)).sum().backward()
    text = str(info.value)
    assert "none of whose inputs requires grad returned gradients" in text and "Return None from that hook" in text
    assert all(param.grad is None for param in model.parameters())

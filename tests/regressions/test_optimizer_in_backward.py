"""Hooks that need a graph break in the backward graph (issue 16.2): optimizer-in-backward.

PyTorch's optimizer-in-backward pattern steps one optimizer per parameter from a
post-accumulate-grad hook.  A ``torch.optim`` step is compiled into the CA graph under the
default ``fullgraph=True`` (issue 59; the whole matrix is in tests/test_optimizer_in_backward.py);
``enable(fullgraph=False)`` trains == eager and the capture report lists the breaks; a hook whose
code Dynamo cannot trace raises GraphBreakError under the default, naming the code and the option,
before any parameter changes.
"""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca.testing.subclasses import make_pair
from tests.helpers import assert_same_grad


def _model():
    torch.manual_seed(0)
    pair = torch.nn.Parameter(make_pair(torch.randn(4, 4)))
    linear = torch.nn.Linear(4, 3)
    return pair, linear


def _untraceable_step(param):
    torch._dynamo.graph_break()  # Python Dynamo must not trace: a graph break in the hook itself
    with torch.no_grad():
        param.sub_(param.grad * 0.1)
    param.grad = None


def _attach_optimizers(params, untraceable=False):
    if untraceable:
        for p in params:
            p.register_post_accumulate_grad_hook(_untraceable_step)
        return
    optimizers = {p: torch.optim.SGD([p], lr=0.1) for p in params}

    def step_in_backward(param):
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in params:
        p.register_post_accumulate_grad_hook(step_in_backward)


def _train(backend, steps=3, untraceable=False, **enable_kwargs):
    pair, linear = _model()
    params = [pair, *linear.parameters()]
    _attach_optimizers(params, untraceable)
    loss_fn = lambda x: linear(x @ pair).sin().sum()  # noqa: E731
    forward = torch.compile(loss_fn, backend=backend) if backend else loss_fn
    for step in range(steps):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        loss = forward(x)
        if backend:
            with subclass_ca.enable(backend=backend, **enable_kwargs):
                loss.backward()
        else:
            loss.backward()
    return [p.detach() for p in params]


@pytest.mark.isolated(reason="torch 2.11 stock compiled autograd segfaults in gc after an optimizer-in-backward run")
@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks-allowed"])
@pytest.mark.parametrize("untraceable", [False, True], ids=["torch-optim", "untraceable-hook"])
def test_optimizer_in_backward_under_aot_eager_runs_the_hooks_eagerly_between_compiled_pieces(untraceable, fullgraph):
    """aot_eager (and a subclass parameter under any backend) never compiles a step in: the graph is split at the
    hooks (Note [Optimizer steps compiled into the CA graph]), so even Python Dynamo cannot trace trains, == eager."""
    eager = _train(None, untraceable=untraceable)
    ours = _train("aot_eager", untraceable=untraceable, fullgraph=fullgraph)
    for want, got in zip(eager, ours):
        assert_same_grad(want, got, exact=False)
    report = subclass_ca.last_report()
    assert report.split_hooks and not report.graph_breaks, report.summary()
    assert "run eagerly" in report.summary()


def _plain_model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)


@pytest.mark.parametrize("fullgraph", [True, False], ids=["fullgraph", "graph-breaks-allowed"])
def test_an_untraceable_hook_under_inductor_raises_graph_break_error_or_trains_with_breaks(fullgraph):
    """Under inductor plain parameters' hooks are compiled in; one Dynamo cannot trace needs a graph break, which the
    default refuses (GraphBreakError naming the hook, before any update) and fullgraph=False takes, in eager's
    order, == eager.  Dynamo fails while tracing, before inductor compiles anything."""
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(7))
    expected_first, expected_second = _plain_model()
    expected = [*expected_first.parameters(), *expected_second.parameters()]
    _attach_optimizers(expected, untraceable=True)
    expected_second(torch.tanh(expected_first(x))).sin().sum().backward()
    first, second = _plain_model()
    params = [*first.parameters(), *second.parameters()]
    before = [p.detach().clone() for p in params]
    _attach_optimizers(params, untraceable=True)
    loss = torch.compile(lambda x: second(torch.tanh(first(x))).sin().sum(), backend="aot_eager")(x)
    if fullgraph and _compat.steps_compile_in():
        with pytest.raises(subclass_ca.GraphBreakError, match=r"fullgraph=False") as info:
            with subclass_ca.enable(backend="inductor"):
                loss.backward()
        assert "post_acc_grad_hook _untraceable_step (test_optimizer_in_backward.py:" in str(info.value)
        for want, got in zip(before, params):  # raised before any update
            assert_same_grad(want, got.detach())
        return
    with subclass_ca.enable(backend="inductor", fullgraph=fullgraph):
        loss.backward()
    for want, got in zip(expected, params):
        assert_same_grad(want.detach(), got.detach(), exact=False)
    report = subclass_ca.last_report()
    if not _compat.steps_compile_in():  # this torch compiles no hook in: they run eagerly between pieces
        assert report.split_hooks and not report.graph_breaks, report.summary()
    else:
        assert report.graph_breaks and not report.split_hooks, report.summary()


def test_fullgraph_is_a_setting_not_a_compile_kwarg():
    assert subclass_ca.enable(fullgraph=False).config.fullgraph is False
    with pytest.raises(ValueError, match="fullgraph"):
        subclass_ca.Config(compile_kwargs={"fullgraph": False})
    with pytest.raises(ValueError, match="fullgraph"):
        subclass_ca.Config(fullgraph="no")  # type: ignore[arg-type]

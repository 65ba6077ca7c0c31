"""enable() without a backend compiles the CA graph the way the forwards were compiled (Note [Defaults follow the user])."""

from __future__ import annotations

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca.config import DEFAULT_BACKEND, Config, cache_key, followed
from subclass_ca.testing.subclasses import make_pair
from tests.helpers import assert_same_grad


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


def _eager_grads(x: torch.Tensor) -> list[torch.Tensor]:
    model = _model()
    model(x).sum().backward()
    return _grads(model)


@pytest.mark.parametrize(
    ("forwards", "expected"),
    [
        ([], "inductor"),
        (["aot_eager"], "aot_eager"),
        (["aot_eager", "aot_eager"], "aot_eager"),
        (["inductor", "inductor"], "inductor"),
        (["aot_eager", "inductor"], "inductor"),
        ([None], "inductor"),
        (["aot_eager", None], "inductor"),
    ],
)
def test_backend_none_follows_one_named_forward_backend_else_torch_compiles_default(forwards, expected):
    assert followed(Config(), forwards).backend == expected
    assert DEFAULT_BACKEND == "inductor"


def test_an_explicit_backend_is_never_resolved():
    config = Config(backend="aot_eager")
    assert followed(config, ["inductor"]) is config


def test_the_default_config_has_no_backend_and_its_own_cache_key():
    assert Config().backend is None
    assert cache_key(Config()) != cache_key(Config(backend="inductor"))
    assert cache_key(Config()) != cache_key(Config(backend="aot_eager"))


def test_forward_backend_names_an_aot_eager_forward():
    weight = torch.nn.Parameter(make_pair(torch.randn(4, 4)))
    out = torch.compile(lambda x: (x @ weight).sum(), backend="aot_eager")(torch.randn(2, 4))
    assert _compat.forward_backend(out.grad_fn) == "aot_eager"
    assert _compat.forward_backend(torch.randn(2, requires_grad=True).exp().grad_fn) is None


def test_bare_enable_with_an_aot_eager_forward_compiles_the_ca_graph_with_aot_eager():
    x = torch.randn(4, 8)
    model = _model()
    forward = torch.compile(model, backend="aot_eager")
    with subclass_ca.enable():
        forward(x).sum().backward()
    report = subclass_ca.last_report()
    assert report.backend == "aot_eager"
    assert dict(report.forward_backends) == {"aot_eager": 1}
    for expected, actual in zip(_eager_grads(x), _grads(model)):
        assert_same_grad(expected, actual)  # aot_eager: bitwise


def test_explicit_backend_wins_over_the_followed_one():
    x = torch.randn(4, 8)
    model = _model()
    with subclass_ca.enable(backend="aot_eager"):
        model(x).sum().backward()  # an eager forward: a bare enable() would follow with inductor
    assert subclass_ca.last_report().backend == "aot_eager"
    for expected, actual in zip(_eager_grads(x), _grads(model)):
        assert_same_grad(expected, actual)


@pytest.mark.inductor
def test_bare_enable_with_an_eager_forward_compiles_the_ca_graph_with_inductor():
    x = torch.randn(4, 8)
    model = _model()
    with subclass_ca.enable():
        model(x).sum().backward()
    report = subclass_ca.last_report()
    assert report.backend == "inductor"
    assert report.aot_backwards == 0 and not report.forward_backends
    for expected, actual in zip(_eager_grads(x), _grads(model)):
        torch.testing.assert_close(actual, expected)


@pytest.mark.inductor
def test_bare_enable_with_an_inductor_forward_compiles_the_ca_graph_with_inductor():
    x = torch.randn(4, 8)
    model = _model()
    forward = torch.compile(model)  # torch.compile's default: inductor
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with subclass_ca.enable():
            forward(x).sum().backward()
    report = subclass_ca.last_report()
    assert report.backend == "inductor"
    assert dict(report.forward_backends) == {"inductor": 1}
    assert report.runs == 2, "the second step reuses the CA graph compiled with the followed backend"
    for expected, actual in zip(_eager_grads(x), _grads(model)):
        torch.testing.assert_close(actual, expected)

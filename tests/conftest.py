"""Shared fixtures: backends and devices are parametrized from here, never by copy-paste."""

from __future__ import annotations

import pytest
import torch

import subclass_ca

BACKENDS = [
    pytest.param("aot_eager", id="aot_eager"),
    pytest.param("inductor", id="inductor", marks=pytest.mark.inductor),
]
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def fresh_compile_state():
    """Every test starts from empty Dynamo / compiled-autograd caches and counters."""
    subclass_ca.reset()
    torch._dynamo.utils.counters.clear()
    yield
    subclass_ca.reset()

"""Tiny models the trainer integrations train: one whose gradient is a subclass, one QLoRA.

* :class:`TwoTensorRegressor`: a linear layer whose trainable weight is torch's ``TwoTensor`` (its gradient is
  a ``TwoTensor`` too, rebuilt by subclass_ca's epilogue node in the CA graph);
* :class:`QLoRARegressor`: a frozen torchao NF4 base with trainable LoRA adapters (the torchao the extra allows).

Both take ``x`` and ``labels`` and return ``{"loss": ..., "logits": ...}``, the shape the HF Trainer reads;
``compile_backend`` compiles the forward's core (``torch.compile``), so its backward is an AOT backward that
compiled autograd pastes into its graph.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

import pytest
import torch
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

DIM = 128
BATCH = 4
ROWS = 16


def _core(module: nn.Module, compile_backend: str | None) -> Any:
    return torch.compile(module.compute, backend=compile_backend) if compile_backend else module.compute


class TwoTensorRegressor(nn.Module):
    def __init__(self, compile_backend: str | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        dense = torch.randn(DIM, DIM) * 0.05
        self.weight = nn.Parameter(TwoTensor(dense.clone(), dense * 2.0))
        self.bias = nn.Parameter(torch.zeros(DIM))
        self._compute = _core(self, compile_backend)

    def compute(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = torch.nn.functional.linear(x, self.weight, self.bias)
        # the logits are returned detached: a compiled function whose subclass output needs a gradient that
        # backward() never gives fails in torch.compile alone (AOT's tangent metadata check)
        return (logits - labels).pow(2).mean(), logits.detach()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss, logits = self._compute(x, labels)
        return {"loss": loss, "logits": logits}


def nf4_module() -> Any:
    """torchao's NF4 module, wherever this torchao keeps it (skips without torchao)."""
    from subclass_ca._builtin_handlers.torchao import NF4_MODULES

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchao")
        for name in NF4_MODULES:
            try:
                return importlib.import_module(name)
            except ImportError:
                continue
    pytest.fail(f"this torchao keeps NF4Tensor in none of {NF4_MODULES}")


class QLoRARegressor(nn.Module):
    def __init__(self, compile_backend: str | None = None, rank: int = 4) -> None:
        super().__init__()
        nf4 = nf4_module()
        torch.manual_seed(0)
        self.linear_nf4 = nf4.linear_nf4
        self.base = nn.Parameter(nf4.to_nf4(torch.randn(DIM, DIM) * 0.05), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, DIM) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(DIM, rank) * 0.01)
        self._compute = _core(self, compile_backend)

    def compute(self, x: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.linear_nf4(x, self.base) + x @ self.lora_a.t() @ self.lora_b.t()
        return (logits - labels).pow(2).mean(), logits

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        loss, logits = self._compute(x, labels)
        return {"loss": loss, "logits": logits}


MODELS = {"two_tensor": TwoTensorRegressor, "qlora": QLoRARegressor}


def rows() -> list[dict[str, torch.Tensor]]:
    """A fixed regression set: ``ROWS`` examples of ``x`` and ``labels``."""
    generator = torch.Generator().manual_seed(1)
    xs = torch.randn(ROWS, DIM, generator=generator)
    labels = torch.randn(ROWS, DIM, generator=generator)
    return [{"x": x, "labels": y} for x, y in zip(xs, labels)]


def trained_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The trainable parameters after training, inner tensors of a subclass included (``TwoTensor``: a and b)."""
    state = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        detached = param.detach()
        if isinstance(detached, TwoTensor):
            state[f"{name}.a"], state[f"{name}.b"] = detached.a.clone(), detached.b.clone()
        else:
            state[name] = detached.clone()
    return state


def assert_no_block_open() -> None:
    """A backward now runs eagerly, uncaptured: no ``enable()`` block was left open."""
    import subclass_ca

    before = subclass_ca.cache_stats()
    x = torch.randn(2, 3, requires_grad=True)
    (x * 2).sum().backward()
    assert subclass_ca.cache_stats() == before
    assert torch.equal(x.grad, torch.full_like(x, 2.0))


def assert_same_training(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> None:
    """Bitwise: the forwards are aot_eager-compiled or eager, and so is the CA graph."""
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")

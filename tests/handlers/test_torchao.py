"""Built-in torchao NF4 handler (optional extra): frozen NF4 base + LoRA trains like eager, on every torchao the
extra allows (0.15-0.17 keep NF4Tensor in torchao.dtypes.nf4tensor, 0.18 in torchao.quantization; CI runs this file
with 0.18 and with 0.15: ``make test-torchao015``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings

import pytest
import torch

import subclass_ca
from subclass_ca._builtin_handlers import torchao as torchao_handler
from subclass_ca.testing import torchao_specs


def _import_nf4():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pytest.importorskip("torchao")
        for module_name in torchao_handler.NF4_MODULES:
            try:
                return importlib.import_module(module_name)
            except ImportError:
                continue
    import torchao

    pytest.fail(f"torchao {torchao.__version__} has NF4Tensor in none of {torchao_handler.NF4_MODULES}: add its module")


nf4 = _import_nf4()


def _lora_step(use_ca, steps=3, device="cpu"):
    torch.manual_seed(0)
    base = nf4.to_nf4(torch.randn(128, 128).to(device))
    lora_a = torch.nn.Parameter(torch.randn(128, 4).to(device) * 0.1)
    lora_b = torch.nn.Parameter(torch.zeros(4, 128, device=device))
    opt = torch.optim.SGD([lora_a, lora_b], lr=0.1)

    def forward(x):
        return (nf4.linear_nf4(x, base) + x @ lora_a @ lora_b).pow(2).mean()

    step = torch.compile(forward, backend="aot_eager") if use_ca else forward
    losses = []
    for i in range(steps):
        x = torch.randn(8, 128, generator=torch.Generator().manual_seed(i)).to(device)
        opt.zero_grad()
        loss = step(x)
        if use_ca:
            with subclass_ca.enable():
                loss.backward()
        else:
            loss.backward()
        opt.step()
        losses.append(loss.detach())
    return torch.stack(losses), lora_a.detach(), lora_b.detach()


def test_nf4_frozen_base_with_lora_matches_eager(device):
    expected = _lora_step(use_ca=False, device=device)
    subclass_ca.reset()
    actual = _lora_step(use_ca=True, device=device)
    for want, got in zip(expected, actual):
        torch.testing.assert_close(got, want)


def test_nf4_handler_registers_lazily_on_first_lookup():
    handler = subclass_ca.get_handler(nf4.NF4Tensor)
    assert not handler.is_default
    assert nf4.NF4Tensor in subclass_ca.handlers()
    ctx = nf4.to_nf4(torch.randn(128, 128)).__tensor_flatten__()[1]
    hash(handler.metadata_key(ctx))


def test_nf4_handler_waits_on_the_module_this_torchao_defines_nf4tensor_in():
    assert f"{nf4.NF4Tensor.__module__}.{nf4.NF4Tensor.__qualname__}" in torchao_handler.NF4_QUALNAMES


def test_nf4_handler_and_check_spec_name_the_same_modules():
    assert torchao_specs.NF4_MODULES == torchao_handler.NF4_MODULES


def test_check_certifies_nf4_on_this_torchao():
    assert "nf4" not in torchao_specs.unavailable_torchao_specs()
    assert isinstance(torchao_specs.torchao_specs()["nf4"].make_tensor(torch.randn(8, 8)), nf4.NF4Tensor)


def test_importing_subclass_ca_does_not_import_torchao():
    code = "import sys, subclass_ca; sys.exit(int('torchao' in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], timeout=300).returncode == 0

"""Built-in torchao NF4 handler (optional extra): frozen NF4 base + LoRA trains like eager."""

from __future__ import annotations

import warnings

import pytest
import torch

import subclass_ca

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    nf4 = pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")


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

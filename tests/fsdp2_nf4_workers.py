"""Workers for FSDP2 over NF4 QLoRA blocks (issue 45.2): module level, so ``run_workers`` can pickle them."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim: int, rank: int = 4) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        self.base = nn.Parameter(to_nf4(torch.randn(dim, dim) * 0.1, block_size=32, scaler_block_size=8), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return nn.functional.silu(linear_nf4(x, self.base) + x @ self.lora_a.t() @ self.lora_b.t())


class Model(nn.Module):
    def __init__(self, dim: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def train(rank: int, world_size: int, mode: str, block_scope: str, steps: int = 3) -> list[torch.Tensor]:
    """``mode``: eager | ours; ``block_scope``: step (forward and backward inside the block) | backward."""
    import subclass_ca
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Model()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    lora = [p for name, p in model.named_parameters() if "lora" in name]
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    forward = model if mode == "eager" else torch.compile(model, backend="aot_eager")
    losses = []
    for step in range(steps):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * rank + step))
        block = subclass_ca.enable(backend="aot_eager") if mode == "ours" else contextlib.nullcontext()
        if block_scope == "step":
            with block:
                loss = forward(x).sin().sum()
                loss.backward()
        else:
            loss = forward(x).sin().sum()
            with block:
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return losses + [p.full_tensor().detach() for p in lora]


def train_both(rank: int, world_size: int, mode: str) -> dict[str, list[torch.Tensor]]:
    """:func:`train` with the forward inside the block and outside it, in one process per rank."""
    results = {}
    for scope in ("step", "backward"):
        torch._dynamo.reset()
        results[scope] = train(rank, world_size, mode, scope)
    return results

"""Workers for FSDP2 over NF4 QLoRA blocks (issue 45): module level, so ``run_workers`` can pickle them.

Every training style of issue 45.2, each under eager FSDP2, stock compiled autograd and subclass_ca:

* ``step`` — compiled forward and backward inside the block;
* ``backward`` — compiled forward outside the block, only the backward inside;
* ``checkpoint_clip`` — each block under non-reentrant activation checkpointing, ``clip_grad_norm_`` in place;
* ``dcp_resume`` — two steps, a DCP save, a fresh model and optimizer loaded from it, a third step;
* ``flag`` — ``torch._dynamo.config.compiled_autograd = True`` around a compiled train step that calls
  ``loss.backward()`` (stock's own switch; subclass_ca's block around it as well).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.nn as nn

MODES = ("eager", "stock", "ours")
STYLES = ("step", "backward", "checkpoint_clip", "dcp_resume", "flag")


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
    def __init__(self, dim: int = 64, depth: int = 2, checkpoint: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(depth))
        self.head = nn.Linear(dim, 4)
        self.checkpoint = checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            if self.checkpoint:
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(x)


def _sharded(checkpoint: bool, seed: int = 0) -> tuple[Model, list[nn.Parameter], torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = Model(checkpoint=checkpoint)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    lora = [p for name, p in model.named_parameters() if "lora" in name]
    return model, lora, torch.optim.AdamW(lora, lr=1e-2)


def _ca_block(mode: str, style: str) -> contextlib.AbstractContextManager:
    import subclass_ca
    from subclass_ca import _compat

    if mode == "ours":
        return subclass_ca.enable(backend="aot_eager")
    if mode == "stock" and style != "flag":
        return _compat.enable_compiled_autograd(lambda gm: torch.compile(gm, backend="aot_eager"))
    return contextlib.nullcontext()


def _save_and_reload(model: Model, optimizer: torch.optim.Optimizer, path: str) -> tuple[Model, list, torch.optim.Optimizer]:
    """DCP save of model and optimizer, then a fresh (differently seeded) model and optimizer loaded from it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    fresh, lora, fresh_optimizer = _sharded(checkpoint=False, seed=1)
    model_state, optim_state = get_state_dict(fresh, fresh_optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(fresh, fresh_optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return fresh, lora, fresh_optimizer


def train(rank: int, world_size: int, mode: str, style: str, folder: str, steps: int = 3) -> list[torch.Tensor]:
    """Losses and the adapters' full tensors after ``steps`` AdamW steps (``mode`` in MODES, ``style`` in STYLES)."""
    model, lora, optimizer = _sharded(checkpoint=style == "checkpoint_clip")
    losses = []
    for index in range(steps):
        if style == "dcp_resume" and index == steps - 1:
            model, lora, optimizer = _save_and_reload(model, optimizer, os.path.join(folder, f"{mode}-dcp"))
        forward = model if mode == "eager" else torch.compile(model, backend="aot_eager")

        def step(x: torch.Tensor) -> torch.Tensor:
            loss = forward(x).sin().sum()  # noqa: B023 - step runs in this iteration only
            loss.backward()
            return loss.detach()

        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(10 * rank + index))
        if style == "backward":
            loss = forward(x).sin().sum()
            with _ca_block(mode, style):
                loss.backward()
            loss = loss.detach()
        elif style == "flag" and mode != "eager":
            with torch._dynamo.config.patch(compiled_autograd=True), _ca_block(mode, style):
                loss = torch.compile(step, backend="aot_eager")(x)
        else:
            with _ca_block(mode, style):
                loss = step(x)
        if style == "checkpoint_clip":
            torch.nn.utils.clip_grad_norm_(lora, max_norm=0.05)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss)
    return losses + [p.full_tensor().detach() for p in lora]


def _outcome(call: functools.partial) -> list[torch.Tensor] | str:
    """The values, or ``"<ExceptionType>: <first line>"`` where the run raised (compared between modes)."""
    try:
        return call()
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as error:  # noqa: BLE001 - the outcome *is* the exception (DCP's is a BaseException)
        lines = str(error).strip().splitlines()
        return f"{type(error).__name__}: {lines[0] if lines else ''}"


def train_all(rank: int, world_size: int, folder: str, modes=MODES, styles=STYLES) -> dict[str, list[torch.Tensor] | str]:
    """Every (mode, style) in one process per rank: ``{"<mode> <style>": values or error summary}``."""
    import subclass_ca

    results = {}
    for style in styles:
        for mode in modes:
            torch._dynamo.reset()
            subclass_ca.reset()
            results[f"{mode} {style}"] = _outcome(functools.partial(train, rank, world_size, mode, style, folder))
    return results

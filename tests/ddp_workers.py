"""Worker functions for the DDP tests (module level: ``run_workers`` pickles them)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import subclass_ca
from subclass_ca import _compat

TwoTensor = _compat.two_tensor_type()


class NF4LoRA(torch.nn.Module):
    """A frozen torchao NF4 base weight plus a trainable rank-2 LoRA adapter (QLoRA)."""

    def __init__(self, dim: int = 64, rank: int = 2) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        self.base = torch.nn.Parameter(to_nf4(torch.randn(dim, dim) * 0.1, block_size=32, scaler_block_size=8),
                                       requires_grad=False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = torch.nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return torch.tanh(linear_nf4(x, self.base) + x @ self.lora_a.t() @ self.lora_b.t())


def has_torchao() -> bool:
    try:
        import torchao  # noqa: F401
    except ImportError:
        return False
    return True


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if kind == "nf4_lora":
        return torch.nn.Sequential(torch.nn.Linear(8, 64), NF4LoRA(), NF4LoRA(), torch.nn.Linear(64, 4))
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    if kind == "two_tensor":
        for layer in (model[0], model[2]):
            dense = layer.weight.detach()
            layer.weight = torch.nn.Parameter(TwoTensor(dense.clone(), dense * 0.5))
    elif kind == "unused":
        model.append(torch.nn.Linear(4, 4))  # never called: find_unused_parameters
    return model


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    if _compat.is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in _inner(getattr(t, name))]
    return [t.detach().clone()]


def _inner_views(t: torch.Tensor) -> list[torch.Tensor]:
    if _compat.is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in _inner_views(getattr(t, name))]
    return [t]


def train(rank: int, world_size: int, kind: str, mode: str, optimize_ddp, style: str, steps: int = 3) -> list[torch.Tensor]:
    """``mode``: eager (eager DDP) | manual (no DDP: each inner gradient all-reduced by hand, the definition of data
    parallel) | ours; ``style``: forward (a compiled forward) | step (a compiled train step) | no_sync |
    inductor (a compiled forward, everything compiled with inductor: Note [Bucketing the Python reducer's
    all-reduces])."""
    if optimize_ddp != "default":
        torch._dynamo.config.optimize_ddp = optimize_ddp
    model = _model(kind)
    ddp = model if mode == "manual" else DistributedDataParallel(model, find_unused_parameters=kind == "unused")
    optimizer = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.1)
    backend = "inductor" if style == "inductor" else "aot_eager"
    forward = ddp if mode in ("eager", "manual") else torch.compile(ddp, backend=backend)

    def step(x):
        loss = forward(x).sin().sum()
        loss.backward()
        return loss.detach()

    run = torch.compile(step, backend="aot_eager") if mode == "ours" and style == "step" else step
    for index in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * rank + index))
        block = subclass_ca.enable(backend=backend) if mode == "ours" else contextlib.nullcontext()
        flag = torch._dynamo.config.patch(compiled_autograd=True) if style == "step" and mode == "ours" else contextlib.nullcontext()
        with flag, block:
            if style == "no_sync":  # two micro-batches, the first without all-reduce
                with ddp.no_sync() if mode != "manual" else contextlib.nullcontext():
                    run(x)
                run(x * 0.5)
            else:
                run(x)
        if mode == "manual":
            for p in model.parameters():
                for inner in _inner_views(p.grad) if p.grad is not None else ():
                    dist.all_reduce(inner.div_(world_size))
        optimizer.step()
        optimizer.zero_grad()
    # the parameters, and whether the block left torch's optimize_ddp as the program set it
    flag_kept = torch._dynamo.config.optimize_ddp == (optimize_ddp if optimize_ddp != "default" else "ddp_optimizer")
    return [inner for p in model.parameters() if p.requires_grad for inner in _inner(p)] + [torch.tensor(float(flag_kept))]


CASES = (
    ("two_tensor", "default", "forward"),
    ("two_tensor", False, "forward"),
    ("two_tensor", "ddp_optimizer", "step"),
    ("two_tensor", "python_reducer", "forward"),
    ("two_tensor", "default", "inductor"),
    ("plain", "default", "no_sync"),
    ("unused", "default", "forward"),
) + ((("nf4_lora", "default", "forward"), ("nf4_lora", False, "step")) if has_torchao() else ())
"""(model kind, optimize_ddp, style) of every DDP program the tests train (the NF4 QLoRA ones with torchao)."""


def train_all(rank: int, world_size: int, mode: str, cases=CASES) -> dict[str, list[torch.Tensor]]:
    """:func:`train` for every case in one process per rank (one start of torch, not one per case)."""
    results = {}
    default = torch._dynamo.config.optimize_ddp
    for kind, optimize_ddp, style in cases:
        torch._dynamo.config.optimize_ddp = default
        torch._dynamo.reset()
        reference_style = style if style == "no_sync" or mode == "ours" else "forward"
        _compat.dynamo_counters()["inductor"].pop("ddp_buckets", None)
        results[f"{kind} optimize_ddp={optimize_ddp!r} {style}"] = train(rank, world_size, kind, mode, optimize_ddp, reference_style)
        if mode == "ours":  # how many buckets the graph passes made of the reducer's all-reduces
            results[f"{kind} optimize_ddp={optimize_ddp!r} {style} ddp_buckets"] = [
                torch.tensor(_compat.dynamo_counters()["inductor"].get("ddp_buckets", 0))]
    return results

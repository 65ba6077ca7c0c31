"""QLoRA fine-tuning with a compiled model and subclass_ca (single process).

Run::

    python examples/qlora.py                                 # inductor, 20 AdamW steps, CPU
    python examples/qlora.py --backend aot_eager --steps 5 --check
    python examples/qlora.py --device cuda --check

Needs torchao (``pip install torchao``; tested with torchao 0.18.0 on torch 2.13 and 2.15).

The model is a small stack of pre-norm transformer blocks (RMSNorm -> causal attention ->
residual -> RMSNorm -> SwiGLU -> residual).  Every projection is a ``LoRALinear``: its base
weight is quantized to torchao's 4-bit ``NF4Tensor`` and frozen (an ``nn.Parameter`` with
``requires_grad=False``), and it learns a low-rank update through two plain fp32 adapters,
``lora_a`` and ``lora_b``.  The base is applied with torchao's ``linear_nf4``.  Only the
adapters are trained, with AdamW.  The forward is ``torch.compile(model, backend=...)``;
``loss.backward()`` runs inside ``subclass_ca.enable(backend=...)``, so the backward is
captured by compiled autograd and compiled with the same backend.

``--check`` trains the same model a second time in plain eager (same initial weights, same
batches) and compares the per-step losses and the final adapters with
``torch.testing.assert_close``; the exit status is 1 on a mismatch.  It also checks that the
frozen NF4 weights got no gradient and did not change, and that every adapter gradient was a
plain tensor.

What subclass_ca's NF4 handler does and does not do here
--------------------------------------------------------
* A frozen NF4 weight gets **no gradient**: it has ``requires_grad=False`` and
  ``linear_nf4``'s backward returns ``None`` for it (it only computes the input gradient from
  the dequantized weight).  So nothing ever quantizes a gradient to NF4, and the optimizer
  sees only the adapters, whose gradients are plain ``torch.Tensor``s.
* Compiled autograd's backward graph therefore contains no NF4 tensor construction at all:
  the capture report (``subclass_ca.last_report()``, printed at the end) shows 0 NF4 nodes,
  and ``--check`` asserts it.  The NF4 weight enters the compiled forward as a graph input;
  its backward only reads the weight's inner tensors.  What subclass_ca adds for this model
  is the capture of the backward itself (one compiled backward graph, ``fullgraph=True``),
  not NF4 handling.
* subclass_ca registers a handler for ``NF4Tensor`` (``subclass_ca._builtin_handlers.torchao``,
  registered lazily, without importing torchao).  It is used only if compiled autograd's
  backward epilogue had to build an ``NF4Tensor`` (an NF4-typed gradient); it would then
  rebuild it with ``NF4Tensor.__tensor_unflatten__`` (the protocol default), one graph
  callable per distinct block sizes / shape / strides / dtype / device (its metadata key,
  since NF4's flatten context is an unhashable dict).  QLoRA never
  produces one, and this script does not exercise that path.
* It does not train NF4 weights, does not dequantize or requantize anything, and does not
  change torchao's numerics: the losses equal eager's (bitwise with ``aot_eager`` on CPU,
  within float tolerance with ``inductor``, which fuses).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import subclass_ca

with warnings.catch_warnings():  # torchao warns that its CUDA extensions cannot load on a CPU-only build
    warnings.simplefilter("ignore")
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import NF4Tensor, linear_nf4, to_nf4

DIM = 64
HEADS = 4
FFN = 128
BLOCKS = 2
BATCH = 4
SEQ = 16
RANK = 8
ALPHA = 16.0
LR = 1e-2


def nf4(weight: torch.Tensor) -> NF4Tensor:
    """4-bit NF4 with blocks of 64 values and at least 8 scaler blocks.

    torchao's default scaler block (256 blocks) needs weights of 16384+ values; here the
    scaler block divides the number of blocks 8 times, so that FSDP2 can split every inner
    tensor of the weight along dim 0 across up to 8 ranks (``examples/qlora_fsdp2.py``).
    """
    blocks = weight.numel() // 64
    return to_nf4(weight.contiguous(), 64, math.gcd(256, blocks // 8))


class LoRALinear(nn.Module):
    """``y = linear_nf4(x, W_nf4) + (alpha / rank) * x A^T B^T`` with ``W_nf4`` frozen, ``A``/``B`` trainable."""

    def __init__(self, in_features: int, out_features: int, generator: torch.Generator, device: str) -> None:
        super().__init__()
        weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
        self.weight = nn.Parameter(nf4(weight.to(device)), requires_grad=False)
        self.lora_a = nn.Parameter((torch.randn(RANK, in_features, generator=generator) / in_features**0.5).to(device))
        # standard LoRA starts B at zero; a small nonzero B makes every adapter get a gradient from step 0
        self.lora_b = nn.Parameter((0.01 * torch.randn(out_features, RANK, generator=generator)).to(device))
        self.scaling = ALPHA / RANK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_nf4(x, self.weight) + F.linear(F.linear(x, self.lora_a), self.lora_b) * self.scaling


class Block(nn.Module):
    def __init__(self, generator: torch.Generator, device: str) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(DIM, eps=1e-6, device=device)
        self.norm2 = nn.RMSNorm(DIM, eps=1e-6, device=device)
        self.q, self.k, self.v, self.o = (LoRALinear(DIM, DIM, generator, device) for _ in range(4))
        self.gate, self.up = (LoRALinear(DIM, FFN, generator, device) for _ in range(2))
        self.down = LoRALinear(FFN, DIM, generator, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        h = self.norm1(x)
        q, k, v = (p(h).view(batch, seq, HEADS, dim // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(batch, seq, dim)
        x = x + self.o(att)
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class QLoRAModel(nn.Module):
    def __init__(self, generator: torch.Generator, device: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(generator, device) for _ in range(BLOCKS))
        self.norm = nn.RMSNorm(DIM, eps=1e-6, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def build_model(seed: int, device: str) -> QLoRAModel:
    """The same initial weights for every call with the same seed; only the LoRA adapters train."""
    model = QLoRAModel(torch.Generator().manual_seed(seed), device)
    for name, param in model.named_parameters():
        param.requires_grad_("lora_" in name)  # RMSNorm weights are frozen too, as in QLoRA
    return model


def batch(seed: int, step: int, device: str, *, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Step ``step``'s ``(BATCH, SEQ, DIM)`` input and target (``rank`` gives each process its own rows)."""
    teacher = torch.randn(DIM, DIM, generator=torch.Generator().manual_seed(seed + 12345)) / DIM**0.5
    x = torch.randn(BATCH, SEQ, DIM, generator=torch.Generator().manual_seed(seed * 1000 + 100 * rank + step))
    return x.to(device), torch.tanh(x @ teacher).to(device)


def lora_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p for name, p in model.named_parameters() if p.requires_grad}


def nf4_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The frozen base weights (NF4Tensor, or under FSDP2 a DTensor whose local shard is one)."""
    out = {}
    for name, p in model.named_parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if isinstance(local, NF4Tensor):
            out[name] = p
    return out


def train(model: nn.Module, args: argparse.Namespace, *, compiled: bool, rank: int = 0,
          forward_in_block: bool = False) -> dict[str, Any]:
    """AdamW over the adapters for ``args.steps`` steps; ``compiled``: torch.compile + subclass_ca, else eager.

    ``forward_in_block``: the forward runs inside the ``enable()`` block too (what DDP needs: its reducer is
    picked at the forward), not only ``loss.backward()``."""
    forward = torch.compile(model, backend=args.backend) if compiled else model
    opt = torch.optim.AdamW(lora_parameters(model).values(), lr=args.lr)
    losses, grad_types, nf4_grads = [], set(), []
    for step in range(args.steps):
        x, target = batch(args.seed, step, args.device, rank=rank)
        opt.zero_grad(set_to_none=True)
        block = subclass_ca.enable(backend=args.backend) if compiled else contextlib.nullcontext()
        if forward_in_block:
            with block:
                loss = F.mse_loss(forward(x), target)
                loss.backward()
        else:
            loss = F.mse_loss(forward(x), target)
            with block:
                loss.backward()
        grad_types |= {_type_name(p.grad) for p in lora_parameters(model).values()}
        nf4_grads += [name for name, p in nf4_weights(model).items() if p.grad is not None]
        opt.step()
        losses.append(loss.detach())
        if rank == 0:
            print(f"step {step} loss {losses[-1].item():.6f}", flush=True)
    result: dict[str, Any] = {"losses": torch.stack(losses), "grad_types": grad_types, "nf4_grads": nf4_grads}
    if compiled:
        report = subclass_ca.last_report()
        result["nf4_nodes"] = report.nodes_for("NF4Tensor") if report is not None else None
        result["report"] = report
        result["summary"] = report.summary() if report is not None else "no capture"
    return result


def _type_name(t: torch.Tensor | None) -> str:
    """``Tensor``, ``NF4Tensor``, ...; a DTensor with its local type: ``DTensor[Tensor]``."""
    if hasattr(t, "to_local"):
        return f"{type(t).__name__}[{type(t.to_local()).__name__}]"
    return type(t).__name__


def compare(
    got: dict[str, Any],
    want: dict[str, Any],
    got_model: nn.Module,
    want_model: nn.Module,
    args: argparse.Namespace,
    *,
    grad_types: frozenset[str] = frozenset({"Tensor"}),
) -> list[str]:
    """Problems (empty: none) between the compiled run and the eager run (``grad_types``: the adapters' expected grad types)."""
    # aot_eager runs eager's kernels: default float32 tolerances.  inductor fuses, and AdamW
    # divides each update by the gradient's running RMS, so a rounding difference in a
    # near-zero gradient moves an adapter value by up to ~1e-4 after a few steps.
    tolerance = {} if args.backend == "aot_eager" else {"rtol": 1e-3, "atol": 1e-4}
    problems = []
    try:
        torch.testing.assert_close(got["losses"], want["losses"], **tolerance)
    except AssertionError as error:
        problems.append(f"losses differ from eager: {error}")
    want_params = lora_parameters(want_model)
    for name, param in lora_parameters(got_model).items():
        try:
            torch.testing.assert_close(_full(param), _full(want_params[name]), **tolerance)
        except AssertionError as error:
            problems.append(f"{name} differs from eager: {error}")
    if got["grad_types"] != grad_types:
        problems.append(f"adapter gradients should be {sorted(grad_types)} (plain local values), got {sorted(got['grad_types'])}")
    if got["nf4_grads"]:
        problems.append(f"frozen NF4 weights got a gradient: {got['nf4_grads']}")
    if got.get("nf4_nodes") != 0:
        problems.append(f"expected no NF4Tensor node in the backward graph, the capture report says {got.get('nf4_nodes')}")
    return problems


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach()


def frozen_unchanged(model: nn.Module, initial: dict[str, torch.Tensor]) -> list[str]:
    """Problems if a frozen NF4 weight's quantized data changed during training."""
    return [
        f"frozen NF4 weight {name} changed"
        for name, p in nf4_weights(model).items()
        if not torch.equal(_quantized_data(p), initial[name])
    ]


def _quantized_data(p: torch.Tensor) -> torch.Tensor:
    local = p.to_local() if hasattr(p, "to_local") else p
    return local.quantized_data.clone()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", default="inductor", help="torch.compile backend of the forward and of the backward (default: inductor)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lr", type=float, default=LR)
    parser.add_argument("--check", action="store_true", help="also train in eager from the same init and data; exit 1 unless they match")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model = build_model(args.seed, args.device)
    initial = {name: _quantized_data(p) for name, p in nf4_weights(model).items()}
    result = train(model, args, compiled=True)
    print(f"trainable {sum(p.numel() for p in lora_parameters(model).values())} adapter values, "
          f"{len(initial)} frozen NF4 weights; NF4 nodes in the backward graph: {result['nf4_nodes']}")
    print(result["summary"])
    if not args.check:
        return 0
    print("check: training the same model in eager", flush=True)
    eager_model = build_model(args.seed, args.device)
    expected = train(eager_model, args, compiled=False)
    problems = compare(result, expected, model, eager_model, args) + frozen_unchanged(model, initial)
    if problems:
        print("check FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 1
    print(f"check passed: {args.steps} losses and {len(lora_parameters(model))} adapters match eager ({args.backend})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

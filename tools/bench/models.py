"""Benchmark models: one small training step per (model kind, size), built fresh per mode.

Each :class:`Workload` owns its parameters and inputs and a ``forward_loss`` function
whose *code object is private to it* (see Note [One code object per workload]), so
Dynamo's per-code cache never mixes the forward graphs of different modes.

Note [One code object per workload]
-----------------------------------
Dynamo caches compiled frames on the code object.  Two modes that call the same Python
function share one cache list (guarded on the module/parameter ids), which both hits the
recompile limit and makes guard evaluation cost depend on how many modes ran before.
We copy the forward's code object (``code.replace(co_name=...)``) per workload, so every
mode gets its own cache, exactly as if each were the only model in the process.
Each compiled forward is also its own AOT ``CompiledFunction`` (own autograd-function id),
so compiled autograd's graph cache -- which is global and *not* keyed by the compiler
function -- keeps a separate graph per mode.
"""

from __future__ import annotations

import dataclasses
import socket
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from tools.common.models import import_nf4, nf4_unavailable

__all__ = [
    "MODELS", "SIZES", "BLOCK_SIZES", "INNER_TENSORS", "REALISTIC", "Workload", "build", "ensure_process_group",
    "unavailable",
]

#: model kind -> short description (what is a subclass)
MODELS: dict[str, str] = {
    "plain": "plain MLP (dense fp32 parameters)",
    "pair": "MLP whose parameters are torch TwoTensor (2 inner tensors each)",
    "int8_lora": "frozen Int8RowwiseTensor base weights + trainable LoRA A/B",
    "dtensor": "MLP whose parameters are DTensor (world_size 1, Replicate)",
    "block_int8_lora": "transformer block, frozen Int8RowwiseTensor projections + trainable LoRA A/B (QLoRA-style)",
    "block_pair": "transformer block whose weights (projections and RMSNorm) are trainable torch TwoTensor",
    "block_nf4": "transformer block, frozen torchao NF4Tensor projections + trainable LoRA A/B (QLoRA)",
}
#: inner tensors per subclass value (k of the "subclass / plain <= k" target)
INNER_TENSORS: dict[str, int] = {
    "plain": 1, "pair": 2, "int8_lora": 2, "dtensor": 1, "block_int8_lora": 2, "block_pair": 2, "block_nf4": 5,
}
#: the "realistic workload" models (one transformer block each); the others are micro MLPs
REALISTIC: tuple[str, ...] = ("block_int8_lora", "block_pair", "block_nf4")
#: size -> (batch, features, hidden) of the micro MLPs
SIZES: dict[str, tuple[int, int, int]] = {"small": (16, 64, 128), "medium": (64, 256, 1024)}
#: size -> (batch, seq, dim, heads, ffn) of the transformer blocks (ffn: 8/3 dim rounded up to a multiple of 64)
BLOCK_SIZES: dict[str, tuple[int, int, int, int, int]] = {"small": (4, 32, 64, 4, 192), "medium": (4, 64, 128, 4, 384)}
LORA_RANK = 8
#: the projections of a block, in parameter / input order
_PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


@dataclasses.dataclass(kw_only=True)
class Workload:
    """One model instance with its inputs; ``forward_loss()`` returns a scalar loss."""

    model: str
    size: str
    params: list[torch.nn.Parameter]
    inputs: tuple[Any, ...]
    forward: Callable[..., torch.Tensor]

    def forward_loss(self) -> torch.Tensor:
        return self.forward(self.params, *self.inputs)

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def grad_bytes(self) -> int:
        total = 0
        for p in self.params:
            if p.grad is not None:
                total += _tensor_bytes(p.grad)
        return total


def _tensor_bytes(t: torch.Tensor) -> int:
    from subclass_ca._compat import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(_tensor_bytes(getattr(t, n)) for n in names if isinstance(getattr(t, n), torch.Tensor))
    return t.numel() * t.element_size()


# --- forwards (copied per workload, see the Note) -------------------------------------


def _mlp_forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    w1, b1, w2, b2 = params
    return F.linear(torch.relu(F.linear(x, w1, b1)), w2, b2).square().mean()


def _lora_forward(params: list[torch.Tensor], x: torch.Tensor, base1: torch.Tensor, base2: torch.Tensor) -> torch.Tensor:
    a1, bb1, a2, bb2 = params
    h = torch.relu(F.linear(x, base1) + F.linear(F.linear(x, a1), bb1))
    return (F.linear(h, base2) + F.linear(F.linear(h, a2), bb2)).square().mean()


def _lora_linear(h: torch.Tensor, base: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.linear(h, base) + F.linear(F.linear(h, a), b)


def _block_lora_forward(params: list[torch.Tensor], x: torch.Tensor, heads: int, *bases: torch.Tensor) -> torch.Tensor:
    """RMSNorm -> causal MHA (SDPA) -> residual -> RMSNorm -> SwiGLU -> residual; every projection = frozen base + LoRA."""
    n1, n2, *lora = params
    q, k, v, o, gate, up, down = ((bases[i], lora[2 * i], lora[2 * i + 1]) for i in range(7))
    batch, seq, dim = x.shape
    h = F.rms_norm(x, (dim,), n1, 1e-6)
    qh, kh, vh = (_lora_linear(h, *w).view(batch, seq, heads, dim // heads).transpose(1, 2) for w in (q, k, v))
    att = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2).reshape(batch, seq, dim)
    x = x + _lora_linear(att, *o)
    h = F.rms_norm(x, (dim,), n2, 1e-6)
    x = x + _lora_linear(F.silu(_lora_linear(h, *gate)) * _lora_linear(h, *up), *down)
    return x.square().mean()


def _block_dense_forward(params: list[torch.Tensor], x: torch.Tensor, heads: int) -> torch.Tensor:
    """The same block with trainable projection weights (``params[2:]``, in ``_PROJECTIONS`` order)."""
    n1, n2, wq, wk, wv, wo, wg, wu, wd = params
    batch, seq, dim = x.shape
    h = F.rms_norm(x, (dim,), n1, 1e-6)
    qh, kh, vh = (F.linear(h, w).view(batch, seq, heads, dim // heads).transpose(1, 2) for w in (wq, wk, wv))
    att = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(1, 2).reshape(batch, seq, dim)
    x = x + F.linear(att, wo)
    h = F.rms_norm(x, (dim,), n2, 1e-6)
    x = x + F.linear(F.silu(F.linear(h, wg)) * F.linear(h, wu), wd)
    return x.square().mean()


def private_copy(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{tag}")
    return types.FunctionType(code, fn.__globals__, f"{fn.__name__}_{tag}", fn.__defaults__, fn.__closure__)


# --- builders -----------------------------------------------------------------------


def _dense_mlp(size: str, device: str, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    batch, features, hidden = SIZES[size]
    gen = torch.Generator().manual_seed(seed)
    w1 = torch.randn(hidden, features, generator=gen) / features**0.5
    b1 = torch.zeros(hidden)
    w2 = torch.randn(features, hidden, generator=gen) / hidden**0.5
    b2 = torch.zeros(features)
    x = torch.randn(batch, features, generator=gen)
    return [t.to(device) for t in (w1, b1, w2, b2)], x.to(device)


def _block_dense(size: str, device: str, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """(two RMSNorm weights, seven projection weights in ``_PROJECTIONS`` order, input x)."""
    batch, seq, dim, _, ffn = BLOCK_SIZES[size]
    gen = torch.Generator().manual_seed(seed)
    shapes = {"q": (dim, dim), "k": (dim, dim), "v": (dim, dim), "o": (dim, dim),
              "gate": (ffn, dim), "up": (ffn, dim), "down": (dim, ffn)}
    weights = [torch.randn(*shapes[n], generator=gen) / shapes[n][1] ** 0.5 for n in _PROJECTIONS]
    norms = [1.0 + 0.1 * torch.randn(dim, generator=gen) for _ in range(2)]
    x = torch.randn(batch, seq, dim, generator=gen)
    return [t.to(device) for t in norms], [t.to(device) for t in weights], x.to(device)


def _lora_factors(weights: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """LoRA A (rank x in) and B (out x rank) per weight; B small but nonzero so every factor gets a gradient."""
    gen = torch.Generator().manual_seed(seed)
    factors = []
    for w in weights:
        out_features, in_features = w.shape
        factors.append(torch.randn(LORA_RANK, in_features, generator=gen).to(w.device) / in_features**0.5)
        factors.append(0.01 * torch.randn(out_features, LORA_RANK, generator=gen).to(w.device))
    return factors


def unavailable(model: str) -> str | None:
    """Why ``model`` cannot be built in this environment (None: it can)."""
    return nf4_unavailable(lambda: import_nf4()) if model == "block_nf4" else None  # this module's name: tests replace it


def _nf4(weight: torch.Tensor) -> torch.Tensor:
    """NF4 with blocks of 64 values; the scaler block must divide the number of blocks (torchao's default is 256)."""
    import math

    blocks = weight.numel() // 64
    return import_nf4()(weight.contiguous(), 64, math.gcd(256, blocks))


def _build_block(model: str, size: str, device: str, tag: str, seed: int) -> Workload:
    norms, weights, x = _block_dense(size, device, seed)
    heads = BLOCK_SIZES[size][3]
    if model == "block_pair":
        from subclass_ca._compat import two_tensor_type

        two_tensor = two_tensor_type()
        if two_tensor is None:  # pragma: no cover - torch without its testing package
            from subclass_ca.testing.subclasses import PairTensor

            two_tensor = PairTensor
        # the activations are TwoTensors past the first projection, so the RMSNorm weights are TwoTensors too
        # (a plain weight would get a TwoTensor .grad)
        params = [torch.nn.Parameter(two_tensor(w.clone(), w * 0.5)) for w in norms + weights]
        return Workload(model=model, size=size, params=params, inputs=(x, heads),
                        forward=private_copy(_block_dense_forward, tag))
    if model == "block_int8_lora":
        from subclass_ca.testing.subclasses import Int8RowwiseTensor

        bases: list[torch.Tensor] = [Int8RowwiseTensor.quantize(w) for w in weights]
    else:  # block_nf4
        reason = unavailable(model)
        if reason:
            raise RuntimeError(f"bench model block_nf4 is unavailable: {reason}")
        bases = [_nf4(w) for w in weights]
    params = [torch.nn.Parameter(t) for t in norms + _lora_factors(weights, seed + 1)]
    return Workload(model=model, size=size, params=params, inputs=(x, heads, *bases),
                    forward=private_copy(_block_lora_forward, tag))


def ensure_process_group(device: str) -> None:
    """A world_size-1 process group on a free localhost port (DTensor needs one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.startswith("cuda") else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
    )


def build(model: str, size: str, device: str, *, tag: str, seed: int = 0) -> Workload:
    """A fresh workload of ``model`` at ``size`` on ``device``; ``tag`` names its private forward."""
    if model not in MODELS:
        raise ValueError(f"unknown bench model {model!r}; allowed values are {sorted(MODELS)}")
    if size not in SIZES:
        raise ValueError(f"unknown bench size {size!r}; allowed values are {sorted(SIZES)}")
    if model in REALISTIC:
        return _build_block(model, size, device, tag, seed)
    dense, x = _dense_mlp(size, device, seed)
    if model == "plain":
        params = [torch.nn.Parameter(t) for t in dense]
        return Workload(model=model, size=size, params=params, inputs=(x,), forward=private_copy(_mlp_forward, tag))
    if model == "pair":
        from subclass_ca._compat import two_tensor_type

        two_tensor = two_tensor_type()
        if two_tensor is None:  # pragma: no cover - torch without its testing package
            from subclass_ca.testing.subclasses import PairTensor

            two_tensor = PairTensor
        params = [torch.nn.Parameter(two_tensor(t.clone(), t * 0.5)) for t in dense]
        return Workload(model=model, size=size, params=params, inputs=(x,), forward=private_copy(_mlp_forward, tag))
    if model == "int8_lora":
        from subclass_ca.testing.subclasses import Int8RowwiseTensor

        w1, _, w2, _ = dense
        batch, features, hidden = SIZES[size]
        gen = torch.Generator().manual_seed(seed + 1)
        a1 = torch.randn(LORA_RANK, features, generator=gen).to(device) / features**0.5
        a2 = torch.randn(LORA_RANK, hidden, generator=gen).to(device) / hidden**0.5
        b1 = torch.zeros(hidden, LORA_RANK, device=device)
        b2 = torch.zeros(features, LORA_RANK, device=device)
        base1, base2 = Int8RowwiseTensor.quantize(w1), Int8RowwiseTensor.quantize(w2)
        params = [torch.nn.Parameter(t) for t in (a1, b1, a2, b2)]
        return Workload(
            model=model, size=size, params=params, inputs=(x, base1, base2), forward=private_copy(_lora_forward, tag)
        )
    # dtensor
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, distribute_tensor

    ensure_process_group(device)
    mesh = init_device_mesh(torch.device(device).type, (1,))
    params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Replicate()])) for t in dense]
    dx = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
    return Workload(model=model, size=size, params=params, inputs=(dx,), forward=private_copy(_mlp_forward, tag))

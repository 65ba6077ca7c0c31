"""The FSDP2 runs the tools train by name (``MODELS``: ``bench --fsdp2``, ``fsdp2-cost``, ``fsdp2-profile``), and how
their gradient and parameter shards are compared with eager FSDP2's (``TOLERANCE``, ``local_shards``,
``compare_shards``)."""

from __future__ import annotations

import torch

from tools.common.models import nf4_unavailable

from . import parity

__all__ = ["MODELS", "TOLERANCE", "local_shards", "compare_shards", "unavailable"]

#: row model -> the run it trains (backend and device filled in per row)
MODELS: dict[str, parity.FSDP2Run] = {
    "micro": parity.FSDP2Run(),
    "block_two_tensor": parity.FSDP2Run(block=parity.BlockShape(), params="two_tensor", batch=2),
    "block_nf4_lora": parity.FSDP2Run(block=parity.BlockShape(), params="nf4_lora", batch=2),
}
#: backend -> atol = rtol of the check against eager FSDP2 (other backends: the inductor value)
TOLERANCE: dict[str, float] = {"aot_eager": 0.0, "inductor": 1e-4}


def local_shards(tensors: dict[str, torch.Tensor | None]) -> dict[str, torch.Tensor]:
    """This rank's shards as plain tensors (a wrapper subclass as its inner tensors)."""
    out = {}
    for name, t in tensors.items():
        if t is not None:
            local = t.to_local() if hasattr(t, "to_local") else t
            out[name] = parity.plain_tensor(local.detach()).float().cpu()
    return out


def compare_shards(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], tol: float) -> tuple[list[str], float]:
    """What differs between two ranks' shards beyond ``tol`` (atol = rtol), and the largest difference."""
    problems, max_diff = [], 0.0
    if got.keys() != want.keys():
        problems.append(f"parameters with a gradient differ: {sorted(got.keys() ^ want.keys())}")
    for name in sorted(got.keys() & want.keys()):
        a, b = got[name], want[name]
        if a.shape != b.shape:
            problems.append(f"{name}: local shard {tuple(a.shape)} != eager's {tuple(b.shape)}")
            continue
        if a.numel():
            max_diff = max(max_diff, float((a - b).abs().max()))
        try:
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        except AssertionError as error:
            problems.append(f"{name}: {' '.join(str(error).split())[:160]}")
    return problems, max_diff


def unavailable(model_name: str) -> str | None:
    """Why the run ``model_name`` cannot train in this environment (None: it can)."""
    if MODELS[model_name].params == "nf4_lora":
        return nf4_unavailable()
    return None

"""DistributedDataParallel step time: eager DDP, compile-only, subclass_ca, and the Python reducer's own cost.

``python -m tools bench --ddp --nproc 2`` (or :func:`bench`) launches ``world_size`` ranks (gloo on
127.0.0.1; NCCL with ``device="cuda"``) that time, per row (a model and a backend), four modes built
from the same seed:

* ``eager`` -- eager DDP (its C++ reducer, bucketed all-reduce);
* ``compile`` -- ``torch.compile(ddp)`` forward, eager backward, C++ reducer;
* ``compile_python_reducer`` -- the same with DDP built under ``optimize_ddp="python_reducer"``: the
  all-reduce runs from torch's per-parameter post-accumulate hooks, eagerly.  Its ratio to ``compile``
  is the Python reducer's own cost per step (what subclass_ca switches a DDP module to inside a block);
  it is timed against ``compile`` in a launch of its own (:data:`LAUNCHES` says why);
* ``subclass_ca`` -- the compiled forward and the backward inside ``subclass_ca.enable()``, no flag
  (Note [DDP under compiled autograd]): the all-reduces are captured into the CA graph.

A step is ``zero_grad`` + forward + mse loss + backward + SGD step.  Rows: ``two_tensor_mlp`` (an MLP
whose weights are TwoTensors) and ``nf4_lora`` (frozen torchao NF4 bases + LoRA adapters; skipped
with the reason without torchao).  Timing as in ``bench_fsdp2``: the cold step, ``warmup`` steps, then
``reps`` interleaved rounds of ``block`` steps per mode (order alternating, a barrier before each
sample, rank 0's clock); ratios are taken within each round, reported as median (IQR).  Correctness:
every rank's trainable parameters after the last step against eager DDP's (bitwise on aot_eager,
1e-4 on inductor).  Only the NF4 QLoRA row gates ``ok``: eager DDP's C++ reducer averages TwoTensor
gradients wrongly (seen on 2.13), so the TwoTensor row shows its difference and ``tests/test_ddp.py``
checks subclass_ca there against data parallel computed by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from tools.common.report import as_json as to_json
from tools.common.report import command_of, targets_table, verdict_lines
from tools.common.stats import quartiles

from .fsdp2 import timed_steps

__all__ = ["DDPBench", "MODES", "MODELS", "TARGETS", "bench", "markdown_section", "format_summary", "to_json"]

MODES: tuple[str, ...] = ("eager", "compile", "compile_python_reducer", "subclass_ca")
LAUNCHES: tuple[tuple[str, ...], ...] = (("eager", "compile", "subclass_ca"), ("compile", "compile_python_reducer"))
"""Modes timed side by side in one launch.  The Python reducer's row runs in processes of its own: building a DDP
module under ``optimize_ddp="python_reducer"`` changes torch's process-wide settings (Dynamo inlines
``torch.nn.parallel.distributed``, inductor fuses DDP communication), which would change every later compile."""
MODELS: dict[str, str] = {
    "two_tensor_mlp": "MLP 64-128-128-16, every weight a TwoTensor, batch 32",
    "nf4_lora": "4 blocks of a frozen NF4 base (dim 128) + rank-8 LoRA adapters, tanh, batch 32",
}
GATED = {"nf4_lora"}
"""Rows whose correctness gates ``ok`` (eager DDP is a trustworthy reference there: plain trainable parameters)."""
TOLERANCE: dict[str, float] = {"aot_eager": 0.0, "inductor": 1e-4}
TARGETS: dict[str, str] = {
    "ddp": "subclass_ca <= 1.00x compile-only DDP (median ratio, every gated row)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DDPBench:
    """Rows and schedule of one DDP bench run (every rank uses the same)."""

    models: tuple[str, ...] = tuple(MODELS)
    backends: tuple[str, ...] = ("aot_eager", "inductor")
    warmup: int = 2
    reps: int = 9
    block: int = 3
    device: str = "cpu"

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise ValueError(f"DDPBench.models: unknown {unknown}; allowed values are {list(MODELS)}")
        for name in ("reps", "block"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DDPBench.{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"DDPBench.warmup must be an int >= 0, got {self.warmup!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"DDPBench.device: got {self.device!r}, allowed values are ('cpu', 'cuda')")


# --- one rank ------------------------------------------------------------------------


class _NF4LoRA(nn.Module):
    def __init__(self, dim: int, rank: int = 8) -> None:
        super().__init__()
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        self.base = nn.Parameter(to_nf4(torch.randn(dim, dim) * 0.1, block_size=32, scaler_block_size=8), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(dim, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        return torch.tanh(linear_nf4(x, self.base) + x @ self.lora_a.t() @ self.lora_b.t())


def _model(name: str, device: str) -> tuple[nn.Module, int, int]:
    """The model, its input and output widths (the same weights for every call)."""
    torch.manual_seed(0)
    if name == "two_tensor_mlp":
        from subclass_ca import _compat

        two_tensor = _compat.two_tensor_type()
        assert two_tensor is not None, "this torch has no TwoTensor"
        model = nn.Sequential(nn.Linear(64, 128), nn.Tanh(), nn.Linear(128, 128), nn.Tanh(), nn.Linear(128, 16))
        for layer in model:
            if isinstance(layer, nn.Linear):
                dense = layer.weight.detach()
                layer.weight = nn.Parameter(two_tensor(dense.clone(), dense * 0.5))
        return model.to(device), 64, 16
    model = nn.Sequential(*(_NF4LoRA(128) for _ in range(4)), nn.Linear(128, 16))
    return model.to(device), 128, 16


def unavailable(name: str) -> str | None:
    if name == "nf4_lora":
        from .models import unavailable as model_unavailable

        return model_unavailable("block_nf4")
    from subclass_ca import _compat

    return None if _compat.two_tensor_type() is not None else "this torch has no TwoTensor"


@dataclasses.dataclass(kw_only=True)
class _Mode:
    name: str
    model: nn.Module
    step: Callable[[], None]
    cold_ms: float = float("nan")
    samples: list[float] = dataclasses.field(default_factory=list)


def _build_mode(name: str, model_name: str, backend: str, rank: int, device: str) -> _Mode:
    from torch.nn.parallel import DistributedDataParallel

    import subclass_ca

    model, width, out = _model(model_name, device)
    default = torch._dynamo.config.optimize_ddp
    if name == "compile_python_reducer":
        torch._dynamo.config.optimize_ddp = "python_reducer"  # read when DDP is constructed
    try:
        ddp = DistributedDataParallel(model, device_ids=[torch.cuda.current_device()] if device == "cuda" else None)
    finally:
        torch._dynamo.config.optimize_ddp = default
    forward = ddp if name == "eager" else torch.compile(ddp, backend=backend)
    optimizer = torch.optim.SGD([p for p in ddp.parameters() if p.requires_grad], lr=0.01)
    block = subclass_ca.enable(backend=backend) if name == "subclass_ca" else None
    counter = iter(range(1 << 30))

    def step() -> None:
        index = next(counter)
        generator = torch.Generator().manual_seed(1000 * rank + index)
        x = torch.randn(32, width, generator=generator).to(device)
        y = torch.randn(32, out, generator=generator).to(device)
        optimizer.zero_grad(set_to_none=True)
        with block if block is not None else contextlib.nullcontext():
            loss = nn.functional.mse_loss(forward(x), y)
            loss.backward()
        optimizer.step()

    return _Mode(name=name, model=model, step=step)


def _inner(t: torch.Tensor) -> list[torch.Tensor]:
    from subclass_ca import _compat

    if _compat.is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in _inner(getattr(t, name))]
    return [t.detach().float().cpu()]


def _row(rank: int, settings: DDPBench, model_name: str, backend: str, names: tuple[str, ...]) -> dict[str, Any]:
    import subclass_ca

    subclass_ca.reset()
    torch._dynamo.reset()
    modes = [_build_mode(name, model_name, backend, rank, settings.device) for name in names]
    compile_mode = next(mode for mode in modes if mode.name == "compile")
    for mode in modes:
        mode.cold_ms = timed_steps(mode, 1, settings.device)
    for _ in range(settings.warmup):
        for mode in modes:
            timed_steps(mode, 1, settings.device)
    for rep in range(settings.reps):
        for mode in modes if rep % 2 == 0 else modes[::-1]:
            mode.samples.append(timed_steps(mode, settings.block, settings.device))
    tol = TOLERANCE.get(backend, TOLERANCE["inductor"])
    eager = modes[0]  # the reference: eager DDP, or compile-only in the Python reducer's launch
    want = [inner for p in eager.model.parameters() if p.requires_grad for inner in _inner(p)]
    out: dict[str, Any] = {"model": model_name, "backend": backend, "modes": {}}
    for mode in modes:
        got = [inner for p in mode.model.parameters() if p.requires_grad for inner in _inner(p)]
        diff = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
        out["modes"][mode.name] = {
            "cold_ms": mode.cold_ms,
            "samples_ms": mode.samples,
            "ratios": [s / e for s, e in zip(mode.samples, eager.samples)] if eager.name == "eager" else None,
            "vs_compile": [s / c for s, c in zip(mode.samples, compile_mode.samples)],
            "max_abs_diff": diff,
            "correct": diff <= tol,
        }
    return out


def _rank_main(rank: int, world_size: int, settings: DDPBench, names: tuple[str, ...]) -> dict[str, Any]:
    from subclass_ca import _compat

    start = time.perf_counter()
    rows = []
    with _compat.uncached_compiles():
        for model_name in settings.models:
            for backend in settings.backends:
                skip = unavailable(model_name)
                if skip:
                    rows.append({"model": model_name, "backend": backend, "skipped": skip})
                    continue
                try:
                    rows.append(_row(rank, settings, model_name, backend, names))
                except Exception as error:  # noqa: BLE001 - a row's failure is a result (every rank fails alike)
                    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
                    rows.append({"model": model_name, "backend": backend, "error": f"{type(error).__name__}: {message}"[:300]})
    return {"rank": rank, "rows": rows, "wall_s": time.perf_counter() - start}


# --- the launch and its summary ----------------------------------------------------


def _summarize_row(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    first = per_rank[0]
    if "modes" not in first:
        return dict(first)
    row = {"model": first["model"], "backend": first["backend"], "gated": first["model"] in GATED, "modes": {}}
    for name, entry in first["modes"].items():
        q1, median, q3 = quartiles(entry["samples_ms"])
        r1, ratio, r3 = quartiles(entry["ratios"]) if entry["ratios"] else (None, None, None)
        c1, vs_compile, c3 = quartiles(entry["vs_compile"])
        ranks = [r["modes"][name] for r in per_rank]
        row["modes"][name] = {
            "median_ms": median, "iqr_ms": (q1, q3), "ratio": ratio, "ratio_iqr": (r1, r3),
            "vs_compile": vs_compile, "vs_compile_iqr": (c1, c3), "cold_ms": entry["cold_ms"],
            "correct": all(r["correct"] for r in ranks), "max_abs_diff": max(r["max_abs_diff"] for r in ranks),
        }
    return row


def verdicts(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    gated = [r for r in rows if r.get("gated") and "modes" in r]
    if not gated:
        return {"ddp": {"met": None, "detail": "no gated row measured"}}
    worst = max(r["modes"]["subclass_ca"]["vs_compile"] for r in gated)
    detail = ", ".join(f"{r['model']}/{r['backend']} {r['modes']['subclass_ca']['vs_compile']:.3f}x" for r in gated)
    return {"ddp": {"met": worst <= 1.00, "detail": detail}}


def bench(world_size: int = 2, *, settings: DDPBench | None = None, timeout_s: float = 900.0) -> dict[str, Any]:
    """Launch ``world_size`` ranks, time every row, check it, and summarise (JSON-able)."""
    from subclass_ca.distributed import run_workers

    settings = settings or DDPBench()
    start = time.perf_counter()
    launches = [run_workers(_rank_main, world_size, timeout_s=timeout_s, args=(settings, names), device=settings.device)
                for names in LAUNCHES]
    rows = []
    for index in range(len(launches[0][0]["rows"])):
        row = _summarize_row([r["rows"][index] for r in launches[0]])
        reducer = _summarize_row([r["rows"][index] for r in launches[1]])
        if "modes" in row and "modes" in reducer:
            row["modes"]["compile_python_reducer"] = reducer["modes"]["compile_python_reducer"]
        elif "modes" in row:
            row["reducer_error"] = reducer.get("error") or reducer.get("skipped")
        rows.append(row)
    ok = all(m["correct"] for r in rows if r.get("gated") and "modes" in r for m in r["modes"].values())
    ok = ok and not any("error" in r for r in rows)
    device_flag = " --device cuda" if settings.device == "cuda" else ""
    return {
        "world_size": world_size, "settings": dataclasses.asdict(settings), "torch": torch.__version__, "rows": rows,
        "verdicts": verdicts(rows), "ok": ok, "wall_s": time.perf_counter() - start,
        "command": f"python -m tools bench --ddp --nproc {world_size}{device_flag}",
    }


def _table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| model | backend | mode | median step ms (IQR) | x eager DDP (IQR) | x compile-only (IQR) | cold ms | = eager DDP (max abs diff) |",
        "|---|---|---|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        if "modes" not in row:
            lines.append(f"| {row['model']} | {row['backend']} | - | - | - | - | - | {row.get('skipped') or row.get('error')} |")
            continue
        for name, m in row["modes"].items():
            if name == "eager":
                ratio = "1.00"
            elif m["ratio"] is None:
                ratio = "- (own launch)"
            else:
                ratio = f"{m['ratio']:.3f} ({m['ratio_iqr'][0]:.3f}-{m['ratio_iqr'][1]:.3f})"
            vs = "1.00" if name == "compile" else f"{m['vs_compile']:.3f} ({m['vs_compile_iqr'][0]:.3f}-{m['vs_compile_iqr'][1]:.3f})"
            if name == "eager":
                check = "-"
            elif name == "compile_python_reducer":
                check = f"= compile-only ({m['max_abs_diff']:.1e})"
            elif row["gated"]:
                check = f"yes ({m['max_abs_diff']:.1e})" if m["correct"] else f"NO ({m['max_abs_diff']:.1e})"
            else:
                check = f"not gated ({m['max_abs_diff']:.1e})"
            lines.append(f"| {row['model']} | {row['backend']} | {name} | {m['median_ms']:.2f} ({m['iqr_ms'][0]:.2f}-"
                         f"{m['iqr_ms'][1]:.2f}) | {ratio} | {vs} | {m['cold_ms']:.0f} | {check} |")
    return lines


def markdown_section(result: dict[str, Any], *, command: str | None = None) -> str:
    """RESULTS.md section for :func:`bench`'s result: the target, then the rows."""
    s = result["settings"]
    lines = [
        "",
        f"## DistributedDataParallel training, {result['world_size']} processes",
        "",
        f"Device {s['device']} ({'NCCL' if s['device'] == 'cuda' else 'gloo, 127.0.0.1'}), different data per rank, SGD. "
        "Rows: " + "; ".join(f"`{k}` = {v}" for k, v in MODELS.items()) + ". Modes: eager DDP (C++ reducer); `compile` = "
        "compiled forward, eager backward (C++ reducer); `compile_python_reducer` = the same with DDP built under "
        "`optimize_ddp=\"python_reducer\"`, timed against `compile` in processes of their own (building it changes torch's "
        "process-wide settings); that ratio is the Python reducer's own cost per step; "
        "`subclass_ca` = forward and backward inside `enable()`, no flag (the module runs on the Python reducer there, "
        "its all-reduces captured in the CA graph and bucketed, under inductor and aot_eager alike: Note [Bucketing the "
        "Python reducer's all-reduces]). Step = zero_grad + forward + loss + backward + SGD step. "
        f"{s['reps']} interleaved rounds of {s['block']} steps per mode after {s['warmup']} warm-up steps (order "
        "alternating, a barrier before each sample, rank 0's clock); ratios within each round, median (IQR). "
        "Correctness: trainable parameters after the last step against eager DDP's on every rank (bitwise on aot_eager, "
        "1e-4 on inductor); the TwoTensor row is not gated: eager DDP's C++ reducer averages TwoTensor gradients wrongly "
        f"(tests/test_ddp.py checks subclass_ca against data parallel by hand). torch {result['torch']}.",
        "",
        *targets_table(TARGETS, result["verdicts"]),
        "",
        *_table(result),
        "",
        f"Command: `{command_of(result, command, 'python -m tools bench --ddp')}` ({result['wall_s']:.0f} s).",
        "",
    ]
    return "\n".join(lines)


def format_summary(result: dict[str, Any]) -> str:
    targets = verdict_lines(TARGETS, result["verdicts"])
    return "\n".join(_table(result) + targets + [f"wall {result['wall_s']:.0f} s, ok={result['ok']}"])

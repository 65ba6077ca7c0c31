"""Cold start against depth: compile-only, stock compiled autograd and subclass_ca over stacks of L regional blocks.

``python -m tools bench --depth`` (or :func:`bench`) trains stacks of L identical blocks, each compiled on its
own with ``block.compile(backend="inductor")`` (regional compilation, as torchtune and torchtitan do), batch 8,
one thread, every sample a fresh process with a fresh inductor cache:

* ``two_tensor_lora``: LayerNorm -> frozen TwoTensor weight + rank-8 LoRA -> tanh -> residual, D=64;
* ``nf4_lora``: the same with a frozen torchao NF4 base (skipped with the reason without torchao);
* ``two_tensor_trainable``: the TwoTensor block with its TwoTensor weight *trainable* and TwoTensor activations
  (the input is a TwoTensor), so every block's weight gradient is rebuilt as a subclass (issue 62).

Modes: ``compile`` (compile-only: compiled blocks, eager autograd), ``stock`` (stock compiled autograd),
``subclass_ca`` (``enable()``: regional pieces, Note [Regional CA graphs]) and ``subclass_ca_whole``
(``enable(regional=False)``, the single graph before issue 47; measured at one depth as the reference).
Per sample: the cold first step (forward + backward + SGD, compiles included), compiled autograd's own
capture (backward start to the CA graph reaching its compiler: the autograd graph walk and the proxy trace,
which grows with depth by nature), and the steady step (median of ``steady`` steps after 3 warm-up steps).
Modes run interleaved per depth (order alternating) so each ratio compares samples taken side by side;
ratios to compile-only are per repetition, reported as median (min-max).  Gradients: every mode's parameters
after the cold step against eager's in the same process (inductor tolerance 1e-4).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any, cast

from tools import ROOT
from tools.common.report import as_json as to_json
from tools.common.report import command_of, targets_table, verdict_lines

__all__ = ["DepthBench", "MODES", "MODELS", "TARGETS", "bench", "block_class", "build_parser", "format_summary", "main", "markdown_section",
           "plot", "settings_from_args", "to_json"]

MODES: tuple[str, ...] = ("compile", "stock", "subclass_ca")
MODELS: tuple[str, ...] = ("two_tensor_lora", "nf4_lora", "two_tensor_trainable")
TARGETS: dict[str, str] = {
    "cold": "L = 32: subclass_ca cold first step <= 1.2x compile-only's (median ratio, every model)",
    "steady": "L = 32: subclass_ca steady step <= compile-only's (median ratio, every model)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DepthBench:
    depths: tuple[int, ...] = (2, 8, 32, 64)
    models: tuple[str, ...] = MODELS
    reps: int = 1
    """Fresh-process samples per (model, depth, mode)."""
    target_reps: int = 2
    """Samples at the target depth (32), for its ratio's spread."""
    whole_depth: int | tuple[int, ...] = 32
    """Depth(s) of the ``subclass_ca_whole`` reference sample (0: none)."""
    steady: int = 15
    batch: int = 8
    dim: int = 64
    modes: tuple[str, ...] = MODES
    """Modes sampled (compile-only is the reference of every ratio, so it is always one of them)."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (the GPU check's L = 32 row)."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise ValueError(f"DepthBench.models: unknown {unknown}; allowed values are {list(MODELS)}")
        if "compile" not in self.modes or any(m not in MODES for m in self.modes):
            raise ValueError(f"DepthBench.modes must include 'compile' and be among {list(MODES)}, got {self.modes!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"DepthBench.device must be 'cpu' or 'cuda', got {self.device!r}")
        if not self.depths or any(not isinstance(d, int) or d < 1 for d in self.depths):
            raise ValueError(f"DepthBench.depths must be positive ints, got {self.depths!r}")
        for name in ("reps", "target_reps", "steady"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"DepthBench.{name} must be a positive int, got {getattr(self, name)!r}")


# --- one sample (a fresh process) ---------------------------------------------------------


def block_class(model: str, dim: int) -> Any:
    """The depth sweep's block (LayerNorm, a frozen NF4 or TwoTensor base, a rank-8 LoRA adapter; the warm-start
    bench's regional stack row uses it too)."""
    import torch
    from torch import nn

    from subclass_ca import _compat

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.LayerNorm(dim)
            weight = torch.randn(dim, dim) * dim**-0.5
            if model == "nf4_lora":
                from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

                base = to_nf4(weight, block_size=32, scaler_block_size=8)
            else:
                two_tensor = _compat.two_tensor_type()
                assert two_tensor is not None, "this torch has no TwoTensor"
                base = two_tensor(weight.clone(), weight * 0.5)
            self.weight = nn.Parameter(base, requires_grad=model == "two_tensor_trainable")
            self.lora_a = nn.Parameter(torch.randn(8, dim) * 0.1)
            self.lora_b = nn.Parameter(torch.randn(dim, 8) * 0.1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.norm(x)
            if model == "nf4_lora":
                from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

                base = linear_nf4(h, self.weight)
            else:
                base = h @ self.weight.t()
            return x + torch.tanh(base + h @ self.lora_a.t() @ self.lora_b.t())

    return Block


def sample(settings: dict[str, Any]) -> dict[str, Any]:
    """One fresh-process sample: ``{"cold_s", "capture_s", "steady_ms", "max_abs_diff"}``."""
    import torch
    from torch import nn

    import subclass_ca
    from subclass_ca import _compat, _compiler

    torch.set_num_threads(1)
    model_name, depth, mode, dim = settings["model"], settings["depth"], settings["mode"], settings["dim"]
    block = block_class(model_name, dim)
    torch.manual_seed(0)
    device = torch.device(settings.get("device", "cpu"))
    model = nn.Sequential(*(block() for _ in range(depth))).to(device)
    torch.manual_seed(0)
    reference = nn.Sequential(*(block() for _ in range(depth))).to(device)
    for layer in model:
        layer.compile(backend="inductor")
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=0.01)
    captured: list[float] = []

    def stock_compiler(gm: Any) -> Any:
        captured.append(time.perf_counter())
        return torch.compile(gm, backend="inductor", fullgraph=True)

    original_call = _compiler.CACompiler.__call__

    def timed_call(self: Any, graph_module: Any) -> Any:  # the CA graph reaches subclass_ca's compiler
        captured.append(time.perf_counter())
        return original_call(self, graph_module)

    cast(Any, _compiler.CACompiler).__call__ = timed_call  # patched for the rest of this sample's process

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def inputs(index: int) -> torch.Tensor:
        x = torch.randn(settings["batch"], dim, generator=torch.Generator().manual_seed(index)).to(device)
        if model_name == "two_tensor_trainable":  # TwoTensor activations through every block
            two_tensor = _compat.two_tensor_type()
            assert two_tensor is not None, "this torch has no TwoTensor"
            return cast(torch.Tensor, two_tensor(x, x * 0.5))
        return x

    def step(index: int) -> tuple[float, float]:
        x = inputs(index)
        synchronize()
        start = time.perf_counter()
        loss = model(x).sin().sum()
        backward_start = time.perf_counter()
        if mode == "compile":
            loss.backward()
        elif mode == "stock":
            with _compat.enable_compiled_autograd(stock_compiler):
                loss.backward()
        else:
            with subclass_ca.enable(backend="inductor", regional=mode == "subclass_ca"):
                loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        synchronize()
        return time.perf_counter() - start, backward_start

    cold_s, backward_start = step(0)
    capture_s = captured[0] - backward_start if captured else None
    x = inputs(0)
    reference(x).sin().sum().backward()
    with torch.no_grad():
        for p in [p for p in reference.parameters() if p.requires_grad]:
            assert p.grad is not None  # the backward above reached every trainable parameter
            p.sub_(p.grad * 0.01)
    diff = max(float((a - b).abs().max()) for p, r in zip(trainable, [p for p in reference.parameters() if p.requires_grad])
               for a, b in zip(_parts(p), _parts(r)))
    for index in range(1, 4):
        step(index)
    steady = [step(index)[0] * 1e3 for index in range(4, 4 + settings["steady"])]
    report = subclass_ca.last_report() if mode.startswith("subclass_ca") else None
    return {
        "cold_s": cold_s, "capture_s": capture_s, "steady_ms": statistics.median(steady),
        "steady_iqr_ms": list(statistics.quantiles(steady, n=4)[::2]) if len(steady) > 1 else [steady[0]] * 2,
        "max_abs_diff": diff,
        "regional": {"pieces": report.regional_pieces, "compiles": report.regional_compiles} if report else None,
    }


def _parts(tensor: Any) -> list[Any]:
    """A tensor's plain parts (a wrapper subclass's inner tensors, recursively), for comparing values."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return [tensor.detach()]
    names, _ = flatten()
    return [part for name in names for part in _parts(getattr(tensor, name))]


def _run_sample(settings: dict[str, Any], timeout_s: float = 900.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="subclass_ca_depth_") as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        done = subprocess.run([sys.executable, "-m", "tools.bench.depth", json.dumps(settings)], env=env,
                              capture_output=True, text=True, timeout=timeout_s,
                              cwd=ROOT)
    if done.returncode != 0:
        lines = [line for line in done.stderr.strip().splitlines() if line.strip()]
        return {"error": lines[-1][:300] if lines else f"exit {done.returncode}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def unavailable(model: str) -> str | None:
    if model == "nf4_lora":
        from .models import unavailable as model_unavailable

        return model_unavailable("block_nf4")
    return None


def bench(settings: DepthBench | None = None, *, progress: Any = None) -> dict[str, Any]:
    """Every sample, interleaved per depth; the summary rows and the targets' verdicts (JSON-able)."""
    import torch

    settings = settings or DepthBench()
    start = time.perf_counter()
    samples: list[dict[str, Any]] = []
    for model in settings.models:
        skip = unavailable(model)
        if skip:
            samples.append({"model": model, "skipped": skip})
            continue
        for depth in settings.depths:
            reps = max(settings.reps, settings.target_reps if depth == 32 else 1)
            for rep in range(reps):
                wholes = (settings.whole_depth,) if isinstance(settings.whole_depth, int) else settings.whole_depth
                modes = list(settings.modes) + (["subclass_ca_whole"] if depth in wholes and rep == 0 else [])
                for mode in modes if (rep + depth) % 2 == 0 else modes[::-1]:
                    base = {"model": model, "depth": depth, "mode": mode, "rep": rep}
                    result = _run_sample({**base, "dim": settings.dim, "batch": settings.batch, "steady": settings.steady,
                                          "device": settings.device})
                    samples.append({**base, **result})
                    if progress is not None:
                        progress(samples[-1])
    rows = summarize(samples)
    return {"settings": dataclasses.asdict(settings), "torch": torch.__version__, "samples": samples, "rows": rows,
            "capture_per_block_ms": capture_slopes(rows), "verdicts": verdicts(rows),
            "wall_s": time.perf_counter() - start, "command": "python -m tools bench --depth"}


def _ratios(samples: Sequence[dict[str, Any]], model: str, depth: int, mode: str, field: str) -> list[float]:
    by_rep: dict[int, dict[str, dict[str, Any]]] = {}
    for s in samples:
        if s.get("model") == model and s.get("depth") == depth and "error" not in s and "skipped" not in s:
            by_rep.setdefault(s["rep"], {})[s["mode"]] = s
    return [rep[mode][field] / rep["compile"][field] for rep in by_rep.values() if mode in rep and "compile" in rep]


def summarize(samples: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    keys = sorted({(s["model"], s.get("depth", 0), s.get("mode", "")) for s in samples},
                  key=lambda k: (k[0], k[1], (list(MODES) + ["subclass_ca_whole", ""]).index(k[2])))
    for model, depth, mode in keys:
        group = [s for s in samples if (s["model"], s.get("depth", 0), s.get("mode", "")) == (model, depth, mode)]
        ok = [s for s in group if "error" not in s and "skipped" not in s]
        row: dict[str, Any] = {"model": model, "depth": depth, "mode": mode, "samples": len(ok)}
        if not ok:
            row["error"] = next((s.get("error") or s.get("skipped") for s in group), "no sample")
            rows.append(row)
            continue
        cold = [s["cold_s"] for s in ok]
        row.update({
            "cold_s": statistics.median(cold), "cold_range_s": (min(cold), max(cold)),
            "steady_ms": statistics.median([s["steady_ms"] for s in ok]),
            "capture_s": statistics.median([s["capture_s"] for s in ok]) if ok[0]["capture_s"] is not None else None,
            "max_abs_diff": max(s["max_abs_diff"] for s in ok), "regional": ok[0].get("regional"),
        })
        for field, name in (("cold_s", "cold_ratio"), ("steady_ms", "steady_ratio")):
            ratios = _ratios(samples, model, depth, mode, field)
            row[name] = (statistics.median(ratios), min(ratios), max(ratios)) if ratios else None
        rows.append(row)
    return rows


def capture_slopes(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """Compiled autograd's own capture, ms per block: least-squares slope of capture time against depth."""
    out = {}
    for model in {r["model"] for r in rows}:
        for mode in ("stock", "subclass_ca"):
            points = [(r["depth"], r["capture_s"]) for r in rows if r["model"] == model and r["mode"] == mode and r.get("capture_s")]
            if len(points) >= 2:
                mean_d = statistics.mean(d for d, _ in points)
                mean_c = statistics.mean(c for _, c in points)
                slope = sum((d - mean_d) * (c - mean_c) for d, c in points) / sum((d - mean_d) ** 2 for d, _ in points)
                out[f"{model}/{mode}"] = slope * 1e3
    return out


def verdicts(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    target = [r for r in rows if r["depth"] == 32 and r["mode"] == "subclass_ca" and r.get("cold_ratio")]
    if not target:
        return {name: {"met": None, "detail": "L = 32 not measured"} for name in TARGETS}
    cold = ", ".join(f"{r['model']} {r['cold_ratio'][0]:.2f}x ({r['cold_ratio'][1]:.2f}-{r['cold_ratio'][2]:.2f})" for r in target)
    steady = ", ".join(f"{r['model']} {r['steady_ratio'][0]:.2f}x ({r['steady_ratio'][1]:.2f}-{r['steady_ratio'][2]:.2f})" for r in target)
    return {
        "cold": {"met": all(r["cold_ratio"][0] <= 1.2 for r in target), "detail": cold},
        "steady": {"met": all(r["steady_ratio"][0] <= 1.0 for r in target), "detail": steady},
    }


def _table(result: dict[str, Any]) -> list[str]:
    lines = ["| model | L | mode | cold first step s (range) | x compile-only cold (min-max) | CA capture s | steady ms | "
             "x compile-only steady (min-max) | regional pieces / compiles | max abs diff vs eager |",
             "|---|---:|---|---:|---:|---:|---:|---:|---|---:|"]

    def ratio(mode: str, value: Any) -> str:
        return "1.00" if mode == "compile" else (f"{value[0]:.2f} ({value[1]:.2f}-{value[2]:.2f})" if value else "-")

    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['depth']} | {r['mode']} | - | - | - | - | - | - | {r['error']} |")
            continue

        regional = f"{r['regional']['pieces']} / {r['regional']['compiles']}" if r.get("regional") else "-"
        capture = f"{r['capture_s']:.2f}" if r.get("capture_s") is not None else "-"
        lines.append(f"| {r['model']} | {r['depth']} | {r['mode']} | {r['cold_s']:.1f} ({r['cold_range_s'][0]:.1f}-"
                     f"{r['cold_range_s'][1]:.1f}) | {ratio(r['mode'], r['cold_ratio'])} | {capture} | {r['steady_ms']:.2f} | "
                     f"{ratio(r['mode'], r['steady_ratio'])} | {regional} | {r['max_abs_diff']:.1e} |")
    return lines


def markdown_section(result: dict[str, Any], *, command: str | None = None) -> str:
    s = result["settings"]
    slopes = ", ".join(f"{k} {v:.1f} ms" for k, v in sorted(result["capture_per_block_ms"].items()))
    lines = [
        "",
        "## Cold start against depth (regional compiled autograd)",
        "",
        f"Stacks of L identical blocks, each `block.compile(backend=\"inductor\")`; batch {s['batch']}, D={s['dim']}, one "
        "thread, every sample a fresh process with a fresh inductor cache. Modes: `compile` = compile-only (eager "
        "autograd), `stock` = stock compiled autograd, `subclass_ca` = `enable()` (regional pieces), "
        "`subclass_ca_whole` = `enable(regional=False)` (the single CA graph, before issue 47). Cold = the first step "
        "(forward, backward, SGD; compiles included); CA capture = backward start to the CA graph reaching its "
        f"compiler; steady = median of {s['steady']} steps after 3 warm-up steps. Modes interleaved per depth, order "
        f"alternating; ratios to compile-only per repetition ({s['target_reps']} at L = 32, {s['reps']} elsewhere), "
        f"median (min-max). torch {result['torch']}.",
        "",
        *targets_table(TARGETS, result["verdicts"]),
        "",
        f"What still grows with depth is compiled autograd's own capture, per block: {slopes or 'not measured'}.",
        "",
        *_table(result),
        "",
        "![cold start against depth](depth.png)",
        "",
        f"Command: `{command_of(result, command, 'python -m tools bench --depth')}` ({result['wall_s']:.0f} s).",
        "",
    ]
    return "\n".join(lines)


def format_summary(result: dict[str, Any]) -> str:
    return "\n".join(_table(result) + verdict_lines(TARGETS, result["verdicts"]) + [f"wall {result['wall_s']:.0f} s"])


def plot(result: dict[str, Any], path: str) -> bool:
    """Cold first step against depth, one panel per model, one line per mode (matplotlib; False without it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = sorted({r["model"] for r in result["rows"] if "cold_s" in r})
    if not models:
        return False
    figure, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 3.6), squeeze=False)
    for axis, model in zip(axes[0], models):
        for mode in (*MODES, "subclass_ca_whole"):
            points = sorted((r["depth"], r["cold_s"]) for r in result["rows"] if r["model"] == model and r["mode"] == mode and "cold_s" in r)
            if points:
                axis.plot(*zip(*points), marker="o", label=mode)
        axis.set_title(model)
        axis.set_xlabel("blocks (L)")
        axis.set_ylabel("cold first step (s)")
        axis.grid(alpha=0.3)
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


# --- python -m tools depth (the GPU check's L = 32 row; make bench runs the sweep through bench --depth) -----


def build_parser() -> Any:
    import argparse

    p = argparse.ArgumentParser(prog="python -m tools depth", description="cold start against depth, regional "
                                "compiled autograd: compile-only vs stock CA vs subclass_ca (fresh processes)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--depths", type=int, nargs="+", default=list(DepthBench.depths))
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--target-reps", type=int, default=DepthBench.target_reps, help="samples per mode at L = 32")
    p.add_argument("--whole-depth", type=int, nargs="+", default=[DepthBench.whole_depth],
                   help="depth(s) of the regional=False reference sample (0: none)")
    p.add_argument("--steady", type=int, default=DepthBench.steady)
    p.add_argument("--json", metavar="PATH", help="write the result (samples, rows, verdicts) here")
    return p


def settings_from_args(argv: Sequence[str]) -> DepthBench:
    args = build_parser().parse_args(list(argv))
    return DepthBench(device=args.device, depths=tuple(args.depths), models=tuple(args.models), modes=tuple(args.modes),
                      target_reps=args.target_reps, steady=args.steady,
                      whole_depth=args.whole_depth[0] if len(args.whole_depth) == 1 else tuple(args.whole_depth))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = settings_from_args(argv)
    args = build_parser().parse_args(argv)
    result = bench(settings)
    result["command"] = "python -m tools depth " + " ".join(argv)
    print(format_summary(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(result), f, indent=1)
    failed = [s for s in result["samples"] if "error" in s]
    return 1 if failed else 0


if __name__ == "__main__":
    print(json.dumps(sample(json.loads(sys.argv[1]))))

"""FSDP2 (``fully_shard``) step time: eager FSDP2, compile-only and subclass_ca, interleaved, gradients checked.

``python -m tools bench --fsdp2 --nproc 2`` (or :func:`bench`) launches ``world_size``
ranks (gloo on 127.0.0.1; NCCL with ``device="cuda"``) that each time, per row:

* ``micro``: the parity MLP (``fsdp2_parity.FSDP2Run``'s default, plain weights), ``micro_runs``
  independent runs (fresh models each) so the "median over >= 3 runs" target has its runs;
* ``block_two_tensor``: two transformer blocks (RMSNorm, causal SDPA attention, SwiGLU), every
  weight a torch TwoTensor, one ``fully_shard`` per block;
* ``block_nf4_lora``: the same blocks as QLoRA: frozen torchao NF4 projections + trainable LoRA
  factors (skipped, with the reason, without torchao);

each under every backend of ``backends``, in three modes built from the same seed: ``eager``
(eager FSDP2), ``compile`` (``torch.compile(model)`` forward, eager backward) and
``subclass_ca`` (compiled forward, backward under ``subclass_ca.enable(backend=...)``: the CA
graph split at FSDP2's hooks, Note [Splitting the CA graph at FSDP2's hooks]) and
``graph_breaks`` (the same under ``enable(backend=..., fullgraph=False)``: the CA graph compiled
whole with Dynamo graph breaks at the hooks, the path before the split).  A step is
``zero_grad`` + forward + mse loss + backward + SGD step.

Timing: after the cold step and ``warmup`` steps, ``reps`` interleaved rounds of ``block``
steps per mode (the order alternates; a barrier starts each sample; rank 0's clock).  The
ratio to eager FSDP2 is taken *within* each round (this machine is noisy: two modes timed
seconds apart differ more than two modes timed side by side) and reported as the median with
its IQR.  Correctness: every rank's gradient shards after the cold step and its parameter
shards after the last step against eager FSDP2's (same data, same number of steps):
bitwise on ``aot_eager``, ``atol = rtol = 1e-4`` on inductor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from subclass_ca import _compat
from tools.common.report import as_json as to_json
from tools.common.report import command_of, targets_table, verdict_lines
from tools.common.stats import quartiles
from tools.fsdp2 import parity
from tools.fsdp2.runs import MODELS, TOLERANCE, compare_shards, local_shards, unavailable

__all__ = ["FSDP2Bench", "MODES", "TARGETS", "bench", "markdown_section", "format_summary", "to_json"]

MODES: tuple[str, ...] = ("eager", "compile", "subclass_ca", "graph_breaks")
#: the backward context of each CA mode: ``enable(backend=..., **kwargs)``
CA_MODES: dict[str, dict[str, Any]] = {"subclass_ca": {}, "graph_breaks": {"fullgraph": False}}
TARGETS: dict[str, str] = {
    "micro": "micro MLP, aot_eager: subclass_ca <= 1.00x eager FSDP2 (median of the runs' median ratios, >= 3 runs)",
    "blocks": "transformer-block rows, inductor: subclass_ca <= 0.90x eager FSDP2 (median ratio, every row)",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDP2Bench:
    """Rows and schedule of one FSDP2 bench run (every rank uses the same)."""

    models: tuple[str, ...] = tuple(MODELS)
    backends: tuple[str, ...] = ("aot_eager", "inductor")
    micro_backends: tuple[str, ...] = ("aot_eager",)
    """Backends of the ``micro`` row (the micro target is judged on aot_eager)."""
    micro_runs: int = 3
    """Independent runs of the ``micro`` row (fresh models)."""
    warmup: int = 2
    reps: int = 9
    block: int = 3
    """Steps per timed sample."""
    device: str = "cpu"

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise ValueError(f"FSDP2Bench.models: unknown {unknown}; allowed values are {list(MODELS)}")
        for name in ("micro_runs", "reps", "block"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"FSDP2Bench.{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"FSDP2Bench.warmup must be an int >= 0, got {self.warmup!r}")
        if self.device not in parity.DEVICES:
            raise ValueError(f"FSDP2Bench.device: got {self.device!r}, allowed values are {parity.DEVICES}")

    def rows(self) -> list[tuple[str, str, int]]:
        """(model, backend, run index) in the order they are timed."""
        out = []
        for model in self.models:
            backends = self.micro_backends if model == "micro" else self.backends
            runs = self.micro_runs if model == "micro" else 1
            out += [(model, backend, index) for backend in backends for index in range(runs)]
        return out


# --- one rank ------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class _Mode:
    name: str
    model: nn.Module
    step: Callable[[], None]
    cold_ms: float = float("nan")
    samples: list[float] = dataclasses.field(default_factory=list)
    grads_first: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    params_last: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def _build_mode(name: str, run: parity.FSDP2Run, rank: int) -> _Mode:
    model = parity.build_model(run)
    parity.shard(model, run)
    forward: Callable[..., torch.Tensor] = model if name == "eager" else torch.compile(model, backend=run.backend)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=run.lr)
    context: Callable[[], Any] = contextlib.nullcontext
    if name in CA_MODES:
        from subclass_ca.api import enable

        ours = enable(backend=run.backend, **CA_MODES[name])
        context = lambda: ours  # noqa: E731 - one enable() object per mode, entered every step
    counter = iter(range(1 << 30))

    def step() -> None:
        x, y = parity.rank_batch(run, rank, next(counter))
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(forward(x), y)
        with context():
            loss.backward()
        optimizer.step()

    return _Mode(name=name, model=model, step=step)


class _Steps(Protocol):
    """What :func:`timed_steps` times: a mode's ``step()`` (this bench's ``_Mode``, the DDP bench's)."""

    @property
    def step(self) -> Callable[[], None]: ...


def timed_steps(mode: _Steps, steps: int, device: str) -> float:
    """``steps`` steps of ``mode`` after a barrier; ms per step on this rank's clock."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        mode.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3 / steps


def _row(rank: int, settings: FSDP2Bench, model_name: str, backend: str) -> dict[str, Any]:
    from subclass_ca.api import reset
    from subclass_ca.diagnostics import last_report

    run = dataclasses.replace(MODELS[model_name], backend=backend, device=settings.device)
    reset()
    modes = [_build_mode(name, run, rank) for name in MODES]
    report = None
    for mode in modes:
        mode.cold_ms = timed_steps(mode, 1, settings.device)
        mode.grads_first = local_shards({n: p.grad for n, p in mode.model.named_parameters() if p.requires_grad})
        if mode.name == "subclass_ca":
            report = last_report()
    for _ in range(settings.warmup):
        for mode in modes:
            timed_steps(mode, 1, settings.device)
    for rep in range(settings.reps):
        order = modes if rep % 2 == 0 else modes[::-1]
        for mode in order:
            mode.samples.append(timed_steps(mode, settings.block, settings.device))
    tol = TOLERANCE.get(backend, TOLERANCE["inductor"])
    eager = modes[0]
    out: dict[str, Any] = {"model": model_name, "backend": backend, "label": run.label,
                           "split_pieces": getattr(report, "split_pieces", None), "modes": {}}
    for mode in modes:
        mode.params_last = local_shards({n: p for n, p in mode.model.named_parameters() if p.requires_grad})
        grad_problems, grad_diff = compare_shards(mode.grads_first, eager.grads_first, tol)
        param_problems, param_diff = compare_shards(mode.params_last, eager.params_last, tol)
        ratios = [s / e for s, e in zip(mode.samples, eager.samples)]
        out["modes"][mode.name] = {
            "cold_ms": mode.cold_ms,
            "samples_ms": mode.samples,
            "ratios": ratios,
            "correct": not grad_problems and not param_problems,
            "max_abs_diff": max(grad_diff, param_diff),
            "problems": (grad_problems + param_problems)[:4],
        }
    return out


def _rank_main(rank: int, world_size: int, settings: FSDP2Bench) -> dict[str, Any]:
    start = time.perf_counter()
    rows = []
    with _compat.uncached_compiles():
        for model_name, backend, index in settings.rows():
            skip = unavailable(model_name)
            if skip:
                rows.append({"model": model_name, "backend": backend, "run": index, "skipped": skip})
                continue
            try:
                row = _row(rank, settings, model_name, backend)
            except Exception as error:  # noqa: BLE001 - a row's failure is a result (every rank fails alike)
                message = str(error).strip().splitlines()[0] if str(error).strip() else ""
                row = {"model": model_name, "backend": backend, "error": f"{type(error).__name__}: {message}"[:300]}
            row["run"] = index
            rows.append(row)
    return {"rank": rank, "rows": rows, "wall_s": time.perf_counter() - start}


# --- the launch and its summary ----------------------------------------------------


def _summarize_row(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One row from every rank's copy of it: rank 0's timings, every rank's correctness."""
    first = per_rank[0]
    if "modes" not in first:
        return dict(first)
    row = {k: first[k] for k in ("model", "backend", "label", "run", "split_pieces")}
    row["modes"] = {}
    for name, entry in first["modes"].items():
        q1, median, q3 = quartiles(entry["samples_ms"])
        r1, ratio, r3 = quartiles(entry["ratios"])
        ranks = [r["modes"][name] for r in per_rank]
        row["modes"][name] = {
            "median_ms": median, "iqr_ms": (q1, q3), "ratio": ratio, "ratio_iqr": (r1, r3),
            "cold_ms": entry["cold_ms"],
            "correct": all(r["correct"] for r in ranks),
            "max_abs_diff": max(r["max_abs_diff"] for r in ranks),
            "problems": [p for r in ranks for p in r["problems"]][:4],
        }
    return row


def _row_of(rank_result: dict[str, Any], like: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in rank_result["rows"]
                if (r["model"], r["backend"], r.get("run")) == (like["model"], like["backend"], like.get("run")))


def verdicts(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each target of :data:`TARGETS`: met (True/False, None when not measured) and the figures behind it."""
    micro = [r for r in rows if r["model"] == "micro" and r.get("backend") == "aot_eager" and "modes" in r]
    out: dict[str, dict[str, Any]] = {}
    if len(micro) >= 3:
        per_run = [r["modes"]["subclass_ca"]["ratio"] for r in micro]
        median = statistics.median(per_run)
        out["micro"] = {"met": median <= 1.00, "detail": f"{median:.3f}x (runs: {', '.join(f'{x:.3f}' for x in per_run)})"}
    else:
        out["micro"] = {"met": None, "detail": f"{len(micro)} micro run(s) measured, 3 needed"}
    blocks = [r for r in rows if r["model"] != "micro" and r.get("backend") == "inductor" and "modes" in r]
    if blocks:
        worst = max(r["modes"]["subclass_ca"]["ratio"] for r in blocks)
        details = ", ".join(f"{r['model']} {r['modes']['subclass_ca']['ratio']:.3f}x" for r in blocks)
        out["blocks"] = {"met": worst <= 0.90, "detail": details}
    else:
        out["blocks"] = {"met": None, "detail": "no inductor block row measured"}
    return out


def bench(
    world_size: int = 2, *, settings: FSDP2Bench | None = None, timeout_s: float = 900.0
) -> dict[str, Any]:
    """Launch ``world_size`` ranks, time every row, check it, and summarise (JSON-able)."""
    from subclass_ca.distributed import run_workers

    settings = settings or FSDP2Bench()
    start = time.perf_counter()
    per_rank = run_workers(_rank_main, world_size, timeout_s=timeout_s, args=(settings,), device=settings.device)
    rows = [_summarize_row([_row_of(r, row) for r in per_rank]) for row in per_rank[0]["rows"]]
    ok = all(m["correct"] for r in rows if "modes" in r for m in r["modes"].values()) and not any("error" in r for r in rows)
    device_flag = " --device cuda" if settings.device == "cuda" else ""
    return {
        "world_size": world_size,
        "settings": dataclasses.asdict(settings),
        "torch": torch.__version__,
        "rows": rows,
        "verdicts": verdicts(rows),
        "ok": ok,
        "wall_s": time.perf_counter() - start,
        "command": f"python -m tools bench --fsdp2 --nproc {world_size}{device_flag}",
    }


def _table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| model | backend | run | mode | median step ms (IQR) | x eager FSDP2, per round: median (IQR) | cold ms | = eager FSDP2 (max abs diff) |",
        "|---|---|---:|---|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        if "modes" not in row:
            reason = row.get("skipped") or row.get("error")
            lines.append(f"| {row['model']} | {row['backend']} | {row.get('run', 0) + 1} | - | - | - | - | {reason} |")
            continue
        for name, m in row["modes"].items():
            ratio = "1.00" if name == "eager" else f"{m['ratio']:.3f} ({m['ratio_iqr'][0]:.3f}-{m['ratio_iqr'][1]:.3f})"
            check = "-" if name == "eager" else (f"yes ({m['max_abs_diff']:.1e})" if m["correct"] else f"NO: {'; '.join(m['problems'][:2])}")
            lines.append(
                f"| {row['model']} | {row['backend']} | {row['run'] + 1} | {name} | {m['median_ms']:.2f} "
                f"({m['iqr_ms'][0]:.2f}-{m['iqr_ms'][1]:.2f}) | {ratio} | {m['cold_ms']:.0f} | {check} |"
            )
    return lines


def markdown_section(result: dict[str, Any], *, command: str | None = None) -> str:
    """RESULTS.md section for :func:`bench`'s result: the targets, then the rows."""
    s = result["settings"]
    lines = [
        "",
        f"## FSDP2 (fully_shard) training, {result['world_size']} processes",
        "",
        f"Device {s['device']} ({'NCCL' if s['device'] == 'cuda' else 'gloo, 127.0.0.1'}), different data per rank, SGD. "
        "Rows: `micro` = MLP (16, 32, 32, 8), one `fully_shard` per linear + root, "
        f"{s['micro_runs']} independent runs; `block_...` = 2 transformer blocks (RMSNorm, 4-head causal SDPA attention, "
        "SwiGLU; dim 64, hidden 128, batch 2 x seq 16), one `fully_shard` per block + root, with TwoTensor weights or "
        "frozen NF4 projections + LoRA (QLoRA). Modes: eager FSDP2; `compile` = compiled forward, eager backward; "
        "`subclass_ca` = compiled forward, backward under `enable()` (CA graph split at FSDP2's hooks, each piece "
        "compiled fullgraph); `graph_breaks` = the same under `enable(fullgraph=False)`: the whole CA graph compiled "
        f"with Dynamo graph breaks at the hooks (the path before the split). Step = zero_grad + forward + loss + backward + SGD step. {s['reps']} interleaved rounds "
        f"of {s['block']} steps per mode after {s['warmup']} warm-up steps (order alternating, a barrier before each "
        "sample, rank 0's clock); the ratio to eager FSDP2 is taken within each round, then its median (IQR). "
        "Correctness: every rank's gradient shards after the cold step and parameter shards after the last step "
        "against eager FSDP2's (bitwise on aot_eager, 1e-4 on inductor). "
        f"torch {result['torch']}.",
        "",
        *targets_table(TARGETS, result["verdicts"]),
        "",
        *_table(result),
        "",
        f"Command: `{command_of(result, command, 'python -m tools bench --fsdp2')}` ({result['wall_s']:.0f} s). On a GPU machine: "
        "`python -m tools bench --fsdp2 --nproc 2 --device cuda` (NCCL, one GPU per rank). Stock compiled autograd "
        "is not timed: it leaves FSDP2's first layer unsharded with an un-reduced gradient (see docs/distributed.md).",
        "",
    ]
    return "\n".join(lines)


def format_summary(result: dict[str, Any]) -> str:
    """The result as plain text (targets and the markdown table without the prose)."""
    targets = verdict_lines(TARGETS, result["verdicts"])
    return "\n".join(_table(result) + targets + [f"wall {result['wall_s']:.0f} s, ok={result['ok']}"])

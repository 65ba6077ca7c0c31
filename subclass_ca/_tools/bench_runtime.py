"""The runtime's own cost next to stock compiled autograd: enter/exit, both training styles, a soak.

What a user pays for subclass_ca over stock CA on every step, measured in one process,
interleaved, warm-up excluded:

* **enter+exit**: one ``with enable():`` with nothing inside vs torch's ``compiled_autograd._enable``;
* **styles**: per (model, backend), one compiled workload per CA mode, stepped with the
  context entered *per step* and entered *once* around a block of steps; µs per step,
  median with IQR over rounds, ratio subclass_ca / stock per style;
* **soak**: ``soak_steps`` steps per mode (entered once); process RSS, subclass_ca's named
  callables and CA captures at step 100 and at the end.  RSS is process-wide, so the modes
  run one after the other and each reports its own growth between the two checkpoints.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from .. import _compat
from .. import api as _api
from ..diagnostics import named_callables
from . import bench_models as _bench_models

__all__ = ["RuntimeBench", "run", "markdown_section", "TARGETS"]

TARGETS: dict[str, str] = {
    "enter_exit": "enable() enter+exit <= stock compiled autograd's",
    "per_step": "steady state, context entered per step: subclass_ca / stock CA <= 1.00 on every row",
    "once": "steady state, context entered once: subclass_ca / stock CA <= 1.00 on every row",
    "soak_rss": "RSS growth from step 100 to the end: subclass_ca <= stock CA (+256 KiB allocator slack)",
    "soak_callables": "no growth of named callables or CA captures after step 100 (subclass_ca)",
}
CA_MODES = ("stock_ca", "subclass_ca")
_RSS_SLACK_KIB = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeBench:
    """What the runtime bench measures (validated)."""

    models: tuple[str, ...] = ("plain", "pair", "int8_lora", "dtensor")
    size: str = "small"
    backends: tuple[str, ...] = ("aot_eager", "inductor")
    device: str = "cpu"
    rounds: int = 15
    """Interleaved rounds per style (each round times ``block`` steps of every configuration)."""
    block: int = 20
    warmup: int = 5
    enter_exit_pairs: int = 2000
    soak_steps: int = 1000
    soak_model: str = "pair"

    def __post_init__(self) -> None:
        bad = [m for m in self.models if m not in _bench_models.MODELS]
        if bad or not self.models:
            raise ValueError(f"RuntimeBench: unknown models {bad}; allowed values are {sorted(_bench_models.MODELS)}")
        if self.soak_model not in _bench_models.MODELS:
            raise ValueError(f"RuntimeBench.soak_model: got {self.soak_model!r}, allowed values are {sorted(_bench_models.MODELS)}")
        if self.size not in _bench_models.SIZES:
            raise ValueError(f"RuntimeBench.size: got {self.size!r}, allowed values are {sorted(_bench_models.SIZES)}")
        for name in ("rounds", "block", "enter_exit_pairs"):
            if getattr(self, name) < 1:
                raise ValueError(f"RuntimeBench.{name} must be >= 1, got {getattr(self, name)}")
        if self.soak_steps and self.soak_steps < 200:
            raise ValueError(f"RuntimeBench.soak_steps must be 0 (off) or >= 200, got {self.soak_steps}")


def _context_factory(mode: str, backend: str) -> Callable[[], Any]:
    if mode == "stock_ca":
        compiler_fn = _compat.stock_ca_compiler(backend)
        return lambda: _compat.enable_compiled_autograd(compiler_fn)
    ours = _api.enable(backend)
    return lambda: ours


@dataclasses.dataclass(kw_only=True)
class _Workload:
    mode: str
    backend: str
    model: str
    context: Callable[[], Any]
    step: Callable[[], None]
    per_step_us: list[float] = dataclasses.field(default_factory=list)
    once_us: list[float] = dataclasses.field(default_factory=list)


def _build(model: str, mode: str, backend: str, settings: RuntimeBench, tag: str) -> _Workload:
    workload = _bench_models.build(model, settings.size, settings.device, tag=f"{tag}_{mode}_{backend}")
    forward = torch.compile(workload.forward, backend=backend)
    params, inputs = workload.params, workload.inputs
    sync = torch.cuda.synchronize if settings.device == "cuda" else (lambda: None)

    def step() -> None:
        for p in params:
            p.grad = None
        forward(params, *inputs).backward()
        sync()

    return _Workload(mode=mode, backend=backend, model=model, context=_context_factory(mode, backend), step=step)


def _time_per_step(work: _Workload, steps: int) -> float:
    context, step = work.context, work.step
    start = time.perf_counter()
    for _ in range(steps):
        with context():
            step()
    return (time.perf_counter() - start) * 1e6 / steps


def _time_once(work: _Workload, steps: int) -> float:
    step = work.step
    with work.context():
        start = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - start) * 1e6 / steps


def _stats(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive") if len(ordered) > 1 else (ordered[0],) * 3
    return {"median": statistics.median(ordered), "q1": q1, "q3": q3, "min": ordered[0], "max": ordered[-1]}


def _styles(settings: RuntimeBench, progress: Callable[[], None]) -> list[dict[str, Any]]:
    rows = []
    for model in settings.models:
        for backend in settings.backends:
            works = [_build(model, mode, backend, settings, "runtime") for mode in CA_MODES]
            for work in works:  # cold capture + warm-up, in both styles
                for _ in range(settings.warmup):
                    _time_per_step(work, 1)
                    _time_once(work, 1)
            for index in range(settings.rounds):
                order = works if index % 2 == 0 else works[::-1]
                for work in order:
                    work.per_step_us.append(_time_per_step(work, settings.block))
                for work in order:
                    work.once_us.append(_time_once(work, settings.block))
            stock, ours = works
            row: dict[str, Any] = {"model": model, "backend": backend}
            for style in ("per_step", "once"):
                samples = {w.mode: getattr(w, f"{style}_us") for w in works}
                row[style] = {mode: _stats(values) for mode, values in samples.items()}
                row[style]["ratio"] = statistics.median(samples["subclass_ca"]) / statistics.median(samples["stock_ca"])
                # ratio of per-round pairs: how often ours was at or below stock in the same round
                row[style]["rounds_at_or_below"] = sum(o <= s for o, s in zip(samples["subclass_ca"], samples["stock_ca"]))
                row[style]["rounds"] = len(samples["stock_ca"])
            rows.append(row)
            progress()
    return rows


def _enter_exit(settings: RuntimeBench) -> dict[str, Any]:
    backend = settings.backends[0]
    contexts = {mode: _context_factory(mode, backend) for mode in CA_MODES}
    for make in contexts.values():
        for _ in range(200):
            with make():
                pass
    samples: dict[str, list[float]] = {mode: [] for mode in contexts}
    pairs = max(settings.enter_exit_pairs // 7, 1)
    for index in range(7):
        for mode in (CA_MODES if index % 2 == 0 else CA_MODES[::-1]):
            make = contexts[mode]
            start = time.perf_counter()
            for _ in range(pairs):
                with make():
                    pass
            samples[mode].append((time.perf_counter() - start) * 1e6 / pairs)
    result: dict[str, Any] = {mode: _stats(values) for mode, values in samples.items()}
    result["ratio"] = result["subclass_ca"]["median"] / result["stock_ca"]["median"]
    return result


def rss_kib() -> int:
    """Resident set size of this process now (Linux ``/proc``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024
    except (OSError, ValueError, IndexError):
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def _soak(settings: RuntimeBench, progress: Callable[[], None]) -> list[dict[str, Any]]:
    backend = "aot_eager" if "aot_eager" in settings.backends else settings.backends[0]
    rows = []
    for mode in CA_MODES:
        work = _build(settings.soak_model, mode, backend, settings, "soak")
        checkpoints: dict[int, dict[str, int]] = {}
        with work.context():
            for step in range(1, settings.soak_steps + 1):
                work.step()
                if step in (100, settings.soak_steps):
                    gc.collect()
                    checkpoints[step] = {
                        "rss_kib": rss_kib(),
                        "named_callables": len(named_callables()),
                        "captures": int(_compat.ca_counters().get("captures", 0)),
                    }
        first, last = checkpoints[100], checkpoints[settings.soak_steps]
        rows.append({
            "mode": mode, "model": settings.soak_model, "backend": backend, "steps": settings.soak_steps,
            "at_100": first, "at_end": last,
            "rss_growth_kib": last["rss_kib"] - first["rss_kib"],
            "callable_growth": last["named_callables"] - first["named_callables"],
            "capture_growth": last["captures"] - first["captures"],
        })
        progress()
    return rows


def run(settings: RuntimeBench, progress: Callable[[], None] = lambda: None) -> dict[str, Any]:
    """Measure enter/exit, both styles per (model, backend) and the soak; the verdicts included."""
    _compat.require_support()
    result: dict[str, Any] = {"settings": dataclasses.asdict(settings)}
    result["enter_exit_us"] = _enter_exit(settings)
    result["styles"] = _styles(settings, progress)
    result["soak"] = _soak(settings, progress) if settings.soak_steps else []
    result["verdicts"] = verdicts(result)
    return result


def verdicts(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    enter = result["enter_exit_us"]
    out["enter_exit"] = {
        "met": enter["ratio"] <= 1.0,
        "detail": f"{enter['subclass_ca']['median']:.2f} vs {enter['stock_ca']['median']:.2f} µs ({enter['ratio']:.2f}x)",
    }
    for style in ("per_step", "once"):
        rows = result["styles"]
        missed = [f"{r['model']}[{r['backend']}] {r[style]['ratio']:.3f}" for r in rows if r[style]["ratio"] > 1.0]
        out[style] = {
            "met": not missed if rows else None,
            "detail": (f"{len(rows) - len(missed)}/{len(rows)} rows met" + (f"; missed: {', '.join(missed)}" if missed else ""))
            if rows else "not measured",
        }
    soak = {row["mode"]: row for row in result.get("soak", [])}
    if soak:
        ours, stock = soak["subclass_ca"], soak["stock_ca"]
        out["soak_rss"] = {
            "met": ours["rss_growth_kib"] <= stock["rss_growth_kib"] + _RSS_SLACK_KIB,
            "detail": f"subclass_ca {ours['rss_growth_kib']:+d} KiB vs stock {stock['rss_growth_kib']:+d} KiB "
                      f"(steps 100 -> {ours['steps']})",
        }
        out["soak_callables"] = {
            "met": ours["callable_growth"] == 0 and ours["capture_growth"] == 0,
            "detail": f"named callables {ours['callable_growth']:+d}, CA captures {ours['capture_growth']:+d}",
        }
    else:
        out["soak_rss"] = out["soak_callables"] = {"met": None, "detail": "not measured"}
    return out


def _fmt_stats(stats: dict[str, float]) -> str:
    return f"{stats['median']:.1f} ({stats['q1']:.1f}–{stats['q3']:.1f})"


def markdown_section(result: dict[str, Any]) -> str:
    """The "Runtime overhead" section of RESULTS.md."""
    settings = result["settings"]
    lines = [
        "## Runtime overhead: subclass_ca vs stock compiled autograd",
        "",
        f"Same process, interleaved (order alternates per round), warm-up excluded; models at size "
        f"`{settings['size']}`, {settings['rounds']} rounds of {settings['block']} steps per style. A step is "
        "`zero_grad + forward + backward`; *per step* enters the context around every step, *once* enters it "
        "around the whole block. Medians with IQR in µs.",
        "",
        "| target | verdict | detail |",
        "|---|---|---|",
    ]
    for key, text in TARGETS.items():
        verdict = result["verdicts"][key]
        mark = {True: "met", False: "**missed**", None: "n/a"}[verdict["met"]]
        lines.append(f"| {text} | {mark} | {verdict['detail']} |")
    enter = result["enter_exit_us"]
    lines += [
        "",
        f"enter+exit: subclass_ca {_fmt_stats(enter['subclass_ca'])} µs, stock {_fmt_stats(enter['stock_ca'])} µs "
        f"(ratio {enter['ratio']:.2f}).",
        "",
        "| model | backend | stock, per step | subclass_ca, per step | ratio | rounds ≤ stock | stock, once | subclass_ca, once | ratio | rounds ≤ stock |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in result["styles"]:
        cells = []
        for style in ("per_step", "once"):
            data = row[style]
            cells += [_fmt_stats(data["stock_ca"]), _fmt_stats(data["subclass_ca"]), f"{data['ratio']:.3f}",
                      f"{data['rounds_at_or_below']}/{data['rounds']}"]
        lines.append(f"| {row['model']} | {row['backend']} | " + " | ".join(cells) + " |")
    if result.get("soak"):
        lines += [
            "",
            "| soak | model | backend | RSS KiB at 100 | at end | growth | named callables 100 → end | CA captures 100 → end |",
            "|---|---|---|---:|---:|---:|---|---|",
        ]
        for row in result["soak"]:
            a, b = row["at_100"], row["at_end"]
            lines.append(
                f"| {row['mode']} ({row['steps']} steps) | {row['model']} | {row['backend']} | {a['rss_kib']} | {b['rss_kib']} | "
                f"{row['rss_growth_kib']:+d} | {a['named_callables']} → {b['named_callables']} | {a['captures']} → {b['captures']} |"
            )
    return "\n".join(lines) + "\n"

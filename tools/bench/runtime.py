"""The runtime's own cost next to stock compiled autograd: enter/exit and a soak.

The per-step cost in both training styles (context entered per step, entered once) is
measured on every row of the main bench (``bench.py``, same compiled workloads); this module
adds what those rows cannot show:

* **enter+exit**: one ``with enable():`` with nothing inside vs torch's
  ``compiled_autograd._enable``, interleaved rounds, median with spread; our object both
  reused and fresh per pair (``with subclass_ca.enable(backend=...):`` in a training loop
  builds one per step: construction + enter + exit).  Stock's context is single-use (a
  generator), so its row is always a fresh one.  Timed as this thread's CPU time
  (``time.thread_time``): the pairs are CPU work in one thread that never waits, and on a
  shared machine wall time also counts the slices the scheduler gives other processes
  (rounds then differ by 2x or more);
* **soak**: ``soak_steps`` steps per CA mode (entered once); process RSS, subclass_ca's named
  callables and CA captures at step 100 and at the end.  RSS is process-wide, so the modes
  run one after the other and each reports its own growth between the two checkpoints.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable
from typing import Any

import torch

from subclass_ca import _compat
from subclass_ca import api as _api
from subclass_ca.diagnostics import named_callables
from tools.common.report import as_json as to_json
from tools.common.report import targets_table, verdict_lines
from tools.common.stats import rss_bytes, stats

from . import models as _bench_models

__all__ = ["RuntimeBench", "run", "verdicts", "markdown_section", "format_summary", "to_json", "TARGETS"]

TARGETS: dict[str, str] = {
    "enter_exit": "enable() enter+exit <= stock compiled autograd's",
    "enter_exit_fresh": "a fresh enable(...) per step: construction + enter + exit <= stock compiled autograd's",
    "soak_rss": "RSS growth from step 100 to the end of the soak: subclass_ca <= stock CA (+256 KiB allocator slack)",
    "soak_callables": "no growth of named callables or CA captures after step 100 (subclass_ca)",
}
CA_MODES = ("stock_ca", "subclass_ca")
ENTER_EXIT_MODES = (*CA_MODES, "subclass_ca_fresh")
"""``subclass_ca_fresh``: a new ``enable(backend=...)`` object per enter+exit (the training-loop idiom)."""
_RSS_SLACK_KIB = 256
_ROUNDS = 7


@dataclasses.dataclass(frozen=True, kw_only=True)
class RuntimeBench:
    """What the runtime bench measures (validated)."""

    backend: str = "aot_eager"
    size: str = "small"
    device: str = "cpu"
    enter_exit_pairs: int = 2000
    """enter+exit pairs per mode, split over 7 interleaved rounds."""
    soak_steps: int = 1000
    """Steps per CA mode (0: no soak)."""
    soak_model: str = "pair"

    def __post_init__(self) -> None:
        if self.soak_model not in _bench_models.MODELS:
            raise ValueError(f"RuntimeBench.soak_model: got {self.soak_model!r}, allowed values are {sorted(_bench_models.MODELS)}")
        sizes = _bench_models.BLOCK_SIZES if self.soak_model in _bench_models.REALISTIC else _bench_models.SIZES
        if self.size not in sizes:
            raise ValueError(f"RuntimeBench.size: got {self.size!r}, allowed values are {sorted(sizes)}")
        if self.enter_exit_pairs < _ROUNDS:
            raise ValueError(f"RuntimeBench.enter_exit_pairs must be >= {_ROUNDS}, got {self.enter_exit_pairs}")
        if self.soak_steps and self.soak_steps < 200:
            raise ValueError(f"RuntimeBench.soak_steps must be 0 (off) or >= 200, got {self.soak_steps}")


def _context_factory(mode: str, backend: str) -> Callable[[], Any]:
    if mode == "stock_ca":
        compiler_fn = _compat.stock_ca_compiler(backend)
        return lambda: _compat.enable_compiled_autograd(compiler_fn)
    if mode == "subclass_ca_fresh":
        return lambda: _api.enable(backend=backend)
    ours = _api.enable(backend)
    return lambda: ours


def _enter_exit(settings: RuntimeBench) -> dict[str, Any]:
    contexts = {mode: _context_factory(mode, settings.backend) for mode in ENTER_EXIT_MODES}
    for make in contexts.values():
        for _ in range(200):
            with make():
                pass
    samples: dict[str, list[float]] = {mode: [] for mode in contexts}
    pairs = settings.enter_exit_pairs // _ROUNDS
    for index in range(_ROUNDS):
        for mode in (ENTER_EXIT_MODES if index % 2 == 0 else ENTER_EXIT_MODES[::-1]):
            make = contexts[mode]
            start = time.thread_time()
            for _ in range(pairs):
                with make():
                    pass
            samples[mode].append((time.thread_time() - start) * 1e6 / pairs)
    result: dict[str, Any] = {mode: stats(values) for mode, values in samples.items()}
    result["ratio"] = result["subclass_ca"]["median"] / result["stock_ca"]["median"]
    result["ratio_fresh"] = result["subclass_ca_fresh"]["median"] / result["stock_ca"]["median"]
    return result


def _soak(settings: RuntimeBench) -> list[dict[str, Any]]:
    rows = []
    for mode in CA_MODES:
        workload = _bench_models.build(settings.soak_model, settings.size, settings.device, tag=f"soak_{mode}")
        forward = torch.compile(workload.forward, backend=settings.backend)
        params, inputs = workload.params, workload.inputs
        checkpoints: dict[int, dict[str, int]] = {}
        with _context_factory(mode, settings.backend)():
            for step in range(1, settings.soak_steps + 1):
                for p in params:
                    p.grad = None
                forward(params, *inputs).backward()
                if step in (100, settings.soak_steps):
                    gc.collect()
                    checkpoints[step] = {
                        "rss_kib": rss_bytes() // 1024,
                        "named_callables": len(named_callables()),
                        "captures": int(_compat.ca_counters().get("captures", 0)),
                    }
        first, last = checkpoints[100], checkpoints[settings.soak_steps]
        rows.append({
            "mode": mode, "model": settings.soak_model, "backend": settings.backend, "steps": settings.soak_steps,
            "at_100": first, "at_end": last,
            "rss_growth_kib": last["rss_kib"] - first["rss_kib"],
            "callable_growth": last["named_callables"] - first["named_callables"],
            "capture_growth": last["captures"] - first["captures"],
        })
    return rows


def run(settings: RuntimeBench) -> dict[str, Any]:
    """Measure enter/exit and the soak; the verdicts included."""
    _compat.require_support()
    result: dict[str, Any] = {"settings": dataclasses.asdict(settings)}
    result["enter_exit_us"] = _enter_exit(settings)
    result["soak"] = _soak(settings) if settings.soak_steps else []
    result["verdicts"] = verdicts(result)
    return result


def verdicts(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """target id -> {met: bool | None, detail: str}."""
    out: dict[str, dict[str, Any]] = {}
    enter = result["enter_exit_us"]
    out["enter_exit"] = {
        "met": enter["ratio"] <= 1.0,
        "detail": f"{enter['subclass_ca']['median']:.2f} vs {enter['stock_ca']['median']:.2f} µs ({enter['ratio']:.2f}x)",
    }
    if "subclass_ca_fresh" in enter:
        out["enter_exit_fresh"] = {
            "met": enter["ratio_fresh"] <= 1.0,
            "detail": f"{_fmt_stats(enter['subclass_ca_fresh'])} vs {_fmt_stats(enter['stock_ca'])} µs, median (IQR) "
                      f"({enter['ratio_fresh']:.2f}x)",
        }
    else:
        out["enter_exit_fresh"] = {"met": None, "detail": "not measured"}
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
    return f"{stats['median']:.2f} ({stats['q1']:.2f}–{stats['q3']:.2f})"


def markdown_section(result: dict[str, Any], *, command: str | None = None) -> str:
    """The "Runtime overhead" section of RESULTS.md (inside the main bench's, which names the command; ``command``: name it here)."""
    settings = result["settings"]
    enter = result["enter_exit_us"]
    lines = [
        "## Runtime overhead: enter/exit and soak",
        "",
        f"enter+exit: {settings['enter_exit_pairs']} pairs per mode (a reused `enable()` object and a fresh one "
        f"per pair) in {_ROUNDS} interleaved rounds (order alternating), "
        "200 warm-up pairs excluded; this thread's CPU time (`time.thread_time`), median (IQR) µs. "
        "Soak: the modes one after the other, context entered once, "
        f"`{settings['soak_model']}` at `{settings['size']}`, `{settings['backend']}`.",
        "",
        *targets_table(TARGETS, result["verdicts"]),
    ]
    lines += [
        "",
        "| mode | µs per enter+exit, median (IQR) |",
        "|---|---:|",
        f"| stock compiled_autograd._enable(compiler_fn), a fresh context each time | {_fmt_stats(enter['stock_ca'])} |",
        f"| subclass_ca.enable() | {_fmt_stats(enter['subclass_ca'])} |",
    ]
    if "subclass_ca_fresh" in enter:
        lines.append(f"| subclass_ca.enable(backend=...), a fresh object each time (construction included) | "
                     f"{_fmt_stats(enter['subclass_ca_fresh'])} |")
    if result.get("soak"):
        lines += [
            "",
            "| soak | RSS KiB at step 100 | at the end | growth | named callables 100 → end | CA captures 100 → end |",
            "|---|---:|---:|---:|---|---|",
        ]
        for row in result["soak"]:
            a, b = row["at_100"], row["at_end"]
            lines.append(
                f"| {row['mode']} ({row['steps']} steps) | {a['rss_kib']} | {b['rss_kib']} | {row['rss_growth_kib']:+d} | "
                f"{a['named_callables']} → {b['named_callables']} | {a['captures']} → {b['captures']} |"
            )
    if command:
        lines += ["", f"Command: `{command}`."]
    return "\n".join(lines) + "\n"


def format_summary(result: dict[str, Any]) -> str:
    """The verdicts as plain text."""
    return "\n".join(verdict_lines(TARGETS, result["verdicts"]))

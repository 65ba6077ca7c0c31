"""Where a step's time goes: compile-only (compiled forward, eager autograd) beside stock CA and subclass_ca.

Each realistic block runs the three modes in interleaved rounds; every step is cut at the same places:

* **forward**: the compiled forward (the same graph in every mode);
* **enter+exit**: entering and leaving the mode's context around the step (stock CA's ``_enable``,
  ``subclass_ca.enable``; nothing for compile-only);
* **engine**: ``backward()`` minus the time inside the compiled CA graph: autograd's C++ walk over
  the graph, compiled autograd's cache lookup (collecting every node's sizes and arguments) and
  torch's Python ``runtime_wrapper`` around the graph.  Torch's own floor: stock CA pays it too;
  for compile-only it is the whole eager backward (the walk, the AOT backward's Python wrappers
  and its compiled kernels, the AccumulateGrad nodes);
* **our wrapper**: subclass_ca's ``CompiledCAGraph`` around the compiled graph (Note [Workaround
  scopes], FSDP2 detection; one attribute test once steady);
* **CA graph**: the compiled CA graph itself: the AOT backward kernels pasted in, the subclass
  rebuilds, the gradient accumulation.

Timed with ``time.perf_counter`` in one thread (``--threads 1``); medians over rounds with the
quartiles, per-round step ratios to compile-only with their bootstrap interval.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from subclass_ca._graph import CompiledCAGraph
from tools.common.report import as_json as to_json
from tools.common.report import command_of
from tools.common.stats import paired_ratio, quartiles

from . import models as _bench_models
from .main import mode_context

__all__ = ["bench", "markdown_section", "format_summary", "to_json", "TARGETS", "MODES", "PARTS"]

TARGETS: dict[str, str] = {}
"""The breakdown judges nothing: the steady targets are the main bench's (``vs_compile``, ``steady``)."""
MODES = ("compile", "stock_ca", "subclass_ca")
PARTS = ("forward", "enter_exit", "engine", "our_wrapper", "ca_graph")


class _Clock:
    """Seconds spent inside wrapped callables since the last :meth:`take`."""

    def __init__(self) -> None:
        self.spent = 0.0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start

        return timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


@contextlib.contextmanager
def _clocked_ca_graphs(outer: _Clock, inner: _Clock) -> Iterator[None]:
    """Time subclass_ca's compiled CA graphs: ``outer`` around our wrapper, ``inner`` around the compiled graph."""
    original_call, original_compile = CompiledCAGraph.__call__, CompiledCAGraph._compile

    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original_call(self, *args, **kwargs)
        finally:
            outer.spent += time.perf_counter() - start

    def compile_graph(self: Any, fullgraph: bool) -> Any:
        return inner.wrap(original_compile(self, fullgraph))

    CompiledCAGraph.__call__, CompiledCAGraph._compile = call, compile_graph  # type: ignore[method-assign]
    try:
        yield
    finally:
        CompiledCAGraph.__call__, CompiledCAGraph._compile = original_call, original_compile  # type: ignore[method-assign]


def _mode_step(workload: _bench_models.Workload, mode: str, backend: str, clock: _Clock) -> Callable[[], dict[str, float]]:
    forward = torch.compile(workload.forward, backend=backend)
    context = mode_context(mode, backend, wrap_stock_graph=clock.wrap)  # subclass_ca's graphs: _clocked_ca_graphs
    params, inputs = workload.params, workload.inputs

    def step() -> dict[str, float]:
        for p in params:
            p.grad = None
        t0 = time.perf_counter()
        with context():
            t1 = time.perf_counter()
            loss = forward(params, *inputs)
            t2 = time.perf_counter()
            loss.backward()
            t3 = time.perf_counter()
        t4 = time.perf_counter()
        return {"step": t4 - t0, "forward": t2 - t1, "backward": t3 - t2, "enter_exit": (t1 - t0) + (t4 - t3)}

    return step


def bench(*, models: tuple[str, ...] = _bench_models.REALISTIC, size: str = "medium", backend: str = "inductor",
          rounds: int = 15, block: int = 3, warmup: int = 4, device: str = "cpu") -> dict[str, Any]:
    """Per-part medians (ms per step) for each available realistic block and mode."""
    outer, inner, stock_graph = _Clock(), _Clock(), _Clock()
    result: dict[str, Any] = {"settings": {"models": list(models), "size": size, "backend": backend, "rounds": rounds,
                                           "block": block, "warmup": warmup, "device": device},
                              "rows": [], "skipped": {}}
    with _clocked_ca_graphs(outer, inner):
        for model in models:
            reason = _bench_models.unavailable(model)
            if reason:
                result["skipped"][model] = reason
                continue
            steps = {mode: _mode_step(_bench_models.build(model, size, device, tag=f"breakdown_{mode}"), mode, backend,
                                      stock_graph if mode == "stock_ca" else outer)
                     for mode in MODES}
            samples: dict[str, dict[str, list[float]]] = {mode: {} for mode in MODES}
            for round_index in range(warmup + rounds):
                shift = round_index % len(MODES)
                for mode in MODES[shift:] + MODES[:shift]:
                    outer.take(), inner.take(), stock_graph.take()
                    parts: dict[str, float] = {}
                    for _ in range(block):
                        for name, seconds in steps[mode]().items():
                            parts[name] = parts.get(name, 0.0) + seconds
                    graph_outer = stock_graph.take() if mode == "stock_ca" else outer.take()
                    graph_inner = graph_outer if mode == "stock_ca" else inner.take()
                    if mode == "compile":
                        graph_outer = graph_inner = 0.0
                    parts.update(engine=parts["backward"] - graph_outer, our_wrapper=graph_outer - graph_inner,
                                 ca_graph=graph_inner)
                    if round_index >= warmup:
                        for name, seconds in parts.items():
                            samples[mode].setdefault(name, []).append(seconds * 1e3 / block)
            for mode in MODES:
                row: dict[str, Any] = {"model": model, "mode": mode}
                for name, values in samples[mode].items():
                    q1, median, q3 = quartiles(values)
                    row[name] = {"median": median, "q1": q1, "q3": q3}
                row["vs_compile"] = paired_ratio(samples[mode]["step"], samples["compile"]["step"])
                result["rows"].append(row)
    return result


def _cell(part: dict[str, float] | None) -> str:
    if not part:
        return "—"
    return f"{part['median']:.3f} ({part['q1']:.3f}–{part['q3']:.3f})"


def markdown_section(result: dict[str, Any], *, command: str | None = None) -> str:
    s = result["settings"]
    lines = ["", "## Where a step's time goes (realistic blocks)", "",
             f"- command: `{command_of(result, command, 'python -m tools bench --breakdown')}`",
             f"- {s['backend']}, size {s['size']}, {s['rounds']} rounds x {s['block']} steps after {s['warmup']} warm-up "
             "rounds, modes interleaved; ms per step, median (IQR). Parts: see `tools/bench/breakdown.py`.", "",
             "*engine* is torch's own floor (autograd's walk, compiled autograd's cache lookup and runtime wrapper; "
             "for compile-only, the whole eager backward); *our wrapper* and *enter+exit* are what subclass_ca adds "
             "around it; *CA graph* is the compiled backward itself.", "",
             "| block | mode | step | vs compile | forward | enter+exit | engine | our wrapper | CA graph |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        interval = row.get("vs_compile")
        ratio = f"{interval['ratio']:.3f} [{interval['low']:.3f}–{interval['high']:.3f}]" if interval else "—"
        lines.append(f"| {row['model']} | {row['mode']} | {_cell(row.get('step'))} | {ratio} | {_cell(row.get('forward'))} | "
                     f"{_cell(row.get('enter_exit'))} | {_cell(row.get('engine'))} | {_cell(row.get('our_wrapper'))} | "
                     f"{_cell(row.get('ca_graph'))} |")
    lines += [f"- `{model}`: **skipped**: {reason}" for model, reason in result.get("skipped", {}).items()]
    return "\n".join(lines) + "\n"


def format_summary(result: dict[str, Any]) -> str:
    lines = ["breakdown (ms per step, medians):"]
    for row in result["rows"]:
        parts = ", ".join(f"{name} {row[name]['median']:.3f}" for name in ("step", *PARTS) if name in row)
        interval = row.get("vs_compile")
        lines.append(f"  {row['model']:16s} {row['mode']:12s} {parts}"
                     + (f"; vs compile {interval['ratio']:.3f}" if interval else ""))
    return "\n".join(lines)

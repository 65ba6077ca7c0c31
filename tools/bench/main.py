"""``python -m tools bench``: eager / torch.compile / stock CA / subclass_ca, interleaved.

One process measures every (model, size, mode, backend) configuration:

* **steady** ms per training step (zero_grad + forward + backward), median with IQR and
  min/max over ``reps`` samples of ``block`` steps, after warm-up.  Configurations run
  round-robin (the order rotates every round), so machine noise hits all of them alike;
  timing uses ``time.perf_counter`` (plus ``torch.cuda.synchronize`` on CUDA);
* **cold** ms of the first step (Dynamo + AOT + backend compile and the CA capture).
  Before any configuration runs, one *primer* step per (model, size, backend) in plain
  compile mode warms process-wide state equally; Inductor's FX-graph and AOT-autograd
  caches are disabled for the whole run so no mode is served a graph compiled for another;
* **captures**: CA captures over the first ``1 + warmup + reps * block`` steps and
  CA captures + Dynamo graph compiles after warm-up (recompiles; target 0);
* **growth per forced recapture** (CA cache cleared before each of ``recaptures`` steps):
  ``subclass_ca.named_callables()``, Dynamo's allow_in_graph id set and process RSS;
* **backward memory**: the CA-graph liveness proxy of :mod:`tools.bench.memory`
  (CPU), ``torch.cuda.max_memory_allocated`` around the backward (CUDA);
* **peak memory of one step** per configuration, after the timed steps: on CUDA
  ``torch.cuda.max_memory_allocated`` minus the bytes allocated before the step; on CPU the
  peak of the running sum of the allocator events ``torch.profiler`` records with
  ``profile_memory=True`` (bytes allocated during the step and live at once; see
  :func:`cpu_step_peak_bytes`);
* **realistic workloads** (``bench_models.REALISTIC``: one transformer block each) run in the
  same interleaved rounds but have their own sizes (``realistic_sizes``), fewer samples
  (``realistic_reps`` x ``realistic_block``, ``realistic_cold_reps``), no strict row, and primer
  steps only where kernels differ (inductor: compile + subclass_ca; aot_eager: subclass_ca), since
  their cold compiles dominate the run; they have their own report section, and the targets,
  growth and backward-liveness measurements are judged on the micro MLPs only.
* ratios: subclass_ca / stock CA (steady, cold), eager / CA, subclass / plain, strict / default.

It writes ``RESULTS.md``, ``results.json`` and ``bench.png`` into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol, cast

import torch

from subclass_ca import _compat, _runtime
from subclass_ca import api as _api
from subclass_ca.diagnostics import named_callables
from tools.common import report
from tools.common.progress import Progress
from tools.common.report import combine, targets_table
from tools.common.stats import judge, paired_ratio, rss_bytes
from tools.common.stats import stats as _stats

from . import memory as _bench_memory
from . import models as _bench_models
from . import runtime as _bench_runtime

__all__ = ["main", "build_parser", "settings_from_args", "BenchSettings", "MODES", "TARGETS", "SECTIONS"]

#: mode -> what it runs
MODES: dict[str, str] = {
    "eager": "no compilation",
    "compile": "torch.compile(forward); AOT backward, no compiled autograd",
    "stock_ca": "torch.compile(forward) + torch's compiled autograd (stock epilogue)",
    "subclass_ca": "torch.compile(forward) + subclass_ca.enable()",
    "subclass_ca_strict": "torch.compile(forward) + subclass_ca.enable(strict=True)",
    "subclass_ca_cudagraphs": "torch.compile(forward) + subclass_ca.enable(mode='reduce-overhead'): the static CA graph "
                              "replayed as a CUDA graph (inductor on CUDA only)",
    "subclass_ca_dynamic": "torch.compile(forward) + subclass_ca.enable(dynamic=True): every size symbolic from the first "
                           "capture (torch's default, and ours before static-first; realistic blocks on inductor)",
}
CA_MODES = ("stock_ca", "subclass_ca", "subclass_ca_strict", "subclass_ca_cudagraphs", "subclass_ca_dynamic")
#: target id -> statement
TARGETS: dict[str, str] = {
    "steady": "subclass_ca / stock CA <= 1.00 (steady state, context entered per step; every row)",
    "steady_once": "subclass_ca / stock CA <= 1.00 (steady state, context entered once around the steps; every row)",
    "vs_compile": "subclass_ca / compile-only <= 1.00 (steady state, realistic blocks: compiled forward, eager autograd)",
    "cold": "subclass_ca / stock CA <= 1.05 (cold first step)",
    "vs_eager": "subclass_ca >= 2x faster than eager on the subclass models",
    "recompiles": "0 recompiles after warm-up (subclass_ca)",
    "callables": "0 growth of graph callables per recapture (subclass_ca)",
    "k_ratio": "subclass (k inner tensors) / plain <= k under subclass_ca",
    "memory": "backward memory: subclass_ca <= stock CA",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchSettings:
    """What one bench run measures (validated; ``--quick`` picks a small preset)."""

    models: tuple[str, ...] = tuple(_bench_models.MODELS)
    """Model kinds (see ``_bench_models.MODELS``)."""
    sizes: tuple[str, ...] = ("small", "medium")
    """Sizes of the micro MLPs (see ``_bench_models.SIZES``)."""
    realistic_sizes: tuple[str, ...] = ("medium",)
    """Sizes of the realistic workloads (see ``_bench_models.BLOCK_SIZES``; empty: none of them runs)."""
    backends: tuple[str, ...] = ("aot_eager", "inductor")
    """Backends for the compiled modes."""
    strict_backends: tuple[str, ...] = ("aot_eager",)
    """Backends on which the strict=True row is measured."""
    device: str = "cpu"
    """"cpu" or "cuda"."""
    warmup: int = 4
    """Steps after the cold step that are not timed."""
    reps: int = 15
    """Timed samples per configuration (round-robin rounds)."""
    block: int = 5
    """Steps per timed sample."""
    recaptures: int = 10
    """Forced recaptures for the growth measurement."""
    soak_steps: int = 1000
    """Steps of the RSS/callable soak per CA mode (0: none; see ``bench_runtime``)."""
    cold_reps: int = 2
    """Fresh instances per configuration whose first step is timed (cold is their median)."""
    threads: int | None = None
    """torch.set_num_threads (None: leave as is)."""
    out_dir: str = "benchmarks"
    """Where RESULTS.md, results.json and bench.png go."""
    plot: bool = True
    """Write bench.png (needs matplotlib)."""
    progress: bool = True
    """Show a tqdm progress bar (when tqdm is installed)."""
    realistic_reps: int = 9
    """Timed samples per realistic-workload configuration (it joins the first ``realistic_reps`` rounds)."""
    realistic_block: int = 3
    """Steps per timed sample of a realistic workload."""
    realistic_cold_reps: int = 1
    """Fresh instances per realistic-workload configuration whose first step is timed."""
    command: str = ""
    """The command line, recorded in RESULTS.md."""

    def __post_init__(self) -> None:
        for name, allowed in (("models", _bench_models.MODELS), ("sizes", _bench_models.SIZES),
                              ("realistic_sizes", _bench_models.BLOCK_SIZES)):
            bad = [v for v in getattr(self, name) if v not in allowed]
            if bad or (not getattr(self, name) and name != "realistic_sizes"):
                raise ValueError(f"BenchSettings.{name}: got {bad or 'nothing'}, allowed values are {sorted(allowed)}")
        if not self.backends:
            raise ValueError("BenchSettings.backends must name at least one backend, e.g. aot_eager")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"BenchSettings.device: got {self.device!r}, allowed values are ['cpu', 'cuda']")
        for name in ("reps", "block", "cold_reps", "realistic_reps", "realistic_block", "realistic_cold_reps"):
            if getattr(self, name) < 1:
                raise ValueError(f"BenchSettings.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("warmup", "recaptures"):
            if getattr(self, name) < 0:
                raise ValueError(f"BenchSettings.{name} must be >= 0, got {getattr(self, name)}")

    @property
    def steps(self) -> int:
        return 1 + self.warmup + self.reps * self.block

    @property
    def realistic_steps(self) -> int:
        return 1 + self.warmup + self.realistic_reps * self.realistic_block

    def sizes_of(self, model: str) -> tuple[str, ...]:
        """The sizes ``model`` runs at (realistic workloads have their own)."""
        return self.realistic_sizes if model in _bench_models.REALISTIC else self.sizes


QUICK = {"models": (*(m for m in _bench_models.MODELS if m not in _bench_models.REALISTIC), "block_pair"),
         "sizes": ("small",), "realistic_sizes": ("small",), "backends": ("aot_eager",), "warmup": 1, "reps": 3, "block": 2,
         "recaptures": 3, "cold_reps": 1, "realistic_reps": 2, "realistic_block": 2, "soak_steps": 200}


# --- configurations ----------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class _Config:
    model: str
    size: str
    mode: str
    backend: str | None
    run_step: Callable[[], None]
    workload: _bench_models.Workload
    run_once: Callable[[int], None] | None = None
    """CA modes: ``n`` steps inside one entered context (the *entered once* style)."""
    samples_once: list[float] = dataclasses.field(default_factory=list)
    cold_ms: float = float("nan")
    cold_samples: list[float] = dataclasses.field(default_factory=list)
    samples: list[float] = dataclasses.field(default_factory=list)
    reps: int = 1
    block: int = 1
    cold_reps: int = 1
    captures_total: int = 0
    recompiles_after_warmup: int = 0
    cuda_peak_bytes: int | None = None
    peak_bytes: int | None = None

    @property
    def name(self) -> str:
        return f"{self.model}/{self.size}/{self.mode}" + (f"[{self.backend}]" if self.backend else "")


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def mode_context(mode: str, backend: str | None, *, wrap_stock_graph: Callable[[Any], Any] | None = None) -> Callable[[], Any]:
    """A factory of the context one step of ``mode`` runs in (one per step; see :data:`MODES`).

    ``wrap_stock_graph``: applied to each CA graph stock compiled autograd compiles (a timer, in ``bench_breakdown``).
    """
    if mode == "stock_ca":
        stock = _compat.stock_ca_compiler(backend)
        compiler_fn = stock if wrap_stock_graph is None else (lambda graph_module: wrap_stock_graph(stock(graph_module)))
        return lambda: _compat.enable_compiled_autograd(compiler_fn)
    if mode in ("subclass_ca", "subclass_ca_strict", "subclass_ca_cudagraphs", "subclass_ca_dynamic"):
        # Note [Static-first CA graphs]: a fixed-shape step gets a static CA graph, which CUDA graphs can replay
        extra: dict[str, Any] = {"mode": "reduce-overhead"} if mode == "subclass_ca_cudagraphs" else {}
        ours = _api.enable(backend, strict=mode == "subclass_ca_strict", dynamic=True if mode == "subclass_ca_dynamic" else None,
                           **extra)
        return lambda: ours
    return contextlib.nullcontext


class _Step(Protocol):
    """One step of a configuration (``step()``); ``step.in_one_context(n)``: ``n`` steps inside one entered context."""

    in_one_context: Callable[[int], None]

    def __call__(self) -> None: ...


def _make_step(workload: _bench_models.Workload, mode: str, backend: str | None, device: str) -> _Step:
    # backend None: eager only
    forward = workload.forward if mode == "eager" else torch.compile(workload.forward, backend=cast(str, backend))
    context = mode_context(mode, backend)
    params, inputs = workload.params, workload.inputs

    def run_step() -> None:
        for p in params:
            p.grad = None
        with context():
            loss = forward(params, *inputs)
            loss.backward()
        _sync(device)

    def run_once(steps: int) -> None:
        with context():
            for _ in range(steps):
                for p in params:
                    p.grad = None
                forward(params, *inputs).backward()
                _sync(device)

    step = cast(_Step, run_step)
    step.in_one_context = run_once
    return step


def _configs(settings: BenchSettings) -> list[_Config]:
    configs = []
    for model in settings.models:
        realistic = model in _bench_models.REALISTIC
        for size in settings.sizes_of(model):
            plan: list[tuple[str, str | None]] = [("eager", None)]
            for b in settings.backends:
                plan += [("compile", b), ("stock_ca", b), ("subclass_ca", b)]
                if b in settings.strict_backends and not realistic:
                    plan.append(("subclass_ca_strict", b))
                if b == "inductor" and settings.device.startswith("cuda"):
                    plan.append(("subclass_ca_cudagraphs", b))
                if b == "inductor" and realistic and settings.device == "cpu":  # the GPU check's budget: CPU only
                    plan.append(("subclass_ca_dynamic", b))
            for mode, backend in plan:
                tag = f"{size}_{mode}_{backend or 'none'}"
                workload = _bench_models.build(model, size, settings.device, tag=tag)
                configs.append(
                    _Config(
                        model=model, size=size, mode=mode, backend=backend, workload=workload,
                        run_step=(step := _make_step(workload, mode, backend, settings.device)),
                        run_once=step.in_one_context if mode in CA_MODES else None,
                        reps=settings.realistic_reps if realistic else settings.reps,
                        block=settings.realistic_block if realistic else settings.block,
                        cold_reps=settings.realistic_cold_reps if realistic else settings.cold_reps,
                    )
                )
    return configs


# --- measurements ------------------------------------------------------------------


def _micro(models: Sequence[str]) -> list[str]:
    """The micro-MLP models among ``models`` (the ones the targets, growth and liveness are about)."""
    return [m for m in models if m not in _bench_models.REALISTIC]


def _ca_captures() -> int:
    return int(_compat.ca_counters().get("captures", 0))


def _graph_compiles() -> int:
    return _compat.unique_graph_count()


@contextlib.contextmanager
def _bench_torch_settings(settings: BenchSettings) -> Iterator[None]:
    """Disable cross-mode graph caches and raise Dynamo's recompile limit; restore on exit."""
    threads = torch.get_num_threads()
    with contextlib.ExitStack() as stack:
        stack.enter_context(_compat.uncached_compiles())
        if settings.threads:
            torch.set_num_threads(settings.threads)
        try:
            yield
        finally:
            torch.set_num_threads(threads)


def _prime(settings: BenchSettings, bar: Any) -> list[dict[str, Any]]:
    """One throwaway step per compiled mode, so on-disk kernel caches are equally warm for every mode's cold step.

    Returns the wall seconds of each (model, size, backend)'s primer steps (what a model kind costs to prime)."""
    rows = []
    for model in settings.models:
        for size in settings.sizes_of(model):
            for backend in settings.backends:
                t0 = time.perf_counter()
                for mode in _primer_modes(model, backend):
                    workload = _bench_models.build(model, size, settings.device, tag=f"{size}_primer_{mode}_{backend}")
                    _make_step(workload, mode, backend, settings.device)()
                rows.append({"model": model, "size": size, "backend": backend, "seconds": time.perf_counter() - t0})
                bar.update()
    return rows


def _primer_modes(model: str, backend: str) -> tuple[str, ...]:
    """One step per distinct kernel set: Inductor compiles the AOT backward (compile) and the CA graph (stock and
    ours share its kernels; the all-dynamic CA graph of a realistic block has kernels of its own); aot_eager has no
    kernels, one CA step warms the process-wide tracing state."""
    if backend != "inductor":
        return ("subclass_ca",)
    return ("compile", "subclass_ca", "subclass_ca_dynamic") if model in _bench_models.REALISTIC else ("compile", "subclass_ca")


def _time_configs(configs: list[_Config], settings: BenchSettings, bar: Any) -> None:
    # cold: first step of fresh instances (interleaved), then of each configuration's own instance
    for rep in range(max(c.cold_reps for c in configs) - 1):
        for config in [c for c in configs if rep < c.cold_reps - 1]:
            extra = _bench_models.build(config.model, config.size, settings.device,
                                        tag=f"{config.size}_{config.mode}_{config.backend or 'none'}_cold{rep}")
            step = _make_step(extra, config.mode, config.backend, settings.device)
            t0 = time.perf_counter()
            step()
            config.cold_samples.append((time.perf_counter() - t0) * 1e3)
    for config in configs:
        c0 = _ca_captures()
        t0 = time.perf_counter()
        config.run_step()
        config.cold_samples.append((time.perf_counter() - t0) * 1e3)
        config.cold_ms = statistics.median(config.cold_samples)
        config.captures_total += _ca_captures() - c0
        bar.update()
    for _ in range(settings.warmup):
        for config in configs:
            c0 = _ca_captures()
            config.run_step()
            config.captures_total += _ca_captures() - c0
        bar.update(len(configs))
    for rep in range(max(c.reps for c in configs)):
        shift = rep % len(configs)
        for config in configs[shift:] + configs[:shift]:
            if rep >= config.reps:
                continue
            c0, g0 = _ca_captures(), _graph_compiles()
            t0 = time.perf_counter()
            for _ in range(config.block):
                config.run_step()
            config.samples.append((time.perf_counter() - t0) * 1e3 / config.block)
            if config.run_once is not None:  # the same compiled workload, context entered once per block
                t0 = time.perf_counter()
                config.run_once(config.block)
                config.samples_once.append((time.perf_counter() - t0) * 1e3 / config.block)
            captures = _ca_captures() - c0
            config.captures_total += captures
            config.recompiles_after_warmup += captures + (_graph_compiles() - g0)
        bar.update(sum(rep < c.reps for c in configs))
    if settings.device.startswith("cuda"):
        for config in configs:
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            config.run_step()
            config.cuda_peak_bytes = config.peak_bytes = torch.cuda.max_memory_allocated() - base
    else:
        for config in configs:
            c0, g0 = _ca_captures(), _graph_compiles()
            peak = cpu_step_peak_bytes(config.run_step)
            # a measurement that recompiled would measure compilation, not the step
            config.peak_bytes = peak if (_ca_captures(), _graph_compiles()) == (c0, g0) else None


@contextlib.contextmanager
def _quiet_stderr_fd() -> Iterator[None]:
    """Silence file descriptor 2 (kineto prints profiler_start / profiler_stop lines there)."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def cpu_step_peak_bytes(step: Callable[[], None]) -> int | None:
    """Peak bytes allocated during ``step()`` and live at the same time (CPU), or None when unmeasurable.

    ``torch.profiler`` with ``profile_memory=True`` records one ``[memory]`` event per allocation
    (positive bytes) and free (negative) made through c10's CPU allocator, which eager kernels,
    AOT/aot_eager graphs, Inductor's generated C++ (``empty_strided_cpu``) and the compiled-autograd
    graph all use. Frees of blocks allocated before the step (e.g. the previous ``.grad``) carry no size
    and are left out, so the figure is the high-water mark of the step's own allocations. The profiler
    does not change what Dynamo, AOT or compiled autograd compile (the caller checks that no capture or
    graph compile happened). It adds per-op overhead, so it runs on a separate, untimed step.
    """
    try:
        from torch.profiler import ProfilerActivity, profile

        with _quiet_stderr_fd(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            step()
        events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
        events.sort(key=lambda e: e.start_ns())
        live = peak = 0
        for event in events:
            live += event.nbytes()
            peak = max(peak, live)
        return peak
    except Exception as e:  # noqa: BLE001 - a torch without these profiler internals: say so, measure nothing
        print(f"bench: CPU peak memory unmeasured ({type(e).__name__}: {e})", file=sys.stderr)
        return None


def _growth(settings: BenchSettings, bar: Any) -> list[dict[str, Any]]:
    """Per-recapture growth of graph callables, allow_in_graph ids and RSS (aot_eager, first size)."""
    rows = []
    size = settings.sizes[0]
    backend = "aot_eager" if "aot_eager" in settings.backends else settings.backends[0]
    for model in _micro(settings.models):
        for mode in ("stock_ca", "subclass_ca"):
            workload = _bench_models.build(model, size, settings.device, tag=f"{size}_growth_{mode}")
            step = _make_step(workload, mode, backend, settings.device)
            for _ in range(2):  # first captures fill one-off caches
                _compat.reset_compiled_autograd()
                step()
            callables0, allowed0, rss0, captures0 = len(named_callables()), _compat.allowed_callable_count(), rss_bytes(), _ca_captures()
            for _ in range(settings.recaptures):
                _compat.reset_compiled_autograd()
                step()
                bar.update()
            n = max(settings.recaptures, 1)
            allowed1 = _compat.allowed_callable_count()
            rows.append(
                {
                    "model": model, "size": size, "mode": mode, "backend": backend,
                    "recaptures": _ca_captures() - captures0,
                    "named_callables_per_recapture": (len(named_callables()) - callables0) / n,
                    "allowed_ids_per_recapture": None if allowed0 is None or allowed1 is None else (allowed1 - allowed0) / n,
                    "rss_kib_per_recapture": (rss_bytes() - rss0) / 1024 / n,
                }
            )
    return rows


def _memory(settings: BenchSettings) -> list[dict[str, Any]]:
    """CA-graph liveness (stock vs ours) per model, first size, accumulating into existing grads."""
    rows = []
    size = settings.sizes[0]
    for model in _micro(settings.models):
        row: dict[str, Any] = {"model": model, "size": size}
        for mode, enter in (("stock_ca", _compat.enable_compiled_autograd), ("subclass_ca", _runtime.capture_with)):
            workload = _bench_models.build(model, size, settings.device, tag=f"{size}_memory_{mode}")
            forward = torch.compile(workload.forward, backend="aot_eager")

            def step(workload: Any = workload, forward: Any = forward) -> None:
                forward(workload.params, *workload.inputs).backward()

            with enter(_compat.stock_ca_compiler("aot_eager")):
                step()  # grads now exist: the measured backward accumulates into them
            row[mode] = dataclasses.asdict(_bench_memory.ca_graph_liveness(step, enter))
        rows.append(row)
    return rows


# --- statistics and report ---------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or a != a or b != b:
        return None
    return a / b


def _summaries(configs: list[_Config]) -> list[dict[str, Any]]:
    return [
        {
            "model": c.model, "size": c.size, "mode": c.mode, "backend": c.backend,
            "cold_ms": c.cold_ms, "cold_samples_ms": c.cold_samples, "captures": c.captures_total, "recompiles_after_warmup": c.recompiles_after_warmup,
            "cuda_peak_bytes": c.cuda_peak_bytes, "peak_bytes": c.peak_bytes, **_stats(c.samples),
            "samples_ms": c.samples, "once_samples_ms": c.samples_once,
            **({f"once_{k}": v for k, v in _stats(c.samples_once).items()} if c.samples_once else {}),
        }
        for c in configs
    ]


def _paired(ours: dict[str, Any], stock: dict[str, Any]) -> dict[str, Any]:
    """Per-round ratios of subclass_ca to stock CA with their intervals (Note [Verdicts on a shared machine])."""
    return {
        "steady_interval": paired_ratio(ours.get("samples_ms", []), stock.get("samples_ms", [])),
        "steady_once_interval": paired_ratio(ours.get("once_samples_ms") or [], stock.get("once_samples_ms") or []),
        "cold_interval": paired_ratio(ours.get("cold_samples_ms", []), stock.get("cold_samples_ms", [])),
    }


def _ratios(rows: list[dict[str, Any]], settings: BenchSettings) -> dict[str, list[dict[str, Any]]]:
    index = {(r["model"], r["size"], r["mode"], r["backend"]): r for r in rows}
    ours_vs_stock, vs_eager, vs_plain, strict, realistic = [], [], [], [], []
    for model in settings.models:
        for size in settings.sizes_of(model):
            eager = index.get((model, size, "eager", None))
            for backend in settings.backends:
                ours, stock = index.get((model, size, "subclass_ca", backend)), index.get((model, size, "stock_ca", backend))
                if ours and stock:
                    ours_vs_stock.append({
                        "model": model, "size": size, "backend": backend,
                        "steady": _ratio(ours["median"], stock["median"]), "steady_min": _ratio(ours["min"], stock["min"]),
                        "steady_once": _ratio(ours.get("once_median"), stock.get("once_median")),
                        "cold": _ratio(ours["cold_ms"], stock["cold_ms"]),
                        **_paired(ours, stock),
                    })
                for mode in ("stock_ca", "subclass_ca"):
                    row = index.get((model, size, mode, backend))
                    if row and eager:
                        vs_eager.append({"model": model, "size": size, "backend": backend, "mode": mode,
                                         "speedup": _ratio(eager["median"], row["median"]),
                                         "speedup_interval": paired_ratio(eager.get("samples_ms", []), row.get("samples_ms", []))})
                    plain = index.get(("plain", size, mode, backend))
                    if row and plain and model != "plain" and model not in _bench_models.REALISTIC:
                        vs_plain.append({"model": model, "size": size, "backend": backend, "mode": mode,
                                         "k": _bench_models.INNER_TENSORS[model], "ratio": _ratio(row["median"], plain["median"]),
                                         "ratio_interval": paired_ratio(row.get("samples_ms", []), plain.get("samples_ms", []))})
                if model in _bench_models.REALISTIC:
                    compiled = index.get((model, size, "compile", backend))
                    for mode in ("compile", "stock_ca", "subclass_ca", "subclass_ca_strict", "subclass_ca_cudagraphs",
                                 "subclass_ca_dynamic"):
                        row = index.get((model, size, mode, backend))
                        if row:
                            realistic.append({
                                "model": model, "size": size, "backend": backend, "mode": mode,
                                "speedup_vs_eager": _ratio(eager["median"], row["median"]) if eager else None,
                                "vs_stock_ca": _ratio(row["median"], stock["median"]) if stock else None,
                                "vs_compile": _ratio(row["median"], compiled["median"]) if compiled else None,
                                "vs_compile_interval": paired_ratio(row.get("samples_ms", []), compiled.get("samples_ms", []))
                                if compiled and mode != "compile" else None,
                            })
                strict_row = index.get((model, size, "subclass_ca_strict", backend))
                if strict_row and ours:
                    strict.append({"model": model, "size": size, "backend": backend,
                                   "steady": _ratio(strict_row["median"], ours["median"]),
                                   "cold": _ratio(strict_row["cold_ms"], ours["cold_ms"])})
    return {"subclass_ca_vs_stock": ours_vs_stock, "speedup_vs_eager": vs_eager, "subclass_vs_plain": vs_plain,
            "strict_vs_default": strict, "realistic": realistic}


def _verdicts(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """target id -> {met: bool | None, detail: str} (None: nothing measured)."""
    realistic = set(_bench_models.REALISTIC)
    ratios = {key: [r for r in rows if r["model"] not in realistic] for key, rows in results["ratios"].items()}
    verdicts: dict[str, dict[str, Any]] = {}

    def verdict(key: str, rows: list[Any], ok: Callable[[Any], bool], describe: Callable[[Any], str]) -> None:
        """A target judged on single numbers (counts, bytes)."""
        verdicts[key] = combine([(bool(ok(r)), describe(r)) for r in rows if r is not None])

    def interval_verdict(key: str, rows: list[Any], field: str, limit: float, *, at_least: bool = False,
                         unit: str = "") -> None:
        """A target judged on per-round ratios: met / missed / within noise (Note [Verdicts on a shared machine])."""
        judged = []
        for r in rows:
            interval = r.get(f"{field}_interval")
            if interval is None:
                continue
            text = f"{where(r)} {_interval(interval)}{unit}"
            judged.append((judge(interval, limit, at_least=at_least), text))
        verdicts[key] = combine(judged)

    def where(r: dict[str, Any]) -> str:
        return f"{r['model']}/{r['size']}[{r.get('backend')}]"

    every_row = results["ratios"]["subclass_ca_vs_stock"]  # steady targets: micro and realistic rows alike
    interval_verdict("steady", every_row, "steady", 1.00)
    interval_verdict("steady_once", every_row, "steady_once", 1.00)
    blocks = [r for r in results["ratios"].get("realistic", []) if r["mode"] == "subclass_ca"]
    interval_verdict("vs_compile", blocks, "vs_compile", 1.00)
    interval_verdict("cold", ratios["subclass_ca_vs_stock"], "cold", 1.05)
    eager = [r for r in ratios["speedup_vs_eager"] if r["mode"] == "subclass_ca" and r["model"] != "plain"]
    interval_verdict("vs_eager", eager, "speedup", 2.0, at_least=True, unit="x")
    ours = [r for r in results["rows"] if r["mode"] == "subclass_ca" and r["model"] not in realistic]
    verdict("recompiles", ours, lambda r: r["recompiles_after_warmup"] == 0,
            lambda r: f"{where(r)} {r['recompiles_after_warmup']}")
    growth = [r for r in results["growth"] if r["mode"] == "subclass_ca"]
    verdict("callables", growth,
            lambda r: r["named_callables_per_recapture"] == 0 and (r["allowed_ids_per_recapture"] or 0) == 0,
            lambda r: f"{where(r)} named {r['named_callables_per_recapture']:+.2f}, allow_in_graph "
                      f"{r['allowed_ids_per_recapture']:+.2f} per recapture")
    k_rows = [r for r in ratios["subclass_vs_plain"] if r["mode"] == "subclass_ca" and r.get("ratio_interval")]
    verdicts["k_ratio"] = combine([(judge(r["ratio_interval"], r["k"]), f"{where(r)} {_interval(r['ratio_interval'])} vs k={r['k']}")
                                   for r in k_rows])
    memory = [r for r in results["memory"] if r["subclass_ca"]["make_subclass_nodes"]]
    verdict("memory", memory,
            lambda r: r["subclass_ca"]["peak_bytes"] <= r["stock_ca"]["peak_bytes"]
            and r["subclass_ca"]["epilogue_mean_bytes"] <= r["stock_ca"]["epilogue_mean_bytes"],
            lambda r: f"{r['model']}/{r['size']}")
    return verdicts


def _fmt_bytes(value: int | None) -> str:
    if value is None:
        return "—"
    return f"{value / 2**20:.2f} MiB" if value >= 2**20 else f"{value / 1024:.0f} KiB"


def _peak_note(results: dict[str, Any]) -> str:
    method = results.get("peak_memory_method")
    if not method:
        return "not measured by the run that wrote these results"
    return method + "; — = not measured"


def _realistic_section(results: dict[str, Any], peak_note: str) -> list[str]:
    """The "Realistic workloads" section: one transformer block per model (see bench_models.REALISTIC)."""
    s = results["settings"]
    realistic = [m for m in _bench_models.REALISTIC if m in s["models"]]
    sizes = s.get("realistic_sizes", s["sizes"])
    skipped = results.get("skipped_models") or {}
    if not realistic and not skipped:
        return []
    out = ["", "## Realistic workloads", "",
           "One transformer block each: RMSNorm → causal multi-head self-attention (`scaled_dot_product_attention`) → residual →",
           "RMSNorm → SwiGLU MLP → residual; loss = output.square().mean(). Sizes (batch, seq, dim, heads, ffn): "
           + ", ".join(f"{k} {v}" for k, v in _bench_models.BLOCK_SIZES.items() if k in sizes) + ".", ""]
    out += [f"- `{m}`: {_bench_models.MODELS[m]}" for m in realistic]
    out += [f"- `{m}`: **skipped**: {reason}" for m, reason in skipped.items()]
    steps = ""
    if "realistic_reps" in s:
        steps = (f": {s['realistic_reps']} samples x {s['realistic_block']} steps after {s['warmup']} warm-up steps, "
                 f"cold = median of {s['realistic_cold_reps']} fresh instance(s), no strict row; primer steps: inductor "
                 "compile + subclass_ca (stock CA's graph has the same kernels), aot_eager subclass_ca")
    out += ["", f"Same interleaved rounds as the micro rows{steps}.",
            "The targets above are judged on the micro rows, except the steady-state ones (every row) and *vs compile* "
            "(these blocks). *cold* is the "
            "first step of a fresh instance: Dynamo + AOT + backend compile + CA capture, i.e. the compile time. "
            f"*peak*: {peak_note}.",
            "*vs eager* = eager ms / mode ms (higher is faster); *vs stock_ca* and *vs compile* = mode ms / that mode's ms "
            "(lower is faster; *vs compile*: median per-round ratio [95 % bootstrap interval]).",
            "", "| model | size | backend | mode | median ms (IQR) | cold ms | peak | vs eager | vs stock_ca | vs compile | recompiles after warm-up |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    ratios = {(r["model"], r["size"], r["backend"], r["mode"]): r for r in results["ratios"].get("realistic", [])}
    for r in results["rows"]:
        if r["model"] not in realistic:
            continue
        q = ratios.get((r["model"], r["size"], r["backend"], r["mode"]), {})
        out.append(
            f"| {r['model']} | {r['size']} | {r['backend'] or '—'} | {r['mode']} | {_fmt(r['median'], '.2f')} "
            f"({_fmt(r['q1'], '.2f')}–{_fmt(r['q3'], '.2f')}) | {_fmt(r['cold_ms'], '.0f')} | {_fmt_bytes(r.get('peak_bytes'))} | "
            f"{_fmt(q.get('speedup_vs_eager'))}{'x' if q.get('speedup_vs_eager') else ''} | {_fmt(q.get('vs_stock_ca'), '.3f')} | "
            f"{_interval(q.get('vs_compile_interval')) if q.get('vs_compile_interval') else _fmt(q.get('vs_compile'), '.3f')} | "
            f"{r['recompiles_after_warmup']} |"
        )
    return out


def _interval(interval: dict[str, Any] | None, spec: str = ".3f") -> str:
    """``ratio [low–high]``: the median per-round ratio and its bootstrap interval; — when unmeasured."""
    if not interval:
        return "—"
    return f"{interval['ratio']:{spec}} [{interval['low']:{spec}}–{interval['high']:{spec}}]"


def _fmt(value: Any, spec: str = ".2f") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return "—"
    return format(value, spec)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def render_markdown(results: dict[str, Any]) -> str:
    """RESULTS.md: environment, the table, the ratios and each target marked met / missed."""
    env, s = results["env"], results["settings"]
    out = ["# subclass_ca benchmark results", ""]
    out += [
        f"- command: `{s['command']}`",
        f"- torch {env['torch']}, Python {env['python']}, {env['platform']}",
        f"- CPU: {env['cpu']} ({env['cpu_count']} logical cores visible), torch threads: {env['threads']}",
        f"- device: {s['device']}; CUDA column: {env['cuda_note']}",
        f"- steps per micro-MLP configuration: {results['steps']} (1 cold + {s['warmup']} warm-up + {s['reps']} samples x "
        f"{s['block']} steps); cold = median first step of {s.get('cold_reps', 1)} fresh instance(s); "
        f"forced recaptures: {s['recaptures']}; wall time {results['wall_s']:.0f} s",
        f"- machine: {env['noise_note']}",
        "",
        "A step is `zero_grad(set_to_none) + forward + loss.backward()` (no optimizer). Modes run interleaved",
        "round-robin (order rotated each round); steady figures exclude the cold step and warm-up.",
        "Inductor's FX-graph and AOT-autograd caches are off, so no mode reuses another's compiled graph; a primer step",
        "per compiled mode (throwaway instances) runs first, so compiled C++ kernels come from the on-disk kernel cache",
        "equally for every mode: *cold* is Dynamo + AOT + backend lowering + CA capture, not C++ compilation.",
        "",
        "## Targets",
        "",
        *targets_table(TARGETS, results["verdicts"]),
    ]
    realistic = set(_bench_models.REALISTIC)
    micro_rows = [r for r in results["rows"] if r["model"] not in realistic]
    peak_note = _peak_note(results)
    out += ["", "## Steady state and cold start (ms per step)", "",
            f"Micro MLPs. *peak* is the peak memory of one step ({peak_note}).", "",
            "| model | size | mode | backend | median | IQR | min–max | cold (first step) | peak | CA captures | recompiles after warm-up |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in micro_rows:
        out.append(
            f"| {r['model']} | {r['size']} | {r['mode']} | {r['backend'] or '—'} | {_fmt(r['median'], '.3f')} | "
            f"{_fmt(r['q1'], '.3f')}–{_fmt(r['q3'], '.3f')} | {_fmt(r['min'], '.3f')}–{_fmt(r['max'], '.3f')} | "
            f"{_fmt(r['cold_ms'], '.0f')} | {_fmt_bytes(r.get('peak_bytes'))} | {r['captures']} | {r['recompiles_after_warmup']} |"
        )
    out += _realistic_section(results, peak_note)
    ratios = {key: [r for r in rows if r["model"] not in realistic] for key, rows in results["ratios"].items()}
    out += ["", "## Ratios", "", "### subclass_ca / stock CA", "",
            "Every row, micro and realistic. *per step*: the context entered around every step (the tables above); "
            "*once*: the same compiled workloads, the context entered once around each timed block of steps (timed "
            "in the same rounds). Each cell is the median of the per-round ratios with its 95 % bootstrap interval; "
            "a target is missed only when the whole interval is beyond it, *within noise* when the interval "
            "straddles it (Note [Verdicts on a shared machine] in `tools/common/stats.py`). The ratio of the minima "
            "(least disturbed samples) is shown beside them.", "",
            "| model | size | backend | per step | per step (min) | once | cold |", "|---|---|---|---:|---:|---:|---:|"]
    out += [f"| {r['model']} | {r['size']} | {r['backend']} | {_interval(r.get('steady_interval'))} | {_fmt(r.get('steady_min'), '.3f')} | "
            f"{_interval(r.get('steady_once_interval'))} | {_interval(r.get('cold_interval'))} |"
            for r in results["ratios"]["subclass_ca_vs_stock"]]
    out += ["", "### Speed-up over eager (eager ms / mode ms)", "", "| model | size | backend | mode | speed-up |", "|---|---|---|---|---:|"]
    out += [f"| {r['model']} | {r['size']} | {r['backend']} | {r['mode']} | {_interval(r.get('speedup_interval'), '.2f')} |"
            for r in ratios["speedup_vs_eager"]]
    out += ["", "### Subclass model / plain model, same mode", "", "| model | size | backend | mode | k | ratio |", "|---|---|---|---|---:|---:|"]
    out += [f"| {r['model']} | {r['size']} | {r['backend']} | {r['mode']} | {r['k']} | {_interval(r.get('ratio_interval'), '.2f')} |"
            for r in ratios["subclass_vs_plain"]]
    out += ["", "### enable(strict=True) / enable(strict=False)", "", "| model | size | backend | steady | cold |", "|---|---|---|---:|---:|"]
    out += [f"| {r['model']} | {r['size']} | {r['backend']} | {_fmt(r['steady'], '.3f')} | {_fmt(r['cold'], '.3f')} |"
            for r in ratios["strict_vs_default"]]
    out += ["", "## Growth per forced recapture", "",
            "The compiled-autograd cache is cleared before each step; each row is the growth divided by the recaptures.",
            "", "| model | mode | recaptures | named callables | allow_in_graph ids | RSS KiB |", "|---|---|---:|---:|---:|---:|"]
    out += [f"| {r['model']} | {r['mode']} | {r['recaptures']} | {_fmt(r['named_callables_per_recapture'], '+.2f')} | "
            f"{_fmt(r['allowed_ids_per_recapture'], '+.2f')} | {_fmt(r['rss_kib_per_recapture'], '+.1f')} |" for r in results["growth"]]
    out += ["", "## Backward memory (CA-graph liveness proxy, aot_eager)", "",
            "Live bytes of tensors produced inside the CA graph (graph inputs excluded), from one eager node-by-node run",
            "of the captured graph accumulating into existing `.grad`s (see Note [Why the epilogue holds memory] in",
            "`tools/bench/memory.py`). Stock feeds every flat backward output to every `make_subclass` node.", "",
            "| model | size | make_subclass nodes | args (stock / ours) | peak KiB (stock / ours) | epilogue mean KiB (stock / ours) |",
            "|---|---|---:|---:|---:|---:|"]
    for r in results["memory"]:
        st, us = r["stock_ca"], r["subclass_ca"]
        out.append(f"| {r['model']} | {r['size']} | {us['make_subclass_nodes']} | {st['make_subclass_args']} / {us['make_subclass_args']} | "
                   f"{st['peak_bytes'] / 1024:.1f} / {us['peak_bytes'] / 1024:.1f} | "
                   f"{st['epilogue_mean_bytes'] / 1024:.1f} / {us['epilogue_mean_bytes'] / 1024:.1f} |")
    if results.get("runtime"):
        out += ["", _bench_runtime.markdown_section(results["runtime"]).rstrip("\n")]
    cuda_rows = [r for r in results["rows"] if r["cuda_peak_bytes"] is not None]
    out += ["", "### CUDA peak memory of one step (torch.cuda.max_memory_allocated)", ""]
    if cuda_rows:
        out += ["| model | size | mode | backend | peak MiB |", "|---|---|---|---|---:|"]
        out += [f"| {r['model']} | {r['size']} | {r['mode']} | {r['backend'] or '—'} | {r['cuda_peak_bytes'] / 2**20:.2f} |" for r in cuda_rows]
    else:
        out.append("Unmeasured: no CUDA device on the machine that produced these results (run with `--device cuda`).")
    if results.get("chart"):
        out += ["", f"![ms per step]({results['chart']})"]
    if results.get("notes"):
        out += ["", results["notes"].rstrip()]
    out.append("")
    return "\n".join(out)


def _plot(results: dict[str, Any], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed (pip install 'subclass_ca[demo]'); skipping the chart", file=sys.stderr)
        return False
    rows = results["rows"]
    groups = sorted({(r["model"], r["size"]) for r in rows}, key=lambda g: (list(_bench_models.MODELS).index(g[0]), list(_bench_models.SIZES).index(g[1])))
    series = []
    for r in rows:
        key = (r["mode"], r["backend"])
        if key not in series:
            series.append(key)
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 4.8))
    width = 0.8 / max(len(series), 1)
    for i, (mode, backend) in enumerate(series):
        xs, med, lo, hi = [], [], [], []
        for g, (model, size) in enumerate(groups):
            r = next((r for r in rows if (r["model"], r["size"], r["mode"], r["backend"]) == (model, size, mode, backend)), None)
            if r is None:
                continue
            xs.append(g + (i - (len(series) - 1) / 2) * width)
            med.append(r["median"])
            lo.append(r["median"] - r["q1"])
            hi.append(r["q3"] - r["median"])
        ax.bar(xs, med, width, yerr=[lo, hi], label=mode + (f" [{backend}]" if backend else ""), capsize=2)
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{m}\n{s}" for m, s in groups])
    ax.set_yscale("log")
    ax.set_ylabel("ms per training step (median, IQR)")
    ax.set_title(f"subclass_ca bench — torch {results['env']['torch']}, {results['settings']['device']}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# --- entry point -----------------------------------------------------------------


def run(settings: BenchSettings) -> dict[str, Any]:
    """Measure everything; return the results dict (also what results.json holds)."""
    if settings.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench: --device cuda given but torch.cuda.is_available() is False")
    _compat.require_support()
    start = time.perf_counter()
    skipped = {m: reason for m in settings.models if (reason := _bench_models.unavailable(m))}
    for model, reason in skipped.items():
        print(f"bench: skipping model {model}: {reason}", file=sys.stderr)
    if len(skipped) == len(settings.models):
        raise SystemExit("bench: no requested model can be built here: " + "; ".join(f"{m}: {r}" for m, r in skipped.items()))
    settings = dataclasses.replace(settings, models=tuple(m for m in settings.models if m not in skipped))
    with _bench_torch_settings(settings):
        configs = _configs(settings)
        growth_units = len(_micro(settings.models)) * 2 * settings.recaptures
        prime_units = sum(len(settings.sizes_of(m)) for m in settings.models) * len(settings.backends)
        total = prime_units + len(configs) * (1 + settings.warmup) + sum(c.reps for c in configs) + growth_units
        bar = Progress(total, enabled=settings.progress, leave=False, line=None)
        phases: dict[str, float] = {}

        @contextlib.contextmanager
        def phase(name: str) -> Iterator[None]:
            t0 = time.perf_counter()
            yield
            phases[name] = time.perf_counter() - t0

        try:
            with phase("prime"):
                primer = _prime(settings, bar)
            with phase("time_configs"):
                _time_configs(configs, settings, bar)
            rows = _summaries(configs)
            with phase("growth"):
                growth = _growth(settings, bar)
            with phase("liveness"):
                memory = _memory(settings)
            with phase("runtime"):
                runtime = _bench_runtime.run(_bench_runtime.RuntimeBench(
                    backend=settings.backends[0], size=settings.sizes[0], device=settings.device,
                    soak_steps=settings.soak_steps, soak_model="pair" if "pair" in settings.models else settings.models[0]))
        finally:
            bar.close()
    results: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "steps": settings.steps,
        "realistic_steps": settings.realistic_steps,
        "env": {
            "torch": torch.__version__, "python": platform.python_version(), "platform": platform.platform(),
            "cpu": _cpu_name(), "cpu_count": os.cpu_count(), "threads": torch.get_num_threads() if not settings.threads else settings.threads,
            "cuda_note": (f"measured on {torch.cuda.get_device_name()}" if settings.device == "cuda"
                          else "unmeasured (no GPU on this machine; the bench accepts --device cuda)"),
            "noise_note": os.environ.get("SUBCLASS_CA_BENCH_NOTE", "not recorded"),
        },
        "rows": rows,
        "skipped_models": skipped,
        "peak_memory_method": (
            "torch.cuda.max_memory_allocated() minus memory_allocated() before the step" if settings.device == "cuda"
            else "torch.profiler(profile_memory=True): peak running sum of the step's CPU allocator events"
        ),
        "growth": growth,
        "memory": memory,
        "runtime": runtime,
        "phase_s": phases,
        "primer_s": primer,
    }
    results["ratios"] = _ratios(rows, settings)
    results["verdicts"] = _verdicts(results)
    results["wall_s"] = time.perf_counter() - start
    return results


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools bench``."""
    p = argparse.ArgumentParser(prog="python -m tools bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small preset (< 2 min): small size, aot_eager, few steps")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--models", nargs="+", choices=list(_bench_models.MODELS))
    p.add_argument("--sizes", nargs="+", choices=list(_bench_models.SIZES),
                   help="sizes of the micro MLPs, and of the transformer blocks unless --realistic-sizes is given")
    p.add_argument("--realistic-sizes", nargs="*", choices=list(_bench_models.BLOCK_SIZES),
                   help="sizes of the transformer blocks (default: medium; none: skip them)")
    p.add_argument("--realistic-reps", type=int, help="timed samples per transformer-block configuration (default 9)")
    p.add_argument("--realistic-block", type=int, help="steps per transformer-block sample (default 3)")
    p.add_argument("--realistic-cold-reps", type=int, help="fresh transformer-block instances whose first step is timed (default 1)")
    p.add_argument("--backends", nargs="+", help="backends of the compiled modes (default: aot_eager inductor)")
    p.add_argument("--strict-backends", nargs="*", help="backends with a strict=True row (default: aot_eager)")
    p.add_argument("--warmup", type=int)
    p.add_argument("--reps", type=int)
    p.add_argument("--block", type=int)
    p.add_argument("--recaptures", type=int)
    p.add_argument("--cold-reps", type=int, help="fresh instances whose first step is timed (default 2)")
    p.add_argument("--soak-steps", type=int, help="steps of the RSS / callable soak per CA mode (default 1000; 0: none)")
    p.add_argument("--threads", type=int, help="torch.set_num_threads for the run")
    p.add_argument("--out-dir", default="benchmarks")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--note", help="free text about the machine (shared, noisy, ...) recorded in RESULTS.md")
    p.add_argument("--render", metavar="RESULTS_JSON", help="do not measure: re-render RESULTS.md and the chart from a results.json")
    p.add_argument("--append", metavar="MARKDOWN", help="append this markdown file (e.g. an analysis) to RESULTS.md")
    p.add_argument("--fsdp2", action="store_true", help="also time FSDP2 (fully_shard) training, eager FSDP2 vs compile vs subclass_ca "
                   "on a micro MLP (3 runs) and transformer blocks (TwoTensor, NF4-LoRA), backends of --backends, gradients "
                   "checked against eager FSDP2 "
                   "(multi-process; combine with --render to add it to existing results)")
    p.add_argument("--depth", action="store_true", help="also sweep the depth of a stack of regionally compiled blocks "
                   "(L = 2, 8, 32, 64; TwoTensor-LoRA and NF4-LoRA; inductor; fresh processes): cold first step, CA "
                   "capture and steady step of compile-only, stock CA and subclass_ca (combine with --render)")
    p.add_argument("--ddp", action="store_true", help="also time DistributedDataParallel training: eager DDP vs compile-only "
                   "(C++ and Python reducer) vs subclass_ca, TwoTensor MLP and NF4-LoRA rows, backends of --backends "
                   "(multi-process; combine with --render to add it to existing results)")
    p.add_argument("--tp", action="store_true", help="also time a tensor-parallel transformer block (DTensor weights) in "
                   "eager / compile / stock CA / subclass_ca on --nproc processes, gradients checked against eager "
                   "(multi-process, backends of --backends; combine with --render to add it to existing results)")
    p.add_argument("--warm-start", action="store_true", help="also time the first step of fresh processes, cold and warm "
                   "(compile-only, stock CA, subclass_ca on the TwoTensor MLP and the NF4-LoRA block; inductor; "
                   "combine with --render to add it to existing results)")
    p.add_argument("--breakdown", action="store_true", help="also cut a step of each realistic block into forward, "
                   "enter+exit, torch's engine, our wrapper and the CA graph: compile-only, stock CA, subclass_ca (inductor; "
                   "combine with --render to add it to existing results)")
    p.add_argument("--warm-reps", type=int, default=3, help="warm processes per (model, mode) for --warm-start (default 3)")
    p.add_argument("--nproc", type=int, default=2, help="processes for --fsdp2, --ddp and --tp (default 2)")
    return p


def settings_from_args(argv: Sequence[str]) -> BenchSettings:
    args = build_parser().parse_args(list(argv))
    values: dict[str, Any] = dict(QUICK) if args.quick else {}
    for name in ("models", "sizes", "realistic_sizes", "backends", "strict_backends"):
        if getattr(args, name) is not None:
            values[name] = tuple(getattr(args, name))
    if args.sizes is not None and args.realistic_sizes is None:
        values["realistic_sizes"] = tuple(args.sizes)
    for name in ("warmup", "reps", "block", "recaptures", "threads", "cold_reps", "realistic_reps", "realistic_block",
                 "realistic_cold_reps", "soak_steps"):
        if getattr(args, name) is not None:
            values[name] = getattr(args, name)
    command = "python -m tools bench " + shlex.join(argv)
    return BenchSettings(
        device=args.device, out_dir=args.out_dir, plot=not args.no_plot, progress=not args.no_progress,
        command=command.strip(), **values,
    )


SECTIONS: dict[str, str] = {
    "breakdown": "tools.bench.breakdown",
    "fsdp2": "tools.bench.fsdp2",
    "ddp": "tools.bench.ddp",
    "depth": "tools.bench.depth",
    "tp": "tools.bench.tp",
    "warm_start": "tools.bench.warm_start",
}
"""results.json key -> the tool module (a :class:`tools.common.report.Section`) that measured and renders it, in report order."""


def section(key: str) -> report.Section:
    """The module of an optional section (imported on demand: FSDP2 and TP pull in torch.distributed)."""
    import importlib

    return importlib.import_module(SECTIONS[key])


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark and write RESULTS.md, results.json and bench.png; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    settings = settings_from_args(argv)
    args = build_parser().parse_args(argv)
    if args.note:
        os.environ["SUBCLASS_CA_BENCH_NOTE"] = args.note
    if args.render:
        with open(args.render) as f:
            results = json.load(f)
    else:
        results = run(settings)
    # the sections' own entry points: each module imported on demand, as section(key) does
    if args.breakdown:  # tools/bench/breakdown.py: where a step's time goes, compile-only vs CA
        from tools.bench import breakdown

        results["breakdown"] = breakdown.bench(size=settings.realistic_sizes[0] if settings.realistic_sizes else "medium",
                                               device=settings.device)
        results["breakdown"]["command"] = settings.command
    if args.fsdp2:  # tools/bench_fsdp2.py: micro MLP and transformer blocks vs eager FSDP2, checked
        from tools.bench import fsdp2 as bench_fsdp2

        fsdp2_settings = bench_fsdp2.FSDP2Bench(backends=settings.backends, device=settings.device)
        results["fsdp2"] = bench_fsdp2.bench(world_size=args.nproc, settings=fsdp2_settings)
    if args.depth:  # tools/bench/depth.py: cold start against depth, regional compiled autograd (fresh processes)
        from tools.bench import depth as bench_depth

        results["depth"] = bench_depth.bench(bench_depth.DepthBench())
        if settings.plot and bench_depth.plot(results["depth"], os.path.join(settings.out_dir, "depth.png")):
            results["depth"]["chart"] = "depth.png"
    if args.ddp:  # tools/bench/ddp.py: DDP, eager vs compile-only vs subclass_ca, and the Python reducer's cost
        from tools.bench import ddp as bench_ddp

        results["ddp"] = bench_ddp.bench(world_size=args.nproc, settings=bench_ddp.DDPBench(backends=settings.backends,
                                                                                          device=settings.device))
    if args.tp:  # tools/bench/tp.py: TP transformer block, every mode's gradients vs eager
        from tools.bench import tp as bench_tp

        results["tp"] = bench_tp.bench(world_size=args.nproc, backends=settings.backends)
    if args.warm_start:  # tools/bench/warm_start.py: fresh processes, cold and warm caches
        from tools.bench import warm_start

        results["warm_start"] = warm_start.bench(warm_start.WarmStartBench(warm_reps=args.warm_reps))
        results["warm_start"]["command"] = settings.command
    for key in SECTIONS:
        if getattr(args, key):
            print(section(key).format_summary(results[key]))
    if args.append:
        with open(args.append) as f:
            results["notes"] = f.read()
    os.makedirs(settings.out_dir, exist_ok=True)
    chart = os.path.join(settings.out_dir, "bench.png")
    if settings.plot and _plot(results, chart):
        results["chart"] = "bench.png"
    # an older results.json holds the FSDP2 parity-run summary under "fsdp2" (no "rows"): not rendered
    present = [key for key in SECTIONS if results.get(key) and (key != "fsdp2" or results[key].get("rows"))]
    with open(os.path.join(settings.out_dir, "RESULTS.md"), "w") as f:
        f.write(render_markdown(results))
        for key in present:
            f.write(section(key).markdown_section(results[key], command=results[key].get("command") or settings.command))
    with open(os.path.join(settings.out_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    lines = report.verdict_lines(TARGETS, results["verdicts"])
    if results.get("runtime"):
        lines += report.verdict_lines(_bench_runtime.TARGETS, results["runtime"]["verdicts"])
    for key in present:
        lines += report.verdict_lines(section(key).TARGETS, results[key].get("verdicts", {}))
    print("\n".join(lines))
    print(f"wrote {os.path.join(settings.out_dir, 'RESULTS.md')} ({results['wall_s']:.0f} s)")
    return 0

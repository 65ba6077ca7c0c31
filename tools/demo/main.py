"""``python -m tools demo``: train small subclass models in four modes side by side.

Modes (each trains from the same initial weights on the same batches):

* ``eager``        — plain PyTorch, the reference;
* ``compile``      — ``torch.compile`` forward, eager backward (no compiled autograd);
* ``stock_ca``     — compiled forward, backward through torch's own compiled autograd and
  its stock epilogue (``_compat.enable_compiled_autograd``);
* ``subclass_ca``  — compiled forward, backward under ``subclass_ca.enable()``.

Models: ``int8_lora`` (a frozen :class:`Int8RowwiseTensor` base weight with trainable
LoRA-like adapters) and ``pair`` (an MLP whose parameters and inputs are
:class:`PairTensor`).  The demo prints a table (final loss, max difference of losses and
parameters vs eager, median step time after warm-up, speedup vs eager), the capture
reports of the subclass_ca runs, and writes ``results.json`` and ``demo.png`` to ``--out``.
A mode that fails is reported with its error; the exit code is 1 only when a
``subclass_ca`` run fails or leaves the tolerance.

``--dtensor --nproc 2`` instead trains a ``Shard(0)`` + ``Replicate()`` DTensor model on
2 processes (gloo on CPU, NCCL on CUDA) under ``subclass_ca.enable()`` and checks the
final parameters against a single-process dense run (exit code 1 beyond tolerance).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypedDict, cast

import torch

import subclass_ca
from subclass_ca import _compat, diagnostics
from subclass_ca.testing.subclasses import Int8RowwiseTensor, PairTensor
from tools.common.progress import Progress

__all__ = ["main", "build_parser", "DemoConfig", "run_demo", "run_dtensor_demo", "MODES", "MODELS"]

MODES: tuple[str, ...] = ("eager", "compile", "stock_ca", "subclass_ca")
CA_MODES: tuple[str, ...] = ("stock_ca", "subclass_ca")


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Settings of one demo run (validated)."""

    steps: int = 40
    """Optimizer steps per (model, mode)."""
    warmup: int = 5
    """Steps excluded from the median step time (compilation happens here)."""
    backend: str = "inductor"
    """``torch.compile`` backend of the forward and of the CA graph (``aot_eager``: no codegen, bitwise vs eager)."""
    device: str = "cpu"
    """Device of parameters and data."""
    seed: int = 0
    """Seed of initial weights and batches (identical in every mode)."""
    lr: float | None = None
    """SGD learning rate (None: each model's own, chosen so that 40 steps visibly learn)."""
    models: tuple[str, ...] = ("int8_lora", "pair")
    """Which models to train."""
    modes: tuple[str, ...] = MODES
    """Which modes to run (``eager`` always runs: it is the reference)."""
    progress: bool = True
    """Show a tqdm progress bar when tqdm is installed."""
    threads: int | None = 1
    """``torch.set_num_threads`` while training and timing (restored after); None: leave torch's setting.
    One thread by default: on a shared or small machine, more threads make step times jump
    with whatever else runs, and these models are too small to gain from them."""

    def __post_init__(self) -> None:
        if self.steps < 2:
            raise ValueError(f"DemoConfig.steps must be >= 2, got {self.steps}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"DemoConfig.warmup must be in [0, steps), got {self.warmup} with steps={self.steps}")
        unknown = [m for m in self.models if m not in MODELS]
        if unknown:
            raise ValueError(f"DemoConfig.models: unknown {unknown}; allowed values are {sorted(MODELS)}")
        unknown = [m for m in self.modes if m not in MODES]
        if unknown:
            raise ValueError(f"DemoConfig.modes: unknown {unknown}; allowed values are {list(MODES)}")
        if self.threads is not None and (not isinstance(self.threads, int) or self.threads < 1):
            raise ValueError(f"DemoConfig.threads must be a positive int or None (torch's default; --threads 0), "
                             f"got {self.threads!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"DemoConfig.device={self.device!r} but CUDA is not available; use --device cpu")

    @property
    def tolerance(self) -> float:
        """Max abs difference vs eager that counts as a match (aot_eager is expected to be exact)."""
        return 1e-5 if self.backend == "aot_eager" else 1e-3


# --- models ----------------------------------------------------------------------


@dataclass(kw_only=True)
class Model:
    """A tiny model: trainable parameters, a loss function and its batches."""

    name: str
    description: str
    params: list[torch.nn.Parameter]
    loss_fn: Callable[..., torch.Tensor]
    batches: list[tuple[Any, ...]]
    lr: float
    frozen: list[Any] = field(default_factory=list)


def _generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _int8_lora(config: DemoConfig) -> Model:
    gen, dev = _generator(config.seed), config.device
    d_in, d_out, rank, batch = 64, 64, 8, 32
    base = Int8RowwiseTensor.quantize((torch.randn(d_out, d_in, generator=gen) / math.sqrt(d_in)).to(dev))
    lora_a = torch.nn.Parameter((torch.randn(rank, d_in, generator=gen) * 0.05).to(dev))
    lora_b = torch.nn.Parameter(torch.zeros(d_out, rank, device=dev))
    # The target is the base plus a low-rank update: exactly what the adapters can learn.
    delta = torch.randn(d_out, rank, generator=gen) @ torch.randn(rank, d_in, generator=gen) / d_in
    teacher = base.to_dense() + delta.to(dev)
    batches = []
    for _ in range(config.steps):
        x = torch.randn(batch, d_in, generator=gen).to(dev)
        batches.append((x, x @ teacher.t()))

    def loss_fn(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        out = x @ base.t() + (x @ a.t()) @ b.t()
        return ((out - y) ** 2).mean()

    return Model(
        name="int8_lora",
        description="frozen Int8RowwiseTensor base weight + trainable LoRA adapters (rank 8)",
        params=[lora_a, lora_b],
        loss_fn=loss_fn,
        batches=batches,
        lr=4.0,
        frozen=[base],
    )


def _pair(config: DemoConfig) -> Model:
    gen, dev = _generator(config.seed + 1), config.device
    d_in, hidden, d_out, batch = 32, 64, 8, 32

    def pair(dense: torch.Tensor) -> PairTensor:
        dense = dense.to(dev)
        return PairTensor(dense.clone(), dense * 0.5)

    w1 = torch.nn.Parameter(pair(torch.randn(hidden, d_in, generator=gen) / math.sqrt(d_in)))
    w2 = torch.nn.Parameter(pair(torch.randn(d_out, hidden, generator=gen) / math.sqrt(hidden)))
    teacher1 = torch.randn(hidden, d_in, generator=gen) / math.sqrt(d_in)
    teacher2 = torch.randn(d_out, hidden, generator=gen) / math.sqrt(hidden)
    batches = []
    for _ in range(config.steps):
        x = torch.randn(batch, d_in, generator=gen)
        batches.append((pair(x), pair(torch.tanh(x @ teacher1.t()) @ teacher2.t())))

    def loss_fn(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((torch.tanh(x @ w1.t()) @ w2.t() - y) ** 2).mean()

    return Model(
        name="pair",
        description="2-layer MLP whose parameters and data are PairTensor (TwoTensor-like)",
        params=[w1, w2],
        loss_fn=loss_fn,
        batches=batches,
        lr=0.3,
    )


MODELS: dict[str, Callable[[DemoConfig], Model]] = {"int8_lora": _int8_lora, "pair": _pair}


# --- one training run ------------------------------------------------------------


def _flat(value: torch.Tensor) -> torch.Tensor:
    """All numbers of a (maybe subclass) tensor, as one plain float64 vector."""
    if isinstance(value, PairTensor):
        return torch.cat([_flat(value.a), _flat(value.b)])
    if isinstance(value, Int8RowwiseTensor):
        return value.to_dense().detach().reshape(-1).double().cpu()
    return value.detach().reshape(-1).double().cpu()


def _loss_value(loss: torch.Tensor) -> float:
    """The number plotted for a loss (the first half of a PairTensor loss)."""
    if isinstance(loss, PairTensor):
        return _loss_value(loss.a)
    return float(loss.detach().cpu())


def _stock_context(compiler_fn: Callable[..., Any]) -> Any:
    """torch's own compiled autograd with its stock epilogue."""
    return _compat.enable_compiled_autograd(compiler_fn)


def _backward_context(mode: str, backend: str) -> Callable[[], Any]:
    """The backward context's factory for one run; the run enters it once around its loop."""
    if mode == "stock_ca":
        compiler_fn = _compat.stock_ca_compiler(backend)
        return lambda: _stock_context(compiler_fn)
    if mode == "subclass_ca":
        block = subclass_ca.enable(backend=backend)  # reusable: one validated Config per run
        return lambda: block
    return contextlib.nullcontext


@dataclass(kw_only=True)
class RunResult:
    """One (model, mode) run."""

    mode: str
    status: str = "ok"
    error: str | None = None
    losses: list[list[float]] = field(default_factory=list)
    """Per step: every number of the loss (one for plain, two for a PairTensor loss)."""
    step_times_s: list[float] = field(default_factory=list)
    final_params: list[torch.Tensor] = field(default_factory=list)
    reports: list[dict[str, Any]] = field(default_factory=list)
    cache: dict[str, int] = field(default_factory=dict)

    @property
    def curve(self) -> list[float]:
        return [values[0] for values in self.losses]


def _train(config: DemoConfig, model_name: str, mode: str, tick: Callable[[], None]) -> RunResult:
    result = RunResult(mode=mode)
    subclass_ca.reset()
    model = MODELS[model_name](config)
    step_loss = model.loss_fn if mode == "eager" else torch.compile(model.loss_fn, backend=config.backend)
    first_capture = diagnostics.capture_count()
    try:
        # the CA modes enter their context once around the training loop (the recommended use)
        with _backward_context(mode, config.backend)():
            for batch in model.batches:
                start = time.perf_counter()
                loss = step_loss(*model.params, *batch)
                loss.backward()
                with torch.no_grad():
                    for param in model.params:
                        if param.grad is None:
                            raise RuntimeError(f"{model_name}/{mode}: a parameter got no gradient")
                        param.sub_((config.lr or model.lr) * param.grad)
                        param.grad = None
                if config.device.startswith("cuda"):
                    torch.cuda.synchronize()
                result.step_times_s.append(time.perf_counter() - start)
                result.losses.append(_flat(loss).tolist())
                tick()
    except Exception as error:  # noqa: BLE001 - a failing mode is reported, not fatal
        result.status = "failed"
        message = str(error).strip().splitlines()
        result.error = f"{type(error).__name__}: {message[0] if message else ''}"[:300]
        diagnostics.logger.info("%s/%s failed:\n%s", model_name, mode, traceback.format_exc())
    finally:
        subclass_ca.reset()
    result.final_params = [_flat(p) for p in model.params]
    if mode == "subclass_ca":
        kept = [r for r in subclass_ca.reports() if r.capture_index >= first_capture]
        result.reports = [_report_dict(r) for r in kept]
        result.cache = diagnostics.cache_stats(since=first_capture)
    return result


def _report_dict(report: diagnostics.CaptureReport) -> dict[str, Any]:
    return {
        "capture_index": report.capture_index,
        "aot_backwards": report.aot_backwards,
        "make_subclass_nodes": [
            {"type": name, "mode": mode, "count": count} for (name, mode), count in sorted(report.subclass_nodes.items())
        ],
        "graph_nodes": report.graph_nodes,
        "fullgraph": report.fullgraph,
        "runs": report.runs,
        "cache_hits": report.cache_hits,
        "miss_reasons": list(report.miss_reasons),
        "fallbacks": list(report.fallbacks),
        "summary": report.summary(),
    }


# --- comparison, table, files ------------------------------------------------------


def _max_diff(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return math.inf
    return max((float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(a, b)), default=0.0)


# Note [Noisy step times]
# ~~~~~~~~~~~~~~~~~~~~~~~
# The table compares median step times, which says nothing when the steps of one run spread
# widely (another process took the cores, a frequency change, a GC pause).  The spread of a
# run is the interquartile range of its timed steps (after warm-up) over their median; a run
# whose spread exceeds NOISE_THRESHOLD (0.25: the middle half of its steps spans more than a
# quarter of the median), or that has fewer than MIN_TIMED_STEPS timed steps, makes the demo
# print a warning under the table: those medians are not a sound basis for a speedup.  The
# IQR rather than the standard deviation: one slow step (a late recompile) does not trip it.

NOISE_THRESHOLD = 0.25
"""A run's step times are too noisy to compare when IQR / median exceeds this."""
MIN_TIMED_STEPS = 4
"""Fewer timed steps than this: too few to estimate a spread (the warning says so)."""


def step_time_spread(step_times_s: Sequence[float]) -> float | None:
    """IQR / median of ``step_times_s`` (the timed steps), or None with fewer than MIN_TIMED_STEPS."""
    if len(step_times_s) < MIN_TIMED_STEPS:
        return None
    q1, median, q3 = statistics.quantiles(step_times_s, n=4, method="inclusive")
    return (q3 - q1) / median if median > 0 else math.inf


def noise_warnings(results: dict[str, Any], threshold: float = NOISE_THRESHOLD) -> list[str]:
    """One line per (model, mode) whose step times are too noisy to compare (Note [Noisy step times])."""
    lines = []
    for model_name, model in results["models"].items():
        for mode, entry in model["modes"].items():
            if entry.get("status") != "ok":
                continue
            spread = entry.get("step_time_spread")
            if spread is None:
                lines.append(f"{model_name}/{mode}: only {entry.get('timed_steps', 0)} timed step(s), "
                             f"too few to tell noise from speed (use more --steps)")
            elif spread > threshold:
                lines.append(f"{model_name}/{mode}: step times spread {spread:.0%} of the median "
                             f"(IQR/median > {threshold:.0%})")
    return lines


def _summarize(config: DemoConfig, runs: dict[str, RunResult]) -> dict[str, Any]:
    eager = runs["eager"]
    eager_median = statistics.median(eager.step_times_s[config.warmup :]) if eager.status == "ok" else None
    modes: dict[str, Any] = {}
    for mode, run in runs.items():
        entry: dict[str, Any] = {"status": run.status, "error": run.error}
        if run.status == "ok":
            median = statistics.median(run.step_times_s[config.warmup :])
            comparable = eager.status == "ok"
            loss_diff = (
                _max_diff([torch.tensor(v) for v in run.losses], [torch.tensor(v) for v in eager.losses])
                if comparable else None
            )
            param_diff = _max_diff(run.final_params, eager.final_params) if comparable else None
            entry.update(
                final_loss=run.curve[-1],
                losses=run.curve,
                step_times_s=run.step_times_s,
                median_step_s=median,
                timed_steps=len(run.step_times_s[config.warmup :]),
                step_time_spread=step_time_spread(run.step_times_s[config.warmup :]),
                speedup_vs_eager=(eager_median / median) if eager_median and median > 0 else None,
                max_loss_diff_vs_eager=loss_diff,
                max_param_diff_vs_eager=param_diff,
                within_tolerance=(
                    comparable and loss_diff <= config.tolerance and param_diff <= config.tolerance  # type: ignore[operator]
                ),
            )
        else:
            entry.update(within_tolerance=False)
        if mode == "subclass_ca":
            entry.update(captures=run.reports, cache=run.cache)
        modes[mode] = entry
    return modes


def _fmt(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    return format(value, spec)


def format_table(results: dict[str, Any]) -> str:
    """The demo's table: one row per (model, mode)."""
    header = ["model", "mode", "final loss", "max|dloss|", "max|dparam|", "median step", "speedup", "status"]
    rows = [header]
    for model_name, model in results["models"].items():
        for mode, entry in model["modes"].items():
            if entry["status"] == "ok":
                status = "ok" if entry["within_tolerance"] or mode in ("eager", "compile") else "MISMATCH"
                if mode == "compile" and not entry["within_tolerance"]:
                    status = "differs"
                rows.append([
                    model_name,
                    mode,
                    _fmt(entry["final_loss"], ".6f"),
                    _fmt(entry["max_loss_diff_vs_eager"], ".2e"),
                    _fmt(entry["max_param_diff_vs_eager"], ".2e"),
                    _fmt(entry["median_step_s"] * 1e3, ".2f") + " ms",
                    _fmt(entry["speedup_vs_eager"], ".2f") + "x",
                    status,
                ])
            else:
                rows.append([model_name, mode, "-", "-", "-", "-", "-", f"FAILED: {entry['error']}"])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = []
    for index, row in enumerate(rows):
        cells = [cell.ljust(widths[i]) if i < 2 else cell.rjust(widths[i]) for i, cell in enumerate(row[:-1])]
        lines.append("  ".join(cells + [row[-1]]))
        if index == 0:
            lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 6)
    return "\n".join(lines)


def _plot(results: dict[str, Any], path: Path) -> str | None:
    """Loss curves and step-time bars; returns an explanation when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: pip install 'subclass_ca[demo]' for the plot"
    models = list(results["models"].items())
    fig, axes = plt.subplots(2, len(models), figsize=(5.5 * len(models), 7), squeeze=False)
    for column, (name, model) in enumerate(models):
        loss_ax, time_ax = axes[0][column], axes[1][column]
        labels, medians = [], []
        for style, (mode, entry) in zip(("-", "--", "-.", ":"), model["modes"].items()):
            if entry["status"] != "ok":
                continue
            loss_ax.plot(range(1, len(entry["losses"]) + 1), entry["losses"], style, label=mode, linewidth=1.6)
            labels.append(mode)
            medians.append(entry["median_step_s"] * 1e3)
        loss_ax.set_title(f"{name}: training loss")
        loss_ax.set_xlabel("step")
        loss_ax.set_ylabel("loss")
        loss_ax.legend()
        time_ax.bar(labels, medians, color=["#777777", "#4c72b0", "#dd8452", "#55a868"][: len(labels)])
        time_ax.set_title(f"{name}: median step time after warm-up")
        time_ax.set_ylabel("ms")
    fig.suptitle(f"subclass_ca demo ({results['config']['backend']}, {results['config']['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return None


def run_demo(config: DemoConfig, out: Path) -> dict[str, Any]:
    """Train every (model, mode), write ``results.json`` and ``demo.png`` under ``out``; return the results."""
    out.mkdir(parents=True, exist_ok=True)
    modes = ("eager",) + tuple(m for m in config.modes if m != "eager")
    progress = Progress(len(config.models) * len(modes) * config.steps, bar=config.progress, unit="step",
                        line="  training {name} ...")
    if config.progress and not progress.has_bar:
        print("(tqdm is not installed: pip install 'subclass_ca[demo]' for a progress bar)", file=sys.stderr)
    results: dict[str, Any] = {
        "config": {**asdict(config), "tolerance": config.tolerance, "torch": torch.__version__,
                   "subclass_ca": subclass_ca.__version__, "torch_threads": config.threads or torch.get_num_threads(),
                   "noise_threshold": NOISE_THRESHOLD},
        "models": {},
    }
    threads_before = torch.get_num_threads()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    try:
        for model_name in config.models:
            runs = {}
            for mode in modes:
                progress.start(f"{model_name}/{mode}")
                with warnings.catch_warnings():
                    # torch asks every subclass for a cache hash; the zoo's small subclasses have none.
                    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")
                    runs[mode] = _train(config, model_name, mode, progress.update)
            description = MODELS[model_name](DemoConfig(steps=2, warmup=0, device=config.device)).description
            results["models"][model_name] = {"description": description, "modes": _summarize(config, runs)}
    finally:
        progress.close()
        torch.set_num_threads(threads_before)
    results["noise_warnings"] = noise_warnings(results)
    ca_entries = [m["modes"]["subclass_ca"] for m in results["models"].values() if "subclass_ca" in m["modes"]]
    results["ok"] = all(entry["within_tolerance"] for entry in ca_entries)
    plot_path = out / "demo.png"
    missing = _plot(results, plot_path)
    results["plot"] = None if missing else plot_path.name
    results["plot_note"] = missing
    (out / "results.json").write_text(json.dumps(results, indent=2, allow_nan=True) + "\n")
    return results


def format_reports(results: dict[str, Any]) -> str:
    """The subclass_ca capture reports of a demo run, per model."""
    lines = []
    for model_name, model in results["models"].items():
        entry = model["modes"].get("subclass_ca")
        if entry is None:
            continue
        cache = entry.get("cache") or {}
        lines.append(
            f"[{model_name}] subclass_ca: {cache.get('captures', 0)} capture(s), {cache.get('runs', 0)} backward run(s), "
            f"{cache.get('cache_hits', 0)} cache hit(s), {cache.get('make_subclass_nodes', 0)} make_subclass node(s)"
        )
        for capture in entry.get("captures") or ():
            lines += ["  " + line for line in capture["summary"].splitlines()]
    return "\n".join(lines)


# --- DTensor on N processes ---------------------------------------------------------

class _DTShapes(TypedDict):
    w1: tuple[int, int]
    w2: tuple[int, int]
    batch: int


_DT_SHAPES: _DTShapes = {"w1": (16, 8), "w2": (4, 16), "batch": 32}


def _dtensor_init(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _generator(seed)
    w1 = torch.randn(*_DT_SHAPES["w1"], generator=gen) * 0.3
    w2 = torch.randn(*_DT_SHAPES["w2"], generator=gen) * 0.3
    return w1, w2


def _dtensor_batches(seed: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = _generator(seed + 1)
    batch, d_in, d_out = _DT_SHAPES["batch"], _DT_SHAPES["w1"][1], _DT_SHAPES["w2"][0]
    return [(torch.randn(batch, d_in, generator=gen), torch.randn(batch, d_out, generator=gen)) for _ in range(steps)]


def _dtensor_loss(w1: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((torch.tanh(x @ w1.t()) @ w2.t() - y) ** 2).mean()


def _sgd(params: Sequence[torch.Tensor], lr: float) -> None:
    with torch.no_grad():
        for param in params:
            assert param.grad is not None  # every parameter took part in the backward
            param.sub_(lr * param.grad)
            param.grad = None


def dtensor_worker(rank: int, world_size: int, settings: dict[str, Any]) -> dict[str, Any]:
    """One rank: ``w1`` is ``Shard(0)``, ``w2`` ``Replicate()``; backward under ``subclass_ca.enable()``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    device = settings["device"]
    mesh = init_device_mesh(device, (world_size,))
    w1_full, w2_full = (t.to(device) for t in _dtensor_init(settings["seed"]))
    # a Parameter of a DTensor is a DTensor (torch keeps the subclass)
    w1 = cast(DTensor, torch.nn.Parameter(distribute_tensor(w1_full, mesh, [Shard(0)])))
    w2 = cast(DTensor, torch.nn.Parameter(distribute_tensor(w2_full, mesh, [Replicate()])))
    step_loss = torch.compile(_dtensor_loss, backend=settings["backend"])
    losses = []
    first_capture = diagnostics.capture_count()
    for x, y in _dtensor_batches(settings["seed"], settings["steps"]):
        x = DTensor.from_local(x.to(device), mesh, [Replicate()], run_check=False)
        y = DTensor.from_local(y.to(device), mesh, [Replicate()], run_check=False)
        loss = step_loss(w1, w2, x, y)
        with subclass_ca.enable(backend=settings["backend"]):
            loss.backward()
        if not isinstance(w1.grad, DTensor) or w1.grad.placements != w1.placements:
            raise RuntimeError(f"rank {rank}: w1.grad is {type(w1.grad).__name__}, expected a Shard(0) DTensor")
        _sgd((w1, w2), settings["lr"])
        losses.append(float(cast(DTensor, loss.detach()).full_tensor()))  # DTensor.detach() is typed as Tensor's
    kept = [r for r in subclass_ca.reports() if r.capture_index >= first_capture]
    return {
        "rank": rank,
        "w1": cast(DTensor, w1.detach()).full_tensor().cpu(),
        "w2": cast(DTensor, w2.detach()).full_tensor().cpu(),
        "local_w1_shape": list(w1.to_local().shape),
        "placements": [str(w1.placements), str(w2.placements)],
        "losses": losses,
        "reports": [_report_dict(r) for r in kept],
        "cache": diagnostics.cache_stats(since=first_capture),
    }


def dtensor_dense_reference(settings: dict[str, Any]) -> dict[str, Any]:
    """The same training on one process with plain tensors, eager."""
    w1, w2 = (t.clone().requires_grad_() for t in _dtensor_init(settings["seed"]))
    losses = []
    for x, y in _dtensor_batches(settings["seed"], settings["steps"]):
        loss = _dtensor_loss(w1, w2, x, y)
        loss.backward()
        _sgd((w1, w2), settings["lr"])
        losses.append(float(loss.detach()))
    return {"w1": w1.detach(), "w2": w2.detach(), "losses": losses}


def run_dtensor_demo(
    *, nproc: int, steps: int, backend: str, device: str, seed: int = 0, lr: float = 0.1,
    timeout_s: float = 120.0, tolerance: float = 1e-5,
) -> dict[str, Any]:
    """Train the DTensor model on ``nproc`` processes and compare it with the dense run."""
    from subclass_ca.distributed import run_workers

    settings = {"steps": steps, "backend": backend, "device": device, "seed": seed, "lr": lr}
    start = time.perf_counter()
    ranks = run_workers(dtensor_worker, nproc, timeout_s=timeout_s, args=(settings,), device=device)
    elapsed = time.perf_counter() - start
    dense = dtensor_dense_reference(settings)
    per_rank = []
    for result in ranks:
        param_diff = max(float((result[k] - dense[k]).abs().max()) for k in ("w1", "w2"))
        loss_diff = max(abs(a - b) for a, b in zip(result["losses"], dense["losses"]))
        per_rank.append({"rank": result["rank"], "max_param_diff": param_diff, "max_loss_diff": loss_diff,
                         "local_w1_shape": result["local_w1_shape"], "placements": result["placements"]})
    max_diff = max(max(r["max_param_diff"], r["max_loss_diff"]) for r in per_rank)
    return {
        "nproc": nproc, "steps": steps, "backend": backend, "device": device, "tolerance": tolerance,
        "elapsed_s": elapsed, "per_rank": per_rank, "max_diff": max_diff, "ok": max_diff <= tolerance,
        "final_loss": dense["losses"][-1], "reports": ranks[0]["reports"], "cache": ranks[0]["cache"],
    }


# --- CLI ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools demo``."""
    parser = argparse.ArgumentParser(
        prog="python -m tools demo",
        description="Train small subclass models in four modes (eager, compile, stock compiled autograd, "
        "subclass_ca) and compare them; or, with --dtensor, train a DTensor model on several processes.",
    )
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per run (default 40; 8 with --quick)")
    parser.add_argument("--backend", default=None, help="torch.compile backend (default inductor; aot_eager with --dtensor). "
                        "aot_eager compiles in well under a second and matches eager bitwise")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--quick", action="store_true", help="a short run (8 steps) for smoke tests")
    parser.add_argument("--out", default="demo-out", help="output folder for results.json and demo.png (default ./demo-out)")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, from {list(MODELS)}")
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {list(MODES)}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch.set_num_threads while timing (default 1: steadier step times; 0: torch's default)")
    parser.add_argument("--dtensor", action="store_true", help="multi-process DTensor training vs a dense run")
    parser.add_argument("--fsdp2", action="store_true",
                        help="multi-process FSDP2 (fully_shard) training: eager / compile / subclass_ca / stock CA vs a dense run")
    parser.add_argument("--nproc", type=int, default=2, help="processes for --dtensor (default 2)")
    parser.add_argument("--timeout", type=float, default=180.0, help="bound in seconds for --dtensor (default 180)")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="max difference for --dtensor (default 1e-5)")
    return parser


def _split(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def _main_dtensor(args: argparse.Namespace) -> int:
    from subclass_ca.distributed import WorkerError

    steps = args.steps or (4 if args.quick else 10)
    backend = "nccl" if args.device.startswith("cuda") else "gloo"
    print(f"DTensor training on {args.nproc} processes ({backend}, 127.0.0.1), {steps} steps, "
          f"w1 Shard(0) + w2 Replicate(), backward under subclass_ca.enable(backend={args.backend!r})")
    try:
        result = run_dtensor_demo(
            nproc=args.nproc, steps=steps, backend=args.backend, device="cuda" if args.device.startswith("cuda") else "cpu",
            seed=args.seed, timeout_s=args.timeout, tolerance=args.tolerance,
        )
    except WorkerError as error:
        print(f"DTensor run FAILED: {error}", file=sys.stderr)
        return 1
    for rank in result["per_rank"]:
        print(f"  rank {rank['rank']}: local w1 {rank['local_w1_shape']}, placements {rank['placements']}, "
              f"max |param - dense| = {rank['max_param_diff']:.3e}, max |loss - dense| = {rank['max_loss_diff']:.3e}")
    verdict = "OK" if result["ok"] else "FAILED"
    print(f"max difference vs single-process dense run: {result['max_diff']:.3e} (tolerance {args.tolerance:g}) "
          f"-> {verdict}  [{result['elapsed_s']:.1f} s]")
    cache = result["cache"]
    print(f"rank 0 subclass_ca: {cache['captures']} capture(s), {cache['runs']} backward run(s), "
          f"{cache['cache_hits']} cache hit(s)")
    for capture in result["reports"]:
        print("\n".join("  " + line for line in capture["summary"].splitlines()))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "dtensor_results.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0 if result["ok"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.fsdp2:  # tools/fsdp2/parity.py; docs/distributed.md
        from tools.fsdp2 import parity as fsdp2

        return fsdp2.demo_main(args)
    if args.dtensor:
        args.backend = args.backend or "aot_eager"
        return _main_dtensor(args)
    args.backend = args.backend or "inductor"
    steps = args.steps or (8 if args.quick else 40)
    try:
        config = DemoConfig(
            steps=steps, warmup=min(2 if args.quick else 5, steps - 1), backend=args.backend, device=args.device,
            seed=args.seed, models=_split(args.models), modes=_split(args.modes), progress=not args.no_progress,
            threads=None if args.threads == 0 else args.threads,
        )
        subclass_ca.enable(backend=args.backend)  # validates the backend name before any training
    except ValueError as error:
        print(f"subclass_ca demo: {error}", file=sys.stderr)
        return 2
    out = Path(args.out)
    threads = config.threads or torch.get_num_threads()
    print(f"subclass_ca demo: {config.steps} steps per run, backend={config.backend}, device={config.device}, "
          f"torch {torch.__version__}, {threads} thread(s)")
    results = run_demo(config, out)
    print()
    print(format_table(results))
    print()
    print(f"tolerance vs eager: {config.tolerance:g} (losses at every step and final parameters)")
    print(f"median step time excludes the first {config.warmup} step(s) (compilation)")
    if results["noise_warnings"]:
        print()
        print("warning: step times too noisy to compare (the speedups above may not be real):")
        print("\n".join("  " + line for line in results["noise_warnings"]))
        print("  rerun on an idle machine or with more --steps" + ("" if config.threads == 1 else ", or with --threads 1"))
    print()
    print(format_reports(results))
    print()
    written = [str(out / "results.json")] + ([str(out / results["plot"])] if results["plot"] else [])
    print("wrote " + ", ".join(written) + ("" if results["plot"] else f"  ({results['plot_note']})"))
    if not results["ok"]:
        print("subclass_ca runs FAILED or differ from eager beyond the tolerance (see the table)", file=sys.stderr)
        return 1
    return 0

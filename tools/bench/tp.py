"""Tensor-parallel transformer block on 2 processes: eager / compile / stock CA / subclass_ca, timed and checked.

``python -m tools bench --tp --nproc 2`` (or :func:`bench`) launches ``world_size``
ranks (gloo, 127.0.0.1, through :mod:`subclass_ca.distributed`) that each build the same seeded block::

    x -> RMSNorm -> causal multi-head attention (SDPA) -> + x -> RMSNorm -> SwiGLU MLP -> + residual

tensor-parallelized with ``parallelize_module`` on a 1-D mesh: ``wq``/``wk``/``wv`` and the
MLP's ``w1``/``w3`` are ``ColwiseParallel`` (each rank owns ``heads / world_size`` heads and
``hidden / world_size`` MLP columns), ``wo`` and ``w2`` are ``RowwiseParallel`` (all-reduce);
the weights are sharded ``DTensor`` parameters, the norms' weights stay replicated plain
parameters.  Every rank sees the same batch and target; one step is ``zero_grad`` + forward +
``mse_loss`` + backward (no optimizer: parameters stay put, so every step's gradients are
comparable across modes).

Modes (each its own model instance, built from the same seed):

* ``eager``: no compilation (the reference gradients);
* ``compile``: ``torch.compile(step_loss)`` -- the block and its loss in one compiled
  function, AOT backward, no compiled autograd;
* ``stock_ca``: the same compiled forward, backward under torch's compiled autograd with
  the compiler torch documents (``torch.compile(gm, backend=b, fullgraph=True)``);
* ``subclass_ca``: the same compiled forward, backward under ``subclass_ca.enable(backend=b)``
  (fullgraph; the loss is inside the compiled region, so no eager DTensor conversion lands
  in the CA graph).

Per (mode, backend): the cold first step (compile + capture), the steady step (median and
IQR over ``reps`` interleaved rounds of ``block`` steps after ``warmup`` steps; the round
order rotates; every rank runs the same schedule, a barrier starts each sample, rank 0's
clock is reported), CA captures, and the gradients of the first and last step against
eager's, shard by shard on every rank (types, placements, ``assert_close`` with
``atol = rtol = 1e-5`` for aot_eager and ``1e-4`` for inductor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from subclass_ca import _compat
from tools.common.models import Block
from tools.common.report import as_json as to_json
from tools.common.report import command_of

from .models import private_copy

if TYPE_CHECKING:
    from torch.distributed.tensor.parallel import ParallelStyle

__all__ = ["TPBench", "MODES", "TOLERANCE", "TARGETS", "build_block", "parallelize", "bench", "markdown_section",
           "format_summary", "to_json"]

MODES: tuple[str, ...] = ("eager", "compile", "stock_ca", "subclass_ca")
#: backend -> atol = rtol of the gradient check against eager (other backends: the inductor value)
TOLERANCE: dict[str, float] = {"aot_eager": 1e-5, "inductor": 1e-4}
TARGETS: dict[str, str] = {}
"""None: the TP rows are measured and checked, not judged against a target."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class TPBench:
    """Sizes and schedule of one TP bench run (every rank uses the same)."""

    batch: int = 2
    seq: int = 32
    dim: int = 64
    heads: int = 4
    hidden: int = 128
    """SwiGLU hidden width (``w1``/``w3``: dim -> hidden, ``w2``: hidden -> dim)."""
    seed: int = 0
    warmup: int = 2
    """Untimed steps after the cold step."""
    reps: int = 10
    """Timed samples (interleaved rounds) per configuration."""
    block: int = 4
    """Steps per timed sample."""

    def __post_init__(self) -> None:
        for name in ("batch", "seq", "dim", "heads", "hidden", "reps", "block"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"TPBench.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.warmup < 0:
            raise ValueError(f"TPBench.warmup must be >= 0, got {self.warmup!r}")
        if self.dim % self.heads:
            raise ValueError(f"TPBench.dim ({self.dim}) must be a multiple of heads ({self.heads})")

    def check_world_size(self, world_size: int) -> None:
        if self.heads % world_size or self.hidden % world_size:
            raise ValueError(f"TPBench: heads ({self.heads}) and hidden ({self.hidden}) must be multiples of world_size ({world_size})")


# --- the model (tools.common.models.Block) -------------------------------------------


def build_block(settings: TPBench) -> Block:
    """The dense block, identically initialised on every rank (seeded)."""
    torch.manual_seed(settings.seed)
    return Block(settings.dim, settings.heads, settings.hidden)


def parallelize(block: Block, mesh: Any) -> Block:
    """Colwise q/k/v and w1/w3, rowwise wo and w2 (Megatron-style TP)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, ParallelStyle] = {name: ColwiseParallel() for name in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")}
    plan.update({"attn.wo": RowwiseParallel(), "mlp.w2": RowwiseParallel()})
    return cast(Block, parallelize_module(block, mesh, plan))  # the module it was given, parallelized in place


def batch_of(settings: TPBench) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixed (input, target), the same on every rank and step."""
    generator = torch.Generator().manual_seed(1_000 + settings.seed)
    x = torch.randn(settings.batch, settings.seq, settings.dim, generator=generator)
    return x, torch.randn(settings.batch, settings.seq, settings.dim, generator=generator)


# --- one rank ------------------------------------------------------------------------


@dataclasses.dataclass(kw_only=True)
class _Config:
    mode: str
    backend: str | None
    step: Callable[[], None]
    model: Block
    cold_ms: float = float("nan")
    samples: list[float] = dataclasses.field(default_factory=list)
    captures: int = 0
    grads_first: dict[str, Any] = dataclasses.field(default_factory=dict)
    grads_last: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str | None = None

    @property
    def key(self) -> str:
        return self.mode if self.backend is None else f"{self.mode}[{self.backend}]"


def _context(mode: str, backend: str | None) -> Callable[[], Any]:
    """What a step of ``mode`` enters around ``loss.backward()``."""
    if mode == "subclass_ca":
        from subclass_ca.api import enable

        ours = enable(backend=backend)
        return lambda: ours
    if mode == "stock_ca":
        compiler = _compat.stock_ca_compiler(backend)
        return lambda: _compat.enable_compiled_autograd(compiler)
    return contextlib.nullcontext


def _make_step(model: Block, mode: str, backend: str | None, x: torch.Tensor, y: torch.Tensor, *, tag: str) -> Callable[[], None]:
    def step_loss(inp: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(model(inp), target)

    # a private code object per configuration: Dynamo's cache is per code object, so no mode
    # is served a forward graph another mode compiled (each cold step compiles its own)
    step_loss = private_copy(step_loss, tag)
    # backend None: eager only
    forward = step_loss if mode == "eager" else torch.compile(step_loss, backend=cast(str, backend), fullgraph=True)
    context = _context(mode, backend)
    params = list(model.parameters())

    def run_step() -> None:
        for p in params:
            p.grad = None
        loss = forward(x, y)
        with context():
            loss.backward()

    return run_step


def _grads(model: Block) -> dict[str, Any]:
    """This rank's gradient shards: type, placements, local values."""
    from torch.distributed.tensor import DTensor

    out: dict[str, dict[str, Any]] = {}
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            out[name] = {"type": None}
        elif isinstance(g, DTensor):
            out[name] = {"type": "DTensor", "placements": tuple(str(pl) for pl in g.placements), "local": g.to_local().detach().clone()}
        else:
            out[name] = {"type": type(g).__name__, "placements": None, "local": g.detach().clone()}
    return out


def _grad_check(got: dict[str, Any], want: dict[str, Any], tol: float) -> dict[str, Any]:
    """Every parameter's gradient shard against eager's: same type and placements, values within ``tol``."""
    problems, max_diff = [], 0.0
    for name, ref in want.items():
        entry = got.get(name, {"type": None})
        if entry["type"] != ref["type"] or entry.get("placements") != ref.get("placements"):
            problems.append(f"{name}: {entry['type']} {entry.get('placements')} != eager {ref['type']} {ref.get('placements')}")
            continue
        if ref["type"] is None:
            continue
        max_diff = max(max_diff, float((entry["local"] - ref["local"]).abs().max()))
        try:
            torch.testing.assert_close(entry["local"], ref["local"], atol=tol, rtol=tol)
        except AssertionError as error:
            problems.append(f"{name}: {' '.join(str(error).split())[:160]}")
    return {"ok": not problems, "max_abs_diff": max_diff, "problems": problems[:4]}


def _barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def _run_timed(config: _Config, steps: int) -> float:
    """``steps`` steps of ``config`` after a barrier; ms per step on this rank's clock."""
    _barrier()
    c0 = int(_compat.ca_counters().get("captures", 0))
    t0 = time.perf_counter()
    for _ in range(steps):
        config.step()
    ms = (time.perf_counter() - t0) * 1e3 / steps
    config.captures += int(_compat.ca_counters().get("captures", 0)) - c0
    return ms


def _prime(backends: Sequence[str]) -> None:
    """One throwaway step of every compiled mode and backend on a tiny plain function.

    One-off process-wide costs (imports, Dynamo/AOT/compiled-autograd/Inductor set-up, the
    first ``enable()``) then land on no configuration's cold step; the block's own graphs are
    still compiled cold (each configuration has a private code object).
    """
    w = torch.randn(8, 8, requires_grad=True)

    def tiny(a: torch.Tensor) -> torch.Tensor:
        return (a.sin() @ a).square().mean()

    for backend in backends:
        for mode in MODES[1:]:
            fn = torch.compile(private_copy(tiny, f"{mode}_{backend}"), backend=backend, fullgraph=True)
            loss = fn(w)
            with _context(mode, backend)():
                loss.backward()
            w.grad = None


def _rank_main(rank: int, world_size: int, settings: TPBench, backends: tuple[str, ...]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from subclass_ca.api import reset

    settings.check_world_size(world_size)
    start = time.perf_counter()
    mesh = init_device_mesh("cpu", (world_size,))
    x, y = batch_of(settings)
    plan = [("eager", None)] + [(mode, b) for b in backends for mode in MODES[1:]]
    configs = []
    for mode, backend in plan:
        model = parallelize(build_block(settings), mesh)
        configs.append(_Config(mode=mode, backend=backend, model=model, step=_make_step(model, mode, backend, x, y, tag=f"{mode}_{backend}")))
    reset()
    with _compat.uncached_compiles():
        _prime(backends)
        for config in configs:
            try:
                config.cold_ms = _run_timed(config, 1)
            except Exception as error:  # noqa: BLE001 - a mode's failure is a result (both ranks fail alike)
                config.error = f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"[:300]
                continue
            config.grads_first = _grads(config.model)
        live = [c for c in configs if c.error is None]
        for _ in range(settings.warmup):
            for config in live:
                _run_timed(config, 1)
        for rep in range(settings.reps):
            shift = rep % len(live)
            for config in live[shift:] + live[:shift]:
                config.samples.append(_run_timed(config, settings.block))
        for config in live:
            config.grads_last = _grads(config.model)
    eager = configs[0]
    rows = []
    for config in configs:
        row: dict[str, Any] = {"mode": config.mode, "backend": config.backend, "error": config.error}
        if config.error is None:
            tol = 0.0 if config is eager else TOLERANCE.get(config.backend or "", TOLERANCE["inductor"])
            first = _grad_check(config.grads_first, eager.grads_first, tol)
            last = _grad_check(config.grads_last, eager.grads_last, tol)
            q = statistics.quantiles(config.samples, n=4) if len(config.samples) > 1 else [config.samples[0]] * 3
            row.update(
                cold_ms=config.cold_ms, median_ms=statistics.median(config.samples), q1_ms=q[0], q3_ms=q[2],
                samples_ms=config.samples, captures=config.captures, tolerance=tol,
                grads_match_eager=first["ok"] and last["ok"], max_abs_diff=max(first["max_abs_diff"], last["max_abs_diff"]),
                grad_problems=(first["problems"] + last["problems"])[:4],
                grad_types=sorted({f"{e['type']}{list(e['placements']) if e.get('placements') else ''}" for e in config.grads_first.values()}),
            )
        rows.append(row)
    return {"rank": rank, "rows": rows, "wall_s": time.perf_counter() - start}


# --- front -----------------------------------------------------------------------------


def bench(
    world_size: int = 2,
    backends: Sequence[str] = ("aot_eager", "inductor"),
    *,
    settings: TPBench | None = None,
    timeout_s: float = 400.0,
) -> dict[str, Any]:
    """Run the TP block bench on ``world_size`` processes; rank 0's timings, every rank's gradient check."""
    from subclass_ca.distributed import run_workers

    settings = settings or TPBench()
    settings.check_world_size(world_size)
    backends = tuple(backends)
    start = time.perf_counter()
    per_rank = run_workers(_rank_main, world_size, timeout_s=timeout_s, args=(settings, backends))
    rows = per_rank[0]["rows"]
    for i, row in enumerate(rows):
        others = [r["rows"][i] for r in per_rank[1:]]
        if row["error"] is None and any(o["error"] for o in others):
            row["error"] = next(o["error"] for o in others if o["error"])
        if row["error"] is None:
            row["grads_match_eager"] = all(r["grads_match_eager"] for r in [row, *others])
            row["max_abs_diff"] = max(r["max_abs_diff"] for r in [row, *others])
            row["grad_problems"] = [p for r in [row, *others] for p in r["grad_problems"]][:4]
    eager_ms = rows[0].get("median_ms")
    for row in rows:
        if row.get("median_ms") and eager_ms:
            row["x_eager"] = row["median_ms"] / eager_ms
    return {
        "world_size": world_size,
        "backends": list(backends),
        "settings": dataclasses.asdict(settings),
        "torch": torch.__version__,
        "rows": rows,
        "ok": all(r["error"] is None and r["grads_match_eager"] for r in rows if r["mode"] != "stock_ca"),
        "wall_s": time.perf_counter() - start,
        "command": f"python -m tools bench --tp --nproc {world_size}",
    }


def _cell(row: dict[str, Any]) -> str:
    if row["error"]:
        return "error"
    verdict = "yes" if row["grads_match_eager"] else "**NO**"
    return f"{verdict} ({row['max_abs_diff']:.1e})"


def _table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| mode | backend | steady ms (median) | IQR ms | x eager | cold first step ms | CA captures | grads = eager (max abs diff) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in result["rows"]:
        backend = row["backend"] or "-"
        if row["error"]:
            lines.append(f"| {row['mode']} | {backend} | - | - | - | - | - | error: {row['error'][:120]} |")
            continue
        lines.append(
            f"| {row['mode']} | {backend} | {row['median_ms']:.2f} | {row['q1_ms']:.2f}-{row['q3_ms']:.2f} | "
            f"{row.get('x_eager', float('nan')):.2f} | {row['cold_ms']:.0f} | {row['captures']} | {_cell(row)} |"
        )
    return lines


def markdown_section(result: dict[str, Any], *, command: str | None = None) -> str:
    """RESULTS.md section for :func:`bench`'s result."""
    s = result["settings"]
    lines = [
        "",
        f"## Tensor-parallel transformer block, {result['world_size']} processes",
        "",
        f"One block (RMSNorm -> {s['heads']}-head causal SDPA attention -> residual -> RMSNorm -> SwiGLU MLP -> residual), "
        f"batch {s['batch']} x seq {s['seq']} x dim {s['dim']}, MLP hidden {s['hidden']}; `parallelize_module` with "
        "ColwiseParallel q/k/v/w1/w3 and RowwiseParallel wo/w2 on a 1-D CPU mesh (gloo, 127.0.0.1), so the weights are "
        "sharded DTensors. Step = zero_grad + forward + mse loss + backward (the loss is inside the compiled function); "
        f"steady = median over {s['reps']} interleaved rounds of {s['block']} steps after {s['warmup']} warm-up steps "
        f"(rank 0's clock, a barrier before each sample); cold = the first step (compile + capture). torch {result['torch']}. "
        "Gradients: every rank's shards after the first and the last step against eager's (type, placements, "
        "`assert_close` atol = rtol = 1e-5 for aot_eager, 1e-4 for inductor).",
        "",
        *_table(result),
        "",
        f"Command: `{command_of(result, command, 'python -m tools bench --tp')}` ({result['wall_s']:.0f} s). "
        "stock_ca = torch's own compiled autograd with `torch.compile(gm, backend=b, fullgraph=True)`.",
        "",
    ]
    return "\n".join(lines)


def format_summary(result: dict[str, Any]) -> str:
    """The result as plain text (the markdown table without the prose)."""
    return "\n".join(_table(result) + [f"wall {result['wall_s']:.0f} s, ok={result['ok']}"])

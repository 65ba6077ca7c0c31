"""Where the time of an FSDP2 backward under subclass_ca goes: compiled autograd itself vs compiling its pieces.

Note [The cost of a split FSDP2 backward]
-----------------------------------------
Under ``enable()`` an FSDP2 backward runs as compiled autograd's capture (the C++ engine walks
the graph, looks up the cached CA graph) and then the CA graph split at FSDP2's hooks: compiled
pieces, FSDP2's hooks eagerly between them (Note [Splitting the CA graph at FSDP2's hooks] in
``subclass_ca/_split.py``).  Against eager FSDP2 that adds two fixed costs, which this tool separates by
timing, per row, the *backward alone* (``loss.backward()``, forward excluded) in four modes in
the same interleaved rounds:

* ``eager``: eager FSDP2 (eager forward and backward);
* ``compile``: compiled forward, eager backward (the AOT backward of each compiled region);
* ``subclass_ca``: compiled forward, backward under ``enable()``: the pieces compiled;
* ``ca_uncompiled``: the same model and the same CA graph, with every piece run as its FX graph
  uncompiled (``SplitGraph.use_compiled(False)``): what compiled autograd costs before any
  compiler runs -- capture, the CA graph's own Python, the hooks.

``ca_uncompiled - compile`` is then compiled autograd's floor on this model, and
``(subclass_ca - ca_uncompiled) / pieces`` what entering one compiled piece costs (Dynamo's
frame and guards, AOTAutograd's runtime wrapper), net of what the compiler saved inside it.
No optimizer step runs (one fixed batch, gradients cleared each step), so every mode's last
gradients must equal eager FSDP2's: bitwise on ``aot_eager``, ``1e-4`` on inductor.

A world of 1 (the default, ``--nproc 1``) has no collectives: the fixed costs are then not
diluted by gloo's blocking reduce-scatters (which ``bench --fsdp2`` times at 2 processes).
torchao's NF4 cannot be sharded on a world of 1 (its ``fsdp_post_all_gather`` fails in eager
FSDP2 itself); that row needs ``--nproc 2``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from subclass_ca import _compat, _split
from tools.common import report
from tools.common.report import as_json as to_json
from tools.common.stats import quartiles

from . import parity, runs

__all__ = ["MODES", "TARGETS", "FSDP2Cost", "measure", "format_summary", "markdown_section", "to_json", "build_parser", "main"]

MODES: tuple[str, ...] = ("eager", "compile", "subclass_ca", "ca_uncompiled")
COMMAND = "python -m tools fsdp2-cost"
TARGETS: dict[str, str] = {}
"""None: the costs are measured and the gradients checked (``ok``), not judged against a target."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDP2Cost:
    """Rows and schedule of one measurement (every rank uses the same)."""

    models: tuple[str, ...] = ("micro", "block_two_tensor")
    backends: tuple[str, ...] = ("aot_eager", "inductor")
    warmup: int = 3
    reps: int = 15
    block: int = 5
    """Backwards per timed sample."""
    device: str = "cpu"
    """``cpu`` (gloo) or ``cuda`` (NCCL, one GPU per rank; the backward's time includes a synchronize)."""

    def __post_init__(self) -> None:
        unknown = [m for m in self.models if m not in runs.MODELS]
        if unknown:
            raise ValueError(f"FSDP2Cost.models: unknown {unknown}; allowed values are {list(runs.MODELS)}")
        if not self.models or not self.backends:
            raise ValueError("FSDP2Cost: models and backends must not be empty")
        for name in ("reps", "block"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"FSDP2Cost.{name} must be a positive int, got {getattr(self, name)!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            raise ValueError(f"FSDP2Cost.warmup must be an int >= 0, got {self.warmup!r}")
        if self.device not in parity.DEVICES:
            raise ValueError(f"FSDP2Cost.device: got {self.device!r}, allowed values are {parity.DEVICES}")


# --- one rank ------------------------------------------------------------------------


@contextlib.contextmanager
def _collect_split_graphs(sink: list[_split.SplitGraph]) -> Iterator[None]:
    """Record every CA graph split while the block runs (the runtime builds them through ``_split.split_graph``)."""
    original = _split.split_graph

    def collecting(*args: Any, **kwargs: Any) -> _split.SplitGraph:
        graph = original(*args, **kwargs)
        sink.append(graph)
        return graph

    _split.split_graph = collecting
    try:
        yield
    finally:
        _split.split_graph = original


def _backward_step(name: str, run: parity.FSDP2Run, rank: int) -> tuple[torch.nn.Module, Callable[[], float]]:
    """A model for mode ``name`` and its step: zero grads, forward, loss, timed backward (seconds)."""
    model = parity.build_model(run)
    parity.shard(model, run)
    forward: Callable[..., torch.Tensor] = model if name == "eager" else torch.compile(model, backend=run.backend)
    context: Callable[[], Any] = contextlib.nullcontext
    if name == "subclass_ca":
        from subclass_ca.api import enable

        ours = enable(backend=run.backend)
        context = lambda: ours  # noqa: E731 - one enable() object, entered every step
    x, y = parity.rank_batch(run, rank, 0)

    def step() -> float:
        model.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(forward(x), y)
        start = time.perf_counter()
        with context():
            loss.backward()
        if run.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start

    return model, step


def _grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return runs.local_shards({n: p.grad for n, p in model.named_parameters() if p.requires_grad})


def _row(rank: int, settings: FSDP2Cost, model_name: str, backend: str) -> dict[str, Any]:
    import torch.distributed as dist

    from subclass_ca.api import reset

    run = dataclasses.replace(runs.MODELS[model_name], backend=backend, device=settings.device)
    reset()
    built = {name: _backward_step(name, run, rank) for name in ("eager", "compile", "subclass_ca")}
    splits: list[_split.SplitGraph] = []
    with _collect_split_graphs(splits):
        for _, step in built.values():
            step()  # cold: compiles
    if len(splits) != 1:
        raise RuntimeError(f"expected the subclass_ca backward to be one split CA graph, found {len(splits)}")
    split = splits[0]

    def timed(name: str) -> float:
        step = built["subclass_ca" if name == "ca_uncompiled" else name][1]
        split.use_compiled(name != "ca_uncompiled")
        dist.barrier()
        total = sum(step() for _ in range(settings.block))
        split.use_compiled(True)
        return total * 1e3 / settings.block

    for _ in range(settings.warmup):
        for name in MODES:
            timed(name)
    samples: dict[str, list[float]] = {name: [] for name in MODES}
    for rep in range(settings.reps):
        for name in MODES if rep % 2 == 0 else MODES[::-1]:
            samples[name].append(timed(name))
    eager_grads = _grads(built["eager"][0])
    tolerance = runs.TOLERANCE.get(backend, runs.TOLERANCE["inductor"])
    checks = {}
    for name, (model, step) in built.items():
        if name == "subclass_ca":
            split.use_compiled(False)
            step()
            checks["ca_uncompiled"] = runs.compare_shards(_grads(model), eager_grads, tolerance)
            split.use_compiled(True)
            step()
        checks[name] = runs.compare_shards(_grads(model), eager_grads, tolerance)
    return {
        "model": model_name, "backend": backend, "pieces": split.pieces, "hooks": split.hooks,
        "modes": {
            name: {
                "samples_ms": samples[name],
                "ratios": [s / e for s, e in zip(samples[name], samples["eager"])],
                "problems": checks[name][0][:4] if name in checks else [],
                "max_abs_diff": checks[name][1] if name in checks else 0.0,
            }
            for name in MODES
        },
    }


def _rank_main(rank: int, world_size: int, settings: FSDP2Cost) -> dict[str, Any]:
    rows = []
    with _compat.uncached_compiles():
        for model_name in settings.models:
            for backend in settings.backends:
                skip = runs.unavailable(model_name)
                if skip is None and world_size == 1 and runs.MODELS[model_name].params == "nf4_lora":
                    skip = "NF4 cannot be sharded on a world of 1 (torchao's fsdp_post_all_gather); use --nproc 2"
                if skip:
                    rows.append({"model": model_name, "backend": backend, "skipped": skip})
                    continue
                try:
                    rows.append(_row(rank, settings, model_name, backend))
                except Exception as error:  # noqa: BLE001 - a row's failure is a result (every rank fails alike)
                    message = str(error).strip().splitlines()[0] if str(error).strip() else ""
                    rows.append({"model": model_name, "backend": backend, "error": f"{type(error).__name__}: {message}"[:300]})
    return {"rank": rank, "rows": rows}


# --- the launch and its summary ----------------------------------------------------


def _summarize_row(per_rank: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Rank 0's timings, every rank's correctness, and the two derived costs of the Note."""
    first = per_rank[0]
    if "modes" not in first:
        return dict(first)
    row = {k: first[k] for k in ("model", "backend", "pieces", "hooks")}
    row["modes"] = {}
    for name, entry in first["modes"].items():
        q1, median, q3 = quartiles(entry["samples_ms"])
        r1, ratio, r3 = quartiles(entry["ratios"])
        problems = [p for rank in per_rank for p in rank["modes"][name]["problems"]]
        row["modes"][name] = {"median_ms": median, "iqr_ms": (q1, q3), "ratio": ratio, "ratio_iqr": (r1, r3),
                              "correct": not problems, "problems": problems[:4],
                              "max_abs_diff": max(rank["modes"][name]["max_abs_diff"] for rank in per_rank)}
    diffs = {
        "ca_floor_ms": [u - c for u, c in zip(first["modes"]["ca_uncompiled"]["samples_ms"], first["modes"]["compile"]["samples_ms"])],
        "piece_entry_us": [1e3 * (s - u) / max(row["pieces"], 1) for s, u in
                           zip(first["modes"]["subclass_ca"]["samples_ms"], first["modes"]["ca_uncompiled"]["samples_ms"])],
    }
    for key, values in diffs.items():
        q1, median, q3 = quartiles(values)
        row[key] = {"median": median, "iqr": (q1, q3)}
    return row


def measure(world_size: int = 1, *, settings: FSDP2Cost | None = None, timeout_s: float = 900.0) -> dict[str, Any]:
    """Launch ``world_size`` ranks (gloo on 127.0.0.1, or NCCL with ``settings.device="cuda"``; one thread
    each), time every row, check it, summarise (JSON-able)."""
    from subclass_ca.distributed import run_workers

    settings = settings or FSDP2Cost()
    start = time.perf_counter()
    per_rank = run_workers(_rank_main, world_size, timeout_s=timeout_s, args=(settings,), device=settings.device)
    rows = [_summarize_row([r["rows"][index] for r in per_rank]) for index in range(len(per_rank[0]["rows"]))]
    ok = all(m["correct"] for r in rows if "modes" in r for m in r["modes"].values()) and not any("error" in r for r in rows)
    return {"world_size": world_size, "settings": dataclasses.asdict(settings), "torch": torch.__version__,
            "rows": rows, "ok": ok, "wall_s": time.perf_counter() - start}


def _table(result: dict[str, Any]) -> list[str]:
    lines = ["| model | backend | mode | backward ms, median (IQR) | x eager FSDP2, per round (IQR) | = eager FSDP2 (max abs diff) |",
             "|---|---|---|---:|---:|---|"]
    for row in result["rows"]:
        if "modes" not in row:
            lines.append(f"| {row['model']} | {row['backend']} | - | - | - | {row.get('skipped') or row.get('error')} |")
            continue
        for name, m in row["modes"].items():
            ratio = "1.00" if name == "eager" else f"{m['ratio']:.3f} ({m['ratio_iqr'][0]:.3f}-{m['ratio_iqr'][1]:.3f})"
            check = "-" if name == "eager" else (f"yes ({m['max_abs_diff']:.1e})" if m["correct"] else f"NO: {'; '.join(m['problems'][:2])}")
            lines.append(f"| {row['model']} | {row['backend']} | {name} | {m['median_ms']:.3f} "
                         f"({m['iqr_ms'][0]:.3f}-{m['iqr_ms'][1]:.3f}) | {ratio} | {check} |")
    return lines


def _derived(result: dict[str, Any]) -> list[str]:
    lines = []
    for row in result["rows"]:
        if "modes" in row:
            floor, entry = row["ca_floor_ms"], row["piece_entry_us"]
            lines.append(
                f"{row['model']}, {row['backend']}: {row['pieces']} compiled pieces, {row['hooks']} hook calls; "
                f"compiled autograd before any compiler (ca_uncompiled - compile) {floor['median']:+.3f} ms "
                f"(IQR {floor['iqr'][0]:+.3f} to {floor['iqr'][1]:+.3f}); entering one compiled piece, net of what the "
                f"compiler saved in it ((subclass_ca - ca_uncompiled) / pieces) {entry['median']:+.0f} us "
                f"(IQR {entry['iqr'][0]:+.0f} to {entry['iqr'][1]:+.0f})"
            )
    return lines


def format_summary(result: dict[str, Any]) -> str:
    """The result as plain text: the table, the derived costs, wall time and verdict."""
    return "\n".join(_table(result) + [""] + _derived(result) + [f"wall {result['wall_s']:.0f} s, ok={result['ok']}"])


def markdown_section(result: dict[str, Any], *, command: str | None = None) -> str:
    """A markdown section: settings, the table, the derived costs, the command."""
    s = result["settings"]
    return "\n".join([
        "", f"## FSDP2 backward cost, {result['world_size']} process(es): compiled autograd vs compiling its pieces", "",
        f"Backward only (`loss.backward()`), one fixed batch, no optimizer step; {s['reps']} interleaved rounds of "
        f"{s['block']} backwards per mode after {s['warmup']} warm-up rounds, rank 0's clock; ratios within each round; "
        f"device {s['device']}. "
        "`ca_uncompiled` = the subclass_ca model and CA graph with every split piece run as its FX graph, uncompiled "
        f"(Note [The cost of a split FSDP2 backward] in `tools/fsdp2/cost.py`). torch {result['torch']}.",
        "", *_table(result), "", *[f"* {line}" for line in _derived(result)], "",
        f"Command: `{report.command_of(result, command, COMMAND)}` ({result['wall_s']:.0f} s).", ""])


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools fsdp2-cost``."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=1, help="world size (default 1: no collectives)")
    parser.add_argument("--models", nargs="+", default=list(FSDP2Cost.models), help=f"of {list(runs.MODELS)}")
    parser.add_argument("--backends", nargs="+", default=list(FSDP2Cost.backends))
    parser.add_argument("--reps", type=int, default=FSDP2Cost.reps, help="interleaved rounds")
    parser.add_argument("--block", type=int, default=FSDP2Cost.block, help="backwards per sample")
    parser.add_argument("--warmup", type=int, default=FSDP2Cost.warmup, help="warm-up rounds")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="gloo on CPU or NCCL on CUDA (one GPU per rank)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds before the ranks are terminated")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="also write the markdown section")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = FSDP2Cost(models=tuple(args.models), backends=tuple(args.backends), reps=args.reps,
                             block=args.block, warmup=args.warmup, device=args.device)
    except ValueError as error:
        parser.error(str(error))
    result = measure(args.nproc, settings=settings, timeout_s=args.timeout)
    result["command"] = " ".join([COMMAND, *argv])
    print(format_summary(result))
    report.write(sys.modules[__name__], result, json_path=args.json, markdown_path=args.markdown)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

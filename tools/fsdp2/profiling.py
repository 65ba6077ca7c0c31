"""Where FSDP2's reduce-scatters fall in one backward: eager FSDP2 vs subclass_ca, from a torch.profiler trace.

Note [Reduce-scatter overlap under the split CA graph]
------------------------------------------------------
Eager FSDP2 (torch 2.13) issues each group's reduce-scatter from its post-backward hook, as
soon as that layer's gradients exist, with ``async_op=False`` inside
``device_handle.stream(reduce_scatter_stream)``: on CUDA the NCCL kernel runs on FSDP2's own
stream while the autograd engine goes on launching the next layer's gradient kernels on the
compute stream -- that is the overlap.  On CPU (gloo) the call blocks the thread, so eager
FSDP2 overlaps nothing there.

Under ``subclass_ca.enable()`` the CA graph is split at FSDP2's hooks (Note [Splitting the CA
graph at FSDP2's hooks] in ``subclass_ca/_split.py``), and the hooks run eagerly *between* the compiled
pieces, in graph order.  So the overlap is kept exactly when every reduce-scatter is issued
at the same point of the backward as in eager: after its layer's gradient pieces and before
the pieces that compute the next layer's gradients (not bunched at the end of the backward).

This module measures that: it profiles one steady backward step (after warm-up) of eager
FSDP2 and of subclass_ca on rank 0 and reduces the trace to a *schedule* -- the ordered spans
of FSDP2's hooks (``record_function`` labels ``FSDP::pre_backward (i)``,
``FSDP::post_backward_reduce (i)``, ...) and of compute (autograd nodes in eager, compiled
pieces ``Torch-Compiled Region: ...`` under subclass_ca; time spent in FSDP2 spans nested in
a compute span is cut out of it).  Per reduce-scatter it reports when it was issued, how much
compute of later layers/pieces ran after it (compute that *could* overlap it), and on CUDA how
much of its NCCL kernel time overlapped compute kernels on other streams.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from tools.common import report

from .parity import FSDP2Run, backward_context, build_model, rank_batch, shard

__all__ = [
    "MODES",
    "BACKWARD_LABEL",
    "Span",
    "ReduceScatter",
    "Schedule",
    "load_trace",
    "schedule_from_trace",
    "kernel_overlaps",
    "profile",
    "summary_json",
    "to_json",
    "TARGETS",
    "format_summary",
    "markdown_section",
    "add_arguments",
    "run_config",
    "profile_main",
    "build_parser",
    "main",
]

MODES: tuple[str, ...] = ("eager", "subclass_ca")
TARGETS: dict[str, str] = {}
"""None: the schedules are compared (``same_schedule``), not judged against a target."""
BACKWARD_LABEL = "subclass_ca::fsdp2_profile::backward"
"""``record_function`` label around the profiled ``loss.backward()``: the schedule's time origin and end."""
MIN_SEGMENT_US = 1.0
"""Compute segments shorter than this (what is left of a compute span between nested FSDP2 spans) are dropped."""
OUTLINE_KINDS = ("pre_backward", "reduce_scatter", "root_callback")
"""The FSDP2 span kinds :meth:`Schedule.outline` names; compute between them is one ``compute`` token."""

_FSDP_KINDS = {
    "pre_backward": "pre_backward",
    "all_gather": "all_gather",
    "backward_prefetch": "prefetch",
    "post_backward_reduce": "reduce_scatter",
    "post_backward_reshard": "post_backward",
    "post_backward_accumulate": "post_backward",
    "post_backward_rs_wait": "post_backward",
    "root_post_backward_callback": "root_callback",
}
_FSDP_NAME = re.compile(r"^FSDP::(\w+)(?: \((.*)\)| for (.*))?$")
_COMPILED_PREFIX = "Torch-Compiled Region"
_NODE_PREFIX = "autograd::engine::evaluate_function: "
_HOOK_NODES = ("RegisterPostBackwardFunction",)
"""Autograd nodes that are FSDP2 hooks, not compute (their FSDP2 spans are in the schedule)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Span:
    """One span of the backward schedule, in microseconds from the backward's start."""

    kind: str
    """``compute`` or an FSDP2 kind: pre_backward, all_gather, prefetch, reduce_scatter, post_backward, root_callback."""
    label: str
    """Compute: the autograd node or compiled region; FSDP2: the module (fqn) the hook works for."""
    start_us: float
    end_us: float
    thread: int = 0
    """Profiler thread id (kept so nesting is only ever decided within one thread)."""

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@dataclasses.dataclass(frozen=True, kw_only=True)
class ReduceScatter:
    """One group's reduce-scatter (``FSDP::post_backward_reduce``) and the compute around it."""

    group: str
    """FSDP2's label of the group (the module's fqn; "" for the root)."""
    issue_us: float
    """When it was issued, from the backward's start."""
    end_us: float
    """When the issuing call returned (on CUDA the kernel may still run on FSDP2's stream)."""
    compute_before_us: float
    """Compute of the backward before it was issued."""
    later_compute_us: float
    """Compute that ran after it was issued, until the backward ended: what could overlap it."""
    later_compute_spans: int
    """Compute spans (compiled pieces; autograd-node segments in eager) starting after it was issued."""
    cpu_overlap_us: float
    """Compute (any thread) that ran while the issuing call had not returned (0 when it blocks, as on gloo)."""
    gpu_kernel_us: float | None = None
    """CUDA: duration of its NCCL reduce-scatter kernel (None without CUDA activity or when kernels cannot be matched)."""
    gpu_overlap_us: float | None = None
    """CUDA: part of that kernel time during which a compute kernel ran on another stream."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Schedule:
    """One mode's profiled backward reduced to FSDP2 spans, compute spans and per-reduce-scatter figures."""

    mode: str
    backward_us: float
    spans: tuple[Span, ...]
    """Every FSDP2 and compute span, ordered by start (FSDP2 spans may nest; compute spans do not)."""
    reduce_scatters: tuple[ReduceScatter, ...]
    compute_us: float
    compute_spans: int
    compiled_regions: int
    """Outermost ``Torch-Compiled Region`` events (the compiled pieces under subclass_ca; 0 in eager)."""
    gpu: dict[str, float] | None = None
    """CUDA: NCCL reduce-scatter kernel time, its overlap with compute kernels on other streams, the fraction."""
    split_pieces: int | None = None
    """subclass_ca's capture report: compiled pieces and eager hook calls of the split CA graph."""
    split_hooks: int | None = None

    def outline(self) -> tuple[str, ...]:
        """The order of FSDP2's hooks and compute, e.g. ``("compute", "pre_backward(4)", "compute", "reduce_scatter(4)", ...)``."""
        tokens: list[str] = []
        for span in self.spans:
            if span.kind == "compute":
                if not tokens or tokens[-1] != "compute":
                    tokens.append("compute")
            elif span.kind in OUTLINE_KINDS:
                tokens.append(f"{span.kind}({span.label})" if span.kind != "root_callback" else span.kind)
        return tuple(tokens)


# --- trace -> schedule ------------------------------------------------------------


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The complete (``"ph": "X"``) events of a chrome trace written by ``torch.profiler``."""
    data = json.loads(Path(path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def _fsdp_span(name: str) -> tuple[str, str] | None:
    match = _FSDP_NAME.match(name)
    if match is None or match.group(1) not in _FSDP_KINDS:
        return None
    return _FSDP_KINDS[match.group(1)], match.group(2) or match.group(3) or ""


def _compute_label(name: str) -> str | None:
    if name.startswith(_COMPILED_PREFIX):
        return name
    if name.startswith(_NODE_PREFIX):
        node = name[len(_NODE_PREFIX):]
        return None if any(hook in node for hook in _HOOK_NODES) else node.rsplit("::", 1)[-1]
    return None


def _outermost(spans: Sequence[Span]) -> list[Span]:
    """Spans not contained in another span of ``spans`` on the same thread."""
    ordered = sorted(spans, key=lambda s: (s.thread, s.start_us, -s.end_us))
    out: list[Span] = []
    for span in ordered:
        if out and out[-1].thread == span.thread and span.end_us <= out[-1].end_us:
            continue
        out.append(span)
    return out


def _cut(span: Span, holes: Iterable[Span]) -> list[Span]:
    """``span`` minus the ``holes`` on its thread (FSDP2 spans run inside an autograd node); short rests dropped."""
    pieces, start = [], span.start_us
    # in start order (a Span has no ordering of its own: sorting two or more of them raised TypeError)
    inside = (h for h in holes if h.thread == span.thread and span.start_us <= h.start_us < span.end_us)
    for hole in sorted(inside, key=lambda h: h.start_us):
        if hole.start_us > start:
            pieces.append((start, hole.start_us))
        start = max(start, hole.end_us)
    if span.end_us > start:
        pieces.append((start, span.end_us))
    return [dataclasses.replace(span, start_us=a, end_us=b) for a, b in pieces if b - a >= MIN_SEGMENT_US]


def _overlap(a: tuple[float, float], intervals: Iterable[tuple[float, float]]) -> float:
    """Length of ``a`` covered by the union of ``intervals``."""
    covered, reach = 0.0, a[0]
    for start, end in sorted(intervals):
        start, end = max(start, reach), min(end, a[1])
        if end > start:
            covered += end - start
            reach = end
    return covered


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def kernel_overlaps(events: Sequence[dict[str, Any]], *, window: tuple[float, float] | None = None) -> list[tuple[float, float]]:
    """(kernel us, overlapped us) per NCCL reduce-scatter kernel in time order (empty without GPU kernels).

    Overlapped: the part of the kernel during which a non-NCCL kernel ran on another stream
    (compute that really ran concurrently; kernels on the same stream are serialised).
    ``window`` (trace ``ts`` units, microseconds) keeps kernels starting inside it.
    """
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if window is not None:
        kernels = [e for e in kernels if window[0] <= e["ts"] <= window[1]]

    def stream(event: dict[str, Any]) -> Any:
        return (event.get("args") or {}).get("stream", event.get("tid"))

    nccl = [e for e in kernels if "nccl" in e["name"].lower()]
    scatters = sorted((e for e in nccl if "reducescatter" in e["name"].lower().replace("_", "")), key=lambda e: e["ts"])
    compute = [e for e in kernels if "nccl" not in e["name"].lower()]
    out = []
    for kernel in scatters:
        others = _union((e["ts"], e["ts"] + e["dur"]) for e in compute if stream(e) != stream(kernel))
        out.append((float(kernel["dur"]), _overlap((kernel["ts"], kernel["ts"] + kernel["dur"]), others)))
    return out


def schedule_from_trace(
    events: Sequence[dict[str, Any]], *, mode: str, split_pieces: int | None = None, split_hooks: int | None = None
) -> Schedule:
    """Reduce a profiled backward's trace events to its :class:`Schedule`.

    The events must contain one ``BACKWARD_LABEL`` span: everything is measured from its
    start, and only events inside it count.
    """
    marks = [e for e in events if e["name"] == BACKWARD_LABEL]
    if len(marks) != 1:
        raise ValueError(f"expected one {BACKWARD_LABEL!r} span in the trace, found {len(marks)}")
    origin, finish = float(marks[0]["ts"]), float(marks[0]["ts"] + marks[0]["dur"])
    fsdp: list[Span] = []
    compute: list[Span] = []
    for event in events:
        if event.get("cat") == "kernel" or not origin <= event["ts"] <= finish:
            continue
        span = dict(start_us=event["ts"] - origin, end_us=event["ts"] + event["dur"] - origin, thread=int(event.get("tid", 0) or 0))
        if (found := _fsdp_span(event["name"])) is not None:
            fsdp.append(Span(kind=found[0], label=found[1], **span))
        elif (label := _compute_label(event["name"])) is not None:
            compute.append(Span(kind="compute", label=label, **span))
    outer = _outermost(compute)
    compiled = sum(1 for span in outer if span.label.startswith(_COMPILED_PREFIX))
    holes = _outermost(fsdp)
    segments = [piece for span in outer for piece in _cut(span, holes)]
    intervals = [(s.start_us, s.end_us) for s in segments]
    backward_us = finish - origin
    kernels = kernel_overlaps(events, window=(origin, finish))
    scatters = sorted((s for s in fsdp if s.kind == "reduce_scatter"), key=lambda s: s.start_us)
    matched = len(kernels) == len(scatters)
    reduce_scatters = tuple(
        ReduceScatter(
            group=rs.label,
            issue_us=rs.start_us,
            end_us=rs.end_us,
            compute_before_us=_overlap((0.0, rs.start_us), intervals),
            later_compute_us=_overlap((rs.start_us, backward_us), intervals),
            later_compute_spans=sum(1 for s in segments if s.start_us >= rs.start_us),
            cpu_overlap_us=_overlap((rs.start_us, rs.end_us), intervals),
            gpu_kernel_us=kernels[index][0] if matched else None,
            gpu_overlap_us=kernels[index][1] if matched else None,
        )
        for index, rs in enumerate(scatters)
    )
    gpu = None
    if kernels:
        total, overlapped = sum(k for k, _ in kernels), sum(o for _, o in kernels)
        gpu = {"rs_kernels": len(kernels), "rs_kernel_us": total, "rs_overlap_us": overlapped,
               "rs_overlap_fraction": overlapped / total if total else 0.0}
    return Schedule(
        mode=mode,
        backward_us=backward_us,
        spans=tuple(sorted([*fsdp, *segments], key=lambda s: (s.start_us, -s.end_us))),
        reduce_scatters=reduce_scatters,
        compute_us=sum(s.duration_us for s in segments),
        compute_spans=len(segments),
        compiled_regions=compiled,
        gpu=gpu,
        split_pieces=split_pieces,
        split_hooks=split_hooks,
    )


# --- profiling (runs in every rank; rank 0 profiles) ------------------------------


def _profiled_backward(loss: torch.Tensor, mode: str, run: FSDP2Run, trace: Path | None) -> list[dict[str, Any]]:
    """``loss.backward()`` in ``mode`` under torch.profiler (CUDA activity too on a GPU); the trace events."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = run.device == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        with record_function(BACKWARD_LABEL):
            with backward_context(mode, run):
                loss.backward()
            if cuda:
                torch.cuda.synchronize()  # the span ends when the GPU work (and FSDP2's streams) has
    with tempfile.TemporaryDirectory() as scratch:
        path = trace or Path(scratch) / "trace.json"
        prof.export_chrome_trace(str(path))
        return load_trace(path)


def _profile_mode(rank: int, mode: str, run: FSDP2Run, trace_dir: str | None) -> Schedule | None:
    """Train ``run.steps`` steps in ``mode``; rank 0 profiles the last backward and returns its schedule."""
    import torch.distributed as dist

    from subclass_ca.diagnostics import last_report

    model = build_model(run)  # on run.device
    shard(model, run)
    forward = torch.compile(model, backend=run.backend) if mode == "subclass_ca" else model
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=run.lr)
    schedule = None
    for step in range(run.steps):
        x, y = rank_batch(run, rank, step)
        dist.barrier()
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(forward(x), y)
        if step == run.steps - 1 and rank == 0:
            trace = Path(trace_dir) / f"fsdp2_{mode}_rank0.json" if trace_dir else None
            events = _profiled_backward(loss, mode, run, trace)
            report = last_report() if mode == "subclass_ca" else None
            schedule = schedule_from_trace(
                events, mode=mode,
                split_pieces=getattr(report, "split_pieces", None), split_hooks=getattr(report, "split_hooks", None),
            )
        else:
            with backward_context(mode, run):
                loss.backward()
        optimizer.step()
    return schedule


def _profile_worker(rank: int, world_size: int, modes: Sequence[str], run: FSDP2Run, trace_dir: str | None) -> dict[str, Any]:
    from subclass_ca import _compat
    from subclass_ca.api import reset

    out = {}
    for mode in modes:
        reset()
        _compat.dynamo_counters().clear()
        out[mode] = _profile_mode(rank, mode, run, trace_dir)
    return out


def profile(
    run: FSDP2Run | None = None,
    modes: Sequence[str] = MODES,
    *,
    world_size: int = 2,
    timeout_s: float = 300.0,
    trace_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Profile the last of ``run.steps`` steps of each mode on rank 0; the schedules and whether they agree.

    ``run.steps - 1`` warm-up steps (compilation, FSDP2's lazy init) come first.  With
    ``trace_dir`` rank 0's chrome traces are written there (``fsdp2_<mode>_rank0.json``).
    """
    from subclass_ca.distributed import run_workers

    run = run or FSDP2Run(steps=4)
    if run.steps < 2:
        raise ValueError(f"profile needs at least one warm-up step: FSDP2Run.steps >= 2, got {run.steps}")
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"profile(modes=...): unknown {unknown}; allowed values are {list(MODES)}")
    if trace_dir is not None:
        Path(trace_dir).mkdir(parents=True, exist_ok=True)
    results = run_workers(
        _profile_worker, world_size, timeout_s=timeout_s, device=run.device,
        args=(tuple(modes), run, None if trace_dir is None else str(trace_dir)),
    )
    schedules: dict[str, Schedule] = results[0]
    outlines = {mode: schedule.outline() for mode, schedule in schedules.items()}
    return {
        "world_size": world_size,
        "device": run.device,
        "run": dataclasses.asdict(run),
        "torch": torch.__version__,
        "modes": schedules,
        "same_schedule": len(set(outlines.values())) == 1,
        "trace_dir": None if trace_dir is None else str(trace_dir),
    }


def summary_json(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary with its schedules as plain dicts (``json.dumps``-able), outlines included."""
    modes = {mode: {**dataclasses.asdict(s), "outline": list(s.outline())} for mode, s in summary["modes"].items()}
    return {**summary, "modes": modes}


to_json = summary_json


# --- reports ----------------------------------------------------------------------


def _ms(us: float) -> str:
    return f"{us / 1e3:.2f}"


def _gpu_cell(rs: ReduceScatter) -> str:
    if rs.gpu_kernel_us is None:
        return "-"
    assert rs.gpu_overlap_us is not None  # set together with gpu_kernel_us
    fraction = rs.gpu_overlap_us / rs.gpu_kernel_us if rs.gpu_kernel_us else 0.0
    return f"{_ms(rs.gpu_overlap_us)}/{_ms(rs.gpu_kernel_us)} ({fraction:.0%})"


def _headline(summary: dict[str, Any]) -> str:
    run = summary["run"]
    model = f"block {run['block']!r}" if run.get("block") else f"MLP {tuple(run['dims'])}"
    return (f"FSDP2 {model}, {summary['world_size']} processes "
            f"({'NCCL, cuda' if summary['device'] == 'cuda' else 'gloo, cpu'}), step {run['steps']} of {run['steps']} "
            f"profiled on rank 0, backend {run['backend']}, torch {summary['torch']}")


def _mode_line(schedule: Schedule) -> str:
    line = (f"{schedule.mode}: backward {_ms(schedule.backward_us)} ms, compute {_ms(schedule.compute_us)} ms "
            f"in {schedule.compute_spans} spans")
    if schedule.split_pieces is not None:
        line += f", split CA graph: {schedule.split_pieces} pieces, {schedule.split_hooks} hooks"
    if schedule.gpu:
        line += (f"; NCCL reduce-scatter kernels {_ms(schedule.gpu['rs_kernel_us'])} ms, "
                 f"{schedule.gpu['rs_overlap_fraction']:.0%} overlapped by compute on other streams")
    return line


def format_summary(summary: dict[str, Any]) -> str:
    """The schedules as plain text: per mode the reduce-scatters and the outline."""
    lines = [_headline(summary)]
    for schedule in summary["modes"].values():
        lines += ["", _mode_line(schedule),
                  f"  {'group':>6s} {'issued ms':>10s} {'% bwd':>6s} {'call ms':>8s} {'compute before':>15s} "
                  f"{'later compute ms (spans)':>25s} {'cpu overlap':>12s} {'gpu overlap/kernel ms':>22s}"]
        for rs in schedule.reduce_scatters:
            later = f"{_ms(rs.later_compute_us)} ({rs.later_compute_spans})"
            lines.append(
                f"  {rs.group or 'root':>6s} {_ms(rs.issue_us):>10s} {rs.issue_us / schedule.backward_us:>6.0%} "
                f"{_ms(rs.end_us - rs.issue_us):>8s} {_ms(rs.compute_before_us):>15s} {later:>25s} "
                f"{_ms(rs.cpu_overlap_us):>12s} {_gpu_cell(rs):>22s}"
            )
        lines.append("  outline: " + " > ".join(schedule.outline()))
    lines += ["", f"same hook/compute order in every mode: {'yes' if summary['same_schedule'] else 'NO'}"]
    return "\n".join(lines)


def markdown_section(summary: dict[str, Any], *, command: str | None = None) -> str:
    """A markdown section: one table row per (mode, reduce-scatter), the outlines, the command."""
    lines = ["", "## FSDP2 backward schedule: where the reduce-scatters run", "", _headline(summary) + ".", "",
             "| mode | group | issued (ms, % of backward) | call (ms) | compute before (ms) | later compute (ms, spans) "
             "| compute during call (ms) | GPU overlap / kernel (ms) |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for schedule in summary["modes"].values():
        for rs in schedule.reduce_scatters:
            lines.append(
                f"| {schedule.mode} | {rs.group or 'root'} | {_ms(rs.issue_us)} ({rs.issue_us / schedule.backward_us:.0%}) "
                f"| {_ms(rs.end_us - rs.issue_us)} | {_ms(rs.compute_before_us)} | {_ms(rs.later_compute_us)} "
                f"({rs.later_compute_spans}) | {_ms(rs.cpu_overlap_us)} | {_gpu_cell(rs)} |"
            )
    lines.append("")
    lines += [f"* {_mode_line(schedule)}; outline `{' > '.join(schedule.outline())}`" for schedule in summary["modes"].values()]
    lines += ["", f"Same hook/compute order in every mode: {'yes' if summary['same_schedule'] else '**no**'}.  "
              f"Command: `{report.command_of(summary, command, 'python -m tools fsdp2-profile')}`.", ""]
    return "\n".join(lines)


# --- CLI --------------------------------------------------------------------------


def run_config(args: argparse.Namespace) -> FSDP2Run:
    """The run ``args`` name (``model``, ``steps`` or ``fsdp2_steps``, ``backend``, ``device``), validated, nothing launched."""
    from .runs import MODELS

    model = getattr(args, "model", None) or "micro"
    if model not in MODELS:
        raise ValueError(f"--model: got {model!r}, allowed values are {list(MODELS)}")
    steps = getattr(args, "steps", None) or getattr(args, "fsdp2_steps", None) or 4
    return dataclasses.replace(MODELS[model], steps=steps, backend=getattr(args, "backend", None) or "aot_eager",
                               device=getattr(args, "device", None) or "cpu")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The profile's own options (``--trace-dir``, ``--markdown``); ``fsdp2 --profile`` shares them."""
    parser.add_argument("--trace-dir", metavar="DIR", help="write rank 0's chrome traces (fsdp2_<mode>_rank0.json) here")
    parser.add_argument("--markdown", metavar="PATH", help="also write the markdown section")


def profile_main(args: argparse.Namespace, *, command: str = "python -m tools fsdp2-profile") -> int:
    """Profile, print, write ``--json`` / ``--markdown``; exit status 1 when the modes' schedules differ.

    Reads ``nproc``, ``backend``, ``steps`` (or ``fsdp2_steps``), ``device``, ``timeout``,
    ``trace_dir``, ``json``, ``markdown`` from ``args``, each optional (so a parser that has
    only some of them, like ``fsdp2 --profile``, can call it); raises ValueError on bad values.
    """
    run = run_config(args)
    trace_dir = getattr(args, "trace_dir", None)
    summary = profile(run, world_size=getattr(args, "nproc", 2), timeout_s=getattr(args, "timeout", 300.0), trace_dir=trace_dir)
    summary["command"] = command
    print(format_summary(summary))
    report.write(sys.modules[__name__], summary, json_path=getattr(args, "json", None),
                 markdown_path=getattr(args, "markdown", None))
    if trace_dir:
        print(f"chrome traces: {trace_dir}/fsdp2_<mode>_rank0.json")
    return 0 if summary["same_schedule"] else 1


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools fsdp2-profile``."""
    parser = argparse.ArgumentParser(prog="python -m tools fsdp2-profile", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="world size (processes on 127.0.0.1)")
    parser.add_argument("--backend", default="aot_eager", help="backend of the compiled forward and the CA pieces")
    parser.add_argument("--steps", type=int, default=4, help="steps per mode; the last one is profiled (default 4)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="gloo on CPU or NCCL on CUDA")
    parser.add_argument("--model", default="micro", help="micro (the parity MLP), block_two_tensor or block_nf4_lora "
                        "(2 transformer blocks, as in bench --fsdp2)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are terminated")
    parser.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(argv) if argv is not None else sys.argv[1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return profile_main(args, command=" ".join(["python -m tools fsdp2-profile", *argv]))
    except ValueError as error:
        parser.error(str(error))


if __name__ == "__main__":
    sys.exit(main())

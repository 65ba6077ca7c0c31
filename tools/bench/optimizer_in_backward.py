"""Optimizer-in-backward (issue 59): step time and peak memory, eager / compile-only with eager hooks / enable().

Note [Measuring optimizer-in-backward]
--------------------------------------
Two models: an 8-block LoRA stack (frozen base, trainable rank-64 ``a``/``b``) and an MLP with many
parameters (16 square Linear layers).  Each trainable parameter has its own AdamW, stepped and
zeroed in its post-accumulate-grad hook (torchtune's ``optimizer_in_bwd``).  Three modes:

* ``eager``: eager forward and backward, the hooks eager (the reference people use it for memory);
* ``compile-only``: ``torch.compile(model, backend=...)`` forward, eager backward, hooks eager;
* ``subclass_ca``: the same compiled forward, the backward under ``subclass_ca.enable(backend=...)``
  with the optimizer steps compiled into the CA graph.

**Time.** One process; after warm-up, rounds run one step of each mode (forward, backward, the
steps inside it) in rotated order, and ratios are taken per round (Note [Verdicts on a shared
machine] in ``stats.py``).

**Memory.** The CPU allocator has no peak counter (and torch's CPU memory profiler reports nothing
here), so each (model, mode) runs in its own process with glibc's ``M_MMAP_THRESHOLD`` fixed at
32 KiB: every tensor larger than that is its own mapping, returned to the system when freed, so the
resident set follows the live tensors.  The process resets its peak (``/proc/self/clear_refs``) before
each measured step and reads ``VmHWM`` after it: the step's peak is that minus the resident set before
the step.  Linux only; elsewhere the memory columns are empty.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from tools.common.stats import judge, paired_ratio, stats

__all__ = ["MODES", "MODELS", "build_parser", "build", "main", "measure_times", "step_peak_bytes"]

MODES = ("eager", "compile-only", "subclass_ca")
MODELS = ("lora-stack", "mlp")
DIM, RANK, BATCH, BLOCKS, LAYERS = 512, 64, 64, 8, 16
MMAP_THRESHOLD = 32 * 1024
TARGETS = {
    "step": "subclass_ca's step <= compile-only with eager hooks (ratio <= 1.0)",
    "memory": "subclass_ca's peak memory <= eager optimizer-in-backward's (ratio <= 1.0)",
}


class LoRABlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.base = torch.nn.Parameter(torch.randn(DIM, DIM) / DIM**0.5, requires_grad=False)
        self.a = torch.nn.Parameter(torch.randn(DIM, RANK) / DIM**0.5)
        self.b = torch.nn.Parameter(torch.zeros(RANK, DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x @ self.base + (x @ self.a) @ self.b)


def build(model: str) -> torch.nn.Module:
    """The model with one AdamW per trainable parameter, stepped in its post-accumulate-grad hook."""
    torch.manual_seed(0)
    if model == "lora-stack":
        module: torch.nn.Module = torch.nn.Sequential(*(LoRABlock() for _ in range(BLOCKS)))
    else:
        layers: list[torch.nn.Module] = []
        for _ in range(LAYERS):
            layers += [torch.nn.Linear(DIM, DIM), torch.nn.ReLU()]
        module = torch.nn.Sequential(*layers)
    optimizers: dict[torch.Tensor, torch.optim.AdamW] = {
        p: torch.optim.AdamW([p], lr=1e-3) for p in module.parameters() if p.requires_grad
    }

    def step_in_backward(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for param in optimizers:
        param.register_post_accumulate_grad_hook(step_in_backward)
    return module


def _stepper(model: str, mode: str, backend: str) -> Any:
    import subclass_ca

    module = build(model)
    forward = module if mode == "eager" else torch.compile(module, backend=backend)
    x = torch.randn(BATCH, DIM, generator=torch.Generator().manual_seed(1))

    def step() -> None:
        loss = forward(x).pow(2).mean()
        if mode == "subclass_ca":
            with subclass_ca.enable(backend=backend):
                loss.backward()
        else:
            loss.backward()

    return step


def measure_times(model: str, backend: str, *, warmup: int, rounds: int) -> dict[str, list[float]]:
    """Seconds per step of each mode, interleaved round by round (warm-up excluded)."""
    steppers = {mode: _stepper(model, mode, backend) for mode in MODES}
    for step in steppers.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for index in range(rounds):
        order = MODES[index % len(MODES):] + MODES[: index % len(MODES)]
        for mode in order:
            start = time.perf_counter()
            steppers[mode]()
            times[mode].append(time.perf_counter() - start)
    return times


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/self/status has no {field}")


def step_peak_bytes(model: str, mode: str, backend: str, *, warmup: int, steps: int) -> int:
    """The largest growth of the resident set over one step, after warm-up (Note [Measuring optimizer-in-backward])."""
    step = _stepper(model, mode, backend)
    for _ in range(warmup):
        step()
    peaks = []
    for _ in range(steps):
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        before = _status("VmRSS")
        step()
        peaks.append(_status("VmHWM") - before)
    return max(peaks)


def _memory(model: str, mode: str, backend: str) -> int | None:
    if not sys.platform.startswith("linux"):
        return None
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "tools.bench.optimizer_in_backward", "--memory-child", model, mode, "--backend", backend]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900, check=True)
    return int(json.loads(done.stdout.strip().splitlines()[-1])["peak_bytes"])


def _row(model: str, backend: str, times: dict[str, list[float]], memory: dict[str, int | None]) -> dict[str, Any]:
    step_ratio = paired_ratio(times["subclass_ca"], times["compile-only"])
    eager_peak, ours_peak = memory["eager"], memory["subclass_ca"]
    memory_ratio = ours_peak / eager_peak if ours_peak is not None and eager_peak else None
    return {
        "model": model, "backend": backend,
        "step_ms": {mode: {k: v * 1e3 for k, v in stats(samples).items()} for mode, samples in times.items()},
        "peak_mib": {mode: (value / 2**20 if value is not None else None) for mode, value in memory.items()},
        "step_ratio": step_ratio,
        "step_verdict": judge(step_ratio, 1.0) if step_ratio else None,
        "memory_ratio": memory_ratio,
        "memory_verdict": (memory_ratio <= 1.0) if memory_ratio is not None else None,
    }


def markdown(rows: list[dict[str, Any]], command: str) -> str:
    lines = [
        "# Optimizer-in-backward: step time and peak memory (issue 59)", "",
        f"Produced by `{command}` (Note [Measuring optimizer-in-backward] in `tools/bench/optimizer_in_backward.py`).", "",
        "Targets: " + "; ".join(TARGETS.values()) + ".", "",
        "| model | backend | eager step ms | compile-only ms | subclass_ca ms | subclass_ca / compile-only | verdict "
        "| eager peak MiB | compile-only peak MiB | subclass_ca peak MiB | subclass_ca / eager peak | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ms = row["step_ms"]
        cell = lambda mode, ms=ms: f"{ms[mode]['median']:.2f} [{ms[mode]['q1']:.2f}-{ms[mode]['q3']:.2f}]"  # noqa: E731
        ratio = row["step_ratio"]
        peak = row["peak_mib"]
        mib = lambda mode, peak=peak: "n/a" if peak[mode] is None else f"{peak[mode]:.1f}"  # noqa: E731
        memory_ratio = row["memory_ratio"]
        lines.append(
            f"| {row['model']} | {row['backend']} | {cell('eager')} | {cell('compile-only')} | {cell('subclass_ca')} "
            f"| {ratio['ratio']:.3f} [{ratio['low']:.3f}-{ratio['high']:.3f}] | {row['step_verdict']} "
            f"| {mib('eager')} | {mib('compile-only')} | {mib('subclass_ca')} "
            f"| {'n/a' if memory_ratio is None else f'{memory_ratio:.3f}'} | {row['memory_verdict']} |"
        )
    lines += ["", "Step cells: median [q1-q3] over the measured rounds; ratio: median of per-round ratios [95% bootstrap "
              "interval]; verdict True = met, False = missed, or within noise. Peak: the largest growth of the resident set "
              "over one step after warm-up, max of the measured steps, one process per (model, mode)."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools optimizer-in-backward", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--backends", nargs="+", default=["inductor", "aot_eager"],
                        help="the forward's and the CA graph's backend, one table row per model and backend")
    parser.add_argument("--backend", default="inductor", help=argparse.SUPPRESS)  # the memory child's
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table (and a .json beside it) here")
    parser.add_argument("--memory-child", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.memory_child:
        model, mode = args.memory_child
        peak = step_peak_bytes(model, mode, args.backend, warmup=args.warmup, steps=args.memory_steps)
        print(json.dumps({"peak_bytes": peak}))
        return 0
    torch.set_num_threads(1)
    rows = []
    for backend in args.backends:
        for model in args.models:
            times = measure_times(model, backend, warmup=args.warmup, rounds=args.rounds)
            memory = {mode: _memory(model, mode, backend) for mode in MODES}
            rows.append(_row(model, backend, times, memory))
    command = "python -m tools optimizer-in-backward " + " ".join(argv if argv is not None else sys.argv[1:])
    text = markdown(rows, command.strip())
    print(text)
    if args.out is not None:
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Defaults follow the user (issue 61): a bare ``enable()`` on an inductor-compiled model against compile-only.

``python -m tools.bench.default_backend [--rounds N] [--out FILE]`` (from the checkout's root) times one
training step (forward, backward, gradients set to None) of 4 MLP blocks (D=256, batch 64,
``x + fc2(gelu(fc1(x)))``), its forward compiled as most people compile it, ``torch.compile(model)``
(inductor), in four modes:

* ``compile-only`` — the eager backward of the compiled forward, the baseline;
* ``enable()`` — the backward under a bare ``subclass_ca.enable()``: the CA graph follows the forward's
  backend (Note [Defaults follow the user] in ``subclass_ca/config.py``);
* ``enable(backend="inductor")`` — the backend named, for reference;
* ``enable(backend="aot_eager")`` — what a bare ``enable()`` compiled with before, for reference.

One process; each mode is warmed up (its compiles) first, then every round runs ``--steps`` steps of each
mode in rotated order and keeps each mode's median step; ratios are taken per round (Note [Verdicts on a
shared machine] in ``tools/common/stats.py``).  Target: ``enable()`` / compile-only <= 1.05.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import subclass_ca
from tools.common.report import WITHIN_NOISE
from tools.common.stats import judge, paired_ratio

__all__ = ["MODES", "TARGET", "build_parser", "main", "measure"]

TARGET = 1.05
DIM, BATCH, BLOCKS = 256, 64, 4
MODES: dict[str, Callable[[], Any]] = {
    "compile-only": contextlib.nullcontext,
    "enable()": lambda: subclass_ca.enable(),
    'enable(backend="inductor")': lambda: subclass_ca.enable(backend="inductor"),
    'enable(backend="aot_eager")': lambda: subclass_ca.enable(backend="aot_eager"),
}
"""Mode -> the context its backward runs in."""


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(DIM, 4 * DIM)
        self.fc2 = torch.nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools default-backend", description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10, help="recorded rounds; default 10")
    parser.add_argument("--steps", type=int, default=5, help="steps of each mode per round (its median is kept); default 5")
    parser.add_argument("--warmup", type=int, default=3, help="unrecorded steps of each mode first; default 3")
    parser.add_argument("--out", help="write the Markdown report to this file (else print it only)")
    return parser


def measure(rounds: int, steps: int, warmup: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Mode -> its median step (seconds) per round, and mode -> the CA graph backend its last capture reported."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block() for _ in range(BLOCKS)))
    forward = torch.compile(model)
    x = torch.randn(BATCH, DIM)

    def step(mode: str) -> float:
        start = time.perf_counter()
        loss = forward(x).sum()
        with MODES[mode]():
            loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    backends: dict[str, Any] = {}
    for mode in MODES:
        before = subclass_ca.diagnostics.capture_count()
        for _ in range(warmup):
            step(mode)
        report = subclass_ca.last_report()
        backends[mode] = report.backend if report is not None and report.capture_index >= before else None
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    order = list(MODES)
    for round_index in range(rounds):
        rotated = order[round_index % len(order):] + order[:round_index % len(order)]
        for mode in rotated:
            samples[mode].append(statistics.median(step(mode) for _ in range(steps)))
    return samples, backends


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30,
                              cwd=Path(__file__).resolve().parents[2]).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def report(samples: dict[str, list[float]], backends: dict[str, Any], argv: list[str]) -> str:
    lines = [
        "# Defaults follow the user: a bare enable() on an inductor-compiled model (issue 61)",
        "",
        f"- command: `{' '.join(['OMP_NUM_THREADS=1 python -m tools.bench.default_backend', *argv])}` (from the checkout's root)",
        f"- {datetime.date.today().isoformat()}, commit {_commit()}; torch {torch.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} logical cores, {torch.get_num_threads()} torch thread(s), CPU",
        f"- the step: {BLOCKS} MLP blocks (D={DIM}, batch {BATCH}), forward `torch.compile(model)` (inductor), "
        "`loss.backward()` in the mode's context, gradients set to None",
        "",
        "| mode | CA graph backend | median step ms | min–max ms |",
        "|---|---|---:|---:|",
    ]
    for mode, values in samples.items():
        lines.append(f"| {mode} | {backends.get(mode) or '—'} | {statistics.median(values) * 1e3:.2f} | "
                     f"{min(values) * 1e3:.2f}–{max(values) * 1e3:.2f} |")
    lines += ["", "| ratio (per round) | median [95% interval] | target | verdict |", "|---|---:|---:|---|"]
    for mode in MODES:
        if mode == "compile-only":
            continue
        interval = paired_ratio(samples[mode], samples["compile-only"])
        if interval is None:
            continue
        if mode == "enable()":
            verdict = judge(interval, TARGET)
            verdict_text = "**met**" if verdict is True else "**missed**" if verdict is False else str(WITHIN_NOISE)
            target = f"<= {TARGET:.2f}"
        else:
            verdict_text, target = "reference", "—"
        lines.append(f"| {mode} / compile-only | {interval['ratio']:.3f} [{interval['low']:.3f}–{interval['high']:.3f}] "
                     f"| {target} | {verdict_text} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    samples, backends = measure(args.rounds, args.steps, args.warmup)
    text = report(samples, backends, argv)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

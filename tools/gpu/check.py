"""``python -m tools gpu-check``: verify the library on one CUDA GPU with one prepared command.

``make gpu-check`` runs it, and on the lent GPU device ``tools/gpu/device_check.sh`` (docs/gpu.md).
Every step is a subprocess of this interpreter, run from the checkout with the checkout first on
``PYTHONPATH``: subclass_ca is imported from here and need not be installed (on the device it must
not be: building it needs setuptools from the network).  Each step has its own timeout, all share
one budget (``--budget-s``, default 360 s, so that one 15-minute device session can run the check
twice); a step that would start with less budget left than it is expected to need is recorded as
skipped for budget, never dropped.  The steps, cheapest and most important first:

1. ``wheels`` (only when ``--wheels``, default ``wheels/``, holds ``*.whl``: optional extras such as
   torchao, carried as wheels, ``make gpu-wheels``): installed offline (``pip install --no-index
   --target``) into ``--site`` (default ``build/gpu-check-site``), which every later step has on
   ``PYTHONPATH``.  Without them the tests that need torchao skip and the bench skips its NF4 row;
2. ``env``: torch, CUDA, the device, its capability and memory, ``nvidia-smi`` -> ``env.json``;
3. ``pytest-cuda``: every ``-m "cuda and not inductor"`` test (the ``device`` fixture's CUDA
   param, tests/conftest.py) -> ``junit-cuda.xml``;
4. ``pytest-cuda-inductor``: the ``-m "cuda and inductor"`` tests -> ``junit-cuda-inductor.xml``;
5. ``demo``: ``python -m tools demo --device cuda --quick``;
6. ``bench``: the bench's transformer-block rows on CUDA (eager / compile / stock CA / subclass_ca, inductor);
7. ``fsdp2``: FSDP2 on one GPU (NCCL, world 1), TwoTensor weights, bitwise against eager FSDP2;
8. ``fsdp2-profile``: the CUDA profile of one FSDP2 backward, eager vs subclass_ca: where the
   reduce-scatters run and how much of their kernels overlaps compute;
9. ``warm-start`` and ``torchao-check`` (extra steps: a second device call, ``--steps
   warm-start,torchao-check``, since the budget holds the others): the warm-start bench's TwoTensor MLP
   row on CUDA (first step of a fresh process, cold and restarted after ``save_cache()``, compile-only
   vs subclass_ca, with where it goes), and ``python -m subclass_ca check`` on torchao's training
   subclasses, CUDA and inductor, beside stock compiled autograd.

Before any step but ``wheels`` and ``env`` the interpreter must have a torch subclass_ca supports
(:mod:`subclass_ca._compat.version`: 2.11 or newer; the device's 2.11.0+cu130 is), CUDA and pytest;
otherwise the check stops at once and says what it found and how to provide it.  Everything goes
into ``--out`` (default ``gpu-check-out/``; on the device ``$OUT``), seven files at most (the lent
device returns eight): ``gpu_check.json`` (every step: command, rc, wall seconds, status, reason,
figures), ``summary.md`` (committable as ``benchmarks/GPU.md``), ``gpu_check.log`` (every step's
output, in order), ``env.json``, the two JUnit files and ``artifacts.tar.gz`` (what demo, bench and
the FSDP2 steps wrote).  Exit status: 0 when no step failed, 1 when one failed or timed out, 2 when
the interpreter was refused.

``--dry-run`` needs no CUDA and takes seconds: with the same arguments as the real run it builds
the plan, installs the carried wheels (offline) as the real run would, parses every step's
arguments with that command's own parser, collects each pytest step's tests (``--collect-only``;
none, or none from an expected file, is a failure), checks the torch-range logic and prints the plan.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import xml.etree.ElementTree as ElementTree
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from subclass_ca._compat import version as torch_version
from subclass_ca.errors import UnsupportedTorchError
from subclass_ca.testing.torchao_specs import TORCHAO_SPEC_NAMES
from tools import ROOT, checkout_env

__all__ = [
    "STATUSES", "Refused", "Step", "Outcome", "check_torch", "preflight", "wheel_files", "plan", "check_step",
    "dry_run", "run_steps", "run_check", "summary_markdown", "environment", "write_environment", "build_parser", "main",
]

COMMAND = "python -m tools gpu-check"
DEFAULT_BUDGET_S = 360.0
RESERVE_S = 15.0
"""Of the budget, what no step may use: stopping a step that runs out and writing the reports."""
DEFAULT_OUT = "gpu-check-out"
DEFAULT_WHEELS = "wheels"
"""Where ``make gpu-wheels`` puts the optional extras' wheels (ignored by git; carried to the device)."""
DEFAULT_SITE = "build/gpu-check-site"
"""Where the ``wheels`` step installs them (under the checkout, never under ``--out``: the device returns 8 files)."""
STATUSES: tuple[str, ...] = ("passed", "failed", "timed-out", "skipped")
REPORT_FILES: tuple[str, ...] = ("gpu_check.json", "summary.md", "gpu_check.log")
ARTIFACTS = "artifacts.tar.gz"
WORK = "work"
"""Subfolder of the outputs that demo, bench and the FSDP2 steps write into; packed into ``ARTIFACTS``."""
PYTEST_WORKERS = 4
"""pytest-xdist workers of the pytest steps (where xdist is installed): inductor compiles in parallel."""


# --- the interpreter ---------------------------------------------------------------


class Refused(RuntimeError):
    """This interpreter cannot run the check (a torch subclass_ca does not support, no CUDA, no pytest); the message says what to provide."""


def check_torch(version: str, *, python: str = sys.executable) -> str:
    """Raise :class:`Refused` for a torch subclass_ca does not support (``subclass_ca._compat.version``).

    Returns a note: ``""`` for a tested release, else that it is untested (it runs, as ``enable()`` does).
    """
    try:
        torch_version.require_minimum(version)
    except (UnsupportedTorchError, ValueError):
        raise Refused(
            f"{python} has torch {version}, which subclass_ca does not support (torch{torch_version.SUPPORTED_TORCH}; "
            f"tested: {', '.join(torch_version.TESTED_TORCH)}): every CUDA test would fail, so none is run. Provide an "
            f"interpreter with a CUDA build of torch {torch_version.TESTED_TORCH[0]} or newer: "
            "`make gpu-check GPU_PYTHON=/path/to/python` uses one (the lent device's python3 has 2.11.0+cu130), "
            "`make gpu-check` makes .venv-cuda from the public package index (needs network)."
        ) from None
    if torch_version.is_tested(version):
        return ""
    return f"torch {version} is untested (tested: {', '.join(torch_version.TESTED_TORCH)}); the check runs"


def preflight() -> str:
    """Raise :class:`Refused` unless this interpreter can run the steps: a supported torch, CUDA, pytest; return check_torch's note."""
    import torch

    note = check_torch(torch.__version__)
    if not torch.cuda.is_available():
        raise Refused(
            f"{sys.executable} has torch {torch.__version__} (CUDA {torch.version.cuda}) but torch.cuda.is_available() is "
            "False: run this on a machine with an NVIDIA GPU and a CUDA build of torch, or pass --dry-run to check "
            "the script itself without one."
        )
    if importlib.util.find_spec("pytest") is None:
        raise Refused(f"{sys.executable} has no pytest: install the test extra there (pip install pytest pytest-timeout hypothesis).")
    return note


# --- the plan ------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Step:
    """One subprocess of the check: ``python *argv`` from the checkout, bounded by ``timeout_s``."""

    name: str
    what: str
    """One line: what the step verifies."""
    argv: tuple[str, ...]
    """After the interpreter: ``("-m", "tools", COMMAND, ...)``, ``("-m", "pytest", ...)``, ``("-m", "pip", "install", ...)``
    or ``("-c", CODE)``."""
    expect_s: float
    """What it is expected to take on one H200-class GPU (an estimate until a GPU run measures it); it starts
    only with at least this much budget left."""
    timeout_s: float
    expect_tests: tuple[str, ...] = ()
    """pytest steps: test files that must each contribute at least one collected test (checked by --dry-run)."""
    figures: Callable[[], dict[str, Any]] | None = None
    """Reads the step's key figures from what it wrote (after it ran, passed or not)."""

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[a-z0-9][a-z0-9-]*", self.name):
            raise ValueError(f"Step.name must be lower-case letters, digits and '-', got {self.name!r}")
        if not self.argv or not all(isinstance(a, str) for a in self.argv):
            raise ValueError(f"Step {self.name}: argv must be a non-empty tuple of strings, got {self.argv!r}")
        if not 0 < self.expect_s <= self.timeout_s:
            raise ValueError(f"Step {self.name}: need 0 < expect_s <= timeout_s, got {self.expect_s} and {self.timeout_s}")

    def command(self, python: str) -> list[str]:
        return [python, *self.argv]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outcome:
    """What one step did."""

    step: str
    command: str
    status: str
    rc: int | None = None
    wall_s: float = 0.0
    reason: str = ""
    figures: dict[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"Outcome {self.step}: status {self.status!r}, allowed values are {STATUSES}")


def wheel_files(folder: Path | None) -> tuple[Path, ...]:
    """The ``*.whl`` in ``folder`` (absolute, sorted); none when it is missing."""
    if folder is None:
        return ()
    folder = folder if folder.is_absolute() else ROOT / folder
    return tuple(sorted(path.resolve() for path in folder.glob("*.whl"))) if folder.is_dir() else ()


def _pytest(marker: str, junit: Path) -> tuple[str, ...]:
    workers = ("-n", str(PYTEST_WORKERS), "--dist", "worksteal") if importlib.util.find_spec("xdist") else ()
    return ("-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", *workers, "-m", marker, f"--junitxml={junit}", "tests")


def plan(out: Path, *, wheels: Path | None = None, site: Path | None = None, extra: bool = False) -> tuple[Step, ...]:
    """The steps, in order, writing under ``out`` (absolute paths: the steps run from the checkout).

    ``extra``: also the steps that do not fit the default budget beside the others (``torchao-check``); they
    run in a second device call that names them (``--steps warm-start,torchao-check``).

    ``wheels``: a folder of wheels to install into ``site`` first (default ``build/gpu-check-site``); no step
    for it when it holds none.
    """
    out, work = out.resolve(), out.resolve() / WORK
    site = (site if site is not None else ROOT / DEFAULT_SITE).resolve()
    carried = wheel_files(wheels)
    torchao = importlib.util.find_spec("torchao") is not None or any(w.name.startswith("torchao-") for w in carried)
    # torchtitan trains on CUDA only: its debug model, stock against subclass_ca's Trainer, where it is installed
    torchtitan = importlib.util.find_spec("torchtitan") is not None
    tools = ("-m", "tools")
    steps: list[Step] = []
    if carried:
        steps.append(Step(
            name="wheels", what=f"install the carried wheels offline ({', '.join(_wheel_name(w) for w in carried)}) for the "
            "later steps", expect_s=10, timeout_s=60,
            argv=("-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--no-cache-dir",
                  "--disable-pip-version-check", "--upgrade", "--target", str(site), *map(str, carried)),
            figures=lambda: _site_figures(site)))
    steps += [
        Step(name="env", what="torch, CUDA, device, capability, memory, nvidia-smi, subclass_ca, torchao -> env.json",
             expect_s=10, timeout_s=40,
             argv=("-c", f"from tools.gpu.check import write_environment; write_environment({json.dumps(str(out / 'env.json'))})"),
             figures=lambda: _env_figures(out / "env.json")),
        Step(name="pytest-cuda", what="the CUDA tests without inductor (capture, accumulation, hooks, train step, "
             "registry, NF4, DTensor world 1, memory, demo, optimizer-in-backward; torchtitan's debug model where torchtitan "
             "is installed)", expect_s=50, timeout_s=120,
             argv=_pytest("cuda and not inductor", out / "junit-cuda.xml"),
             expect_tests=("tests/test_capture.py", "tests/test_accumulate.py", "tests/test_registry.py",
                           "tests/regressions/test_beyond_stock_hook_intermediate.py",
                           "tests/regressions/test_compiled_train_step.py", "tests/handlers/test_dtensor.py",
                           "tests/test_optimizer_in_backward.py",
                           *(("tests/handlers/test_torchao.py",) if torchao else ()),
                           *(("tests/integrations/test_torchtitan.py",) if torchtitan else ())),
             figures=lambda: _junit_figures(out / "junit-cuda.xml")),
        Step(name="pytest-cuda-inductor", what="the CUDA tests on inductor (capture, hooks, handler modes, optimizer-in-backward)",
             expect_s=70, timeout_s=150, argv=_pytest("cuda and inductor", out / "junit-cuda-inductor.xml"),
             expect_tests=("tests/test_capture.py", "tests/test_modes.py",
                           "tests/regressions/test_beyond_stock_hook_intermediate.py", "tests/test_optimizer_in_backward.py"),
             figures=lambda: _junit_figures(out / "junit-cuda-inductor.xml")),
        Step(name="demo", what="the demo's models in four modes on CUDA (inductor), subclass_ca vs eager",
             expect_s=50, timeout_s=120,
             argv=(*tools, "demo", "--device", "cuda", "--quick", "--no-progress", "--out", str(work / "demo")),
             figures=lambda: _demo_figures(work / "demo" / "results.json")),
        Step(name="bench", what="the TwoTensor transformer-block rows on CUDA: eager / compile / stock CA / subclass_ca, "
             "inductor, and subclass_ca with the CA graph as a CUDA graph (mode='reduce-overhead'); NF4 on CUDA is in "
             "pytest-cuda", expect_s=60, timeout_s=150,
             argv=(*tools, "bench", "--device", "cuda", "--models", "block_pair",
                   "--realistic-sizes", "medium", "--backends", "inductor", "--strict-backends", "--realistic-reps", "3",
                   "--realistic-block", "3", "--realistic-cold-reps", "1", "--warmup", "1", "--recaptures", "0",
                   "--soak-steps", "0", "--no-plot", "--no-progress", "--out-dir", str(work / "bench")),
             figures=lambda: _bench_figures(work / "bench" / "results.json")),
        Step(name="depth", what="the depth sweep's L = 32 row on CUDA (32 TwoTensor-LoRA blocks, each compiled on its own, "
             "inductor): cold first step and steady step, compile-only vs subclass_ca's regional pieces, gradients vs eager",
             expect_s=45, timeout_s=150,
             argv=(*tools, "depth", "--device", "cuda", "--depths", "32", "--models", "two_tensor_lora", "--modes",
                   "compile", "subclass_ca", "--target-reps", "1", "--whole-depth", "0", "--steady", "5",
                   "--json", str(work / "depth.json")),
             figures=lambda: _depth_figures(work / "depth.json")),
        Step(name="fsdp2", what="FSDP2 on one GPU (NCCL, world 1), TwoTensor weights, each mode bitwise vs eager FSDP2",
             expect_s=25, timeout_s=90,
             argv=(*tools, "fsdp2", "--nproc", "1", "--device", "cuda", "--params", "two_tensor",
                   "--fsdp2-modes", "eager,compile,subclass_ca", "--fsdp2-steps", "3", "--timeout", "85",
                   "--json", str(work / "fsdp2.json")),
             figures=lambda: _fsdp2_figures(work / "fsdp2.json")),
        Step(name="fsdp2-profile", what="CUDA profile of one FSDP2 backward (2 TwoTensor blocks): reduce-scatter "
             "placement and kernel overlap, eager vs subclass_ca", expect_s=25, timeout_s=90,
             argv=(*tools, "fsdp2-profile", "--nproc", "1", "--device", "cuda", "--model", "block_two_tensor",
                   "--steps", "3", "--timeout", "85", "--trace-dir", str(work / "traces"),
                   "--json", str(work / "fsdp2_profile.json")),
             figures=lambda: _profile_figures(work / "fsdp2_profile.json")),
    ]
    if extra:
        steps += [
            Step(name="warm-start", what="the warm-start bench's TwoTensor MLP row on CUDA (inductor): the first step of a "
                 "fresh process, cold and restarted after save_cache(), compile-only vs subclass_ca, and where it goes",
                 expect_s=100, timeout_s=240,
                 argv=(*tools, "warm-start", "--device", "cuda", "--models", "pair", "--modes", "compile",
                       "subclass_ca_saved", "--warm-reps", "2", "--json", str(work / "warm_start.json")),
                 figures=lambda: _warm_start_figures(work / "warm_start.json")),
            Step(name="torchao-check", what="python -m subclass_ca check on torchao's training subclasses, CUDA and inductor, "
                 "each cell beside stock compiled autograd (docs/torchao.md)", expect_s=60, timeout_s=150,
                 argv=("-m", "subclass_ca", "check", "--subclass", TORCHAO_ROWS, "--device", "cuda", "--backend", "inductor",
                       "--compare-stock", "--no-progress", "--json", str(work / "torchao.json")),
                 figures=lambda: _torchao_figures(work / "torchao.json")),
        ]
    return tuple(steps)


def _wheel_name(path: Path) -> str:
    """``torchao-0.18.0-cp39-abi3-manylinux_2_28_x86_64.whl`` -> ``torchao 0.18.0``."""
    name, version = path.name.split("-")[:2]
    return f"{name} {version}"


# --- key figures (read from what each step wrote) -----------------------------------------


def _env_figures(path: Path) -> dict[str, Any]:
    env = json.loads(path.read_text())
    keys = ("device", "capability", "memory_gib", "torch", "torch_cuda", "torchao")
    return {key: env[key] for key in keys if env.get(key) is not None}


def _site_figures(site: Path) -> dict[str, Any]:
    installed = sorted(path.name.removesuffix(".dist-info").replace("-", " ") for path in site.glob("*.dist-info"))
    return {"installed": ", ".join(installed) or "nothing"}


def _junit_figures(path: Path) -> dict[str, Any]:
    root = ElementTree.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    count = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
    failed = count["failures"] + count["errors"]
    return {"passed": count["tests"] - failed - count["skipped"], "failed": failed, "skipped": count["skipped"]}


def _demo_figures(path: Path) -> dict[str, Any]:
    results = json.loads(path.read_text())
    figures: dict[str, Any] = {"matches eager": results["ok"]}
    for model, entry in results["models"].items():
        ours = entry["modes"].get("subclass_ca", {})
        if ours.get("speedup_vs_eager"):
            figures[model] = f"subclass_ca {ours['speedup_vs_eager']:.2f}x eager"
    return figures


def _bench_figures(path: Path) -> dict[str, Any]:
    rows: dict[str, dict[str, float]] = {}
    for row in json.loads(path.read_text())["rows"]:
        rows.setdefault(f"{row['model']}/{row['size']} ms", {})[row["mode"]] = row["median"]
    return {label: " / ".join(f"{mode} {ms:.2f}" for mode, ms in modes.items()) for label, modes in rows.items()}


def _depth_figures(path: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for row in json.loads(path.read_text())["rows"]:
        if row.get("mode") == "subclass_ca" and row.get("cold_ratio"):
            cold, steady = row["cold_ratio"][0], row["steady_ratio"][0]
            figures[f"{row['model']} L={row['depth']}"] = (f"cold {cold:.2f}x, steady {steady:.2f}x compile-only, "
                                                          f"max abs diff {row['max_abs_diff']:.1e}")
        elif "error" in row:
            figures[f"{row.get('model')} L={row.get('depth')}"] = str(row["error"])[:80]
    return figures


def _fsdp2_figures(path: Path) -> dict[str, Any]:
    summary = json.loads(path.read_text())
    figures: dict[str, Any] = {"ok": summary["ok"]}
    for mode, entry in summary["modes"].items():
        if "error" in entry:
            figures[mode] = entry["error"][:80]
        else:
            same = {True: "bitwise = eager FSDP2", False: "differs from eager FSDP2", None: ""}[entry["bitwise_equal_to_eager"]]
            figures[mode] = f"{entry['median_step_ms']:.2f} ms/step {same}".strip()
    return figures


TORCHAO_ROWS = ",".join(TORCHAO_SPEC_NAMES)
"""The torchao rows of ``check``, as the kit names them (the Makefile's torchao-matrix names the same, tested)."""


def _warm_start_figures(path: Path) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    for row in json.loads(path.read_text())["rows"]:
        name = f"{row['model']}/{row['mode']}"
        if row["errors"]:
            figures[name] = str(row["errors"][0])[:80]
        else:
            figures[name] = (f"cold {row['cold_first_step_s']:.2f} s, restarted {row['warm_first_step_s']:.2f} s "
                             f"(backward {row['warm_backward_s']:.3f} s), warm = cold bitwise: {row['bitwise']}")
    return figures


def _torchao_figures(path: Path) -> dict[str, Any]:
    report = json.loads(path.read_text())
    results = report["results"]
    return {"cells": report["summary"],
            "beyond stock": sum(r["status"] == "pass" and r.get("stock_status") == "fail" for r in results),
            "behind stock": sum(r.get("stock_status") == "pass" and r["status"] != "pass" for r in results)}


def _profile_figures(path: Path) -> dict[str, Any]:
    summary = json.loads(path.read_text())
    figures: dict[str, Any] = {"same schedule": summary["same_schedule"]}
    for mode, schedule in summary["modes"].items():
        overlap = (schedule.get("gpu") or {}).get("rs_overlap_fraction")
        figures[mode] = f"backward {schedule['backward_us'] / 1e3:.2f} ms" + (
            "" if overlap is None else f", reduce-scatter kernels {overlap:.0%} overlapped")
    return figures


# --- the dry run ---------------------------------------------------------------------


def _demo_args(args: list[str]) -> None:
    from tools.demo import main as demo

    demo.build_parser().parse_args(args)


def _bench_args(args: list[str]) -> None:
    from tools.bench import main as bench

    bench.settings_from_args(args)


def _depth_args(args: list[str]) -> None:
    from tools.bench import depth as bench_depth

    bench_depth.settings_from_args(args)


def _warm_start_args(args: list[str]) -> None:
    from tools.bench import warm_start

    warm_start.settings_from_args(args)


def _fsdp2_args(args: list[str]) -> None:
    from tools.fsdp2 import parity as fsdp2_parity

    namespace = fsdp2_parity.build_parser().parse_args(args)
    fsdp2_parity.run_config(namespace, backend=namespace.backend)


def _profile_args(args: list[str]) -> None:
    from tools.fsdp2 import profiling as fsdp2_profile

    fsdp2_profile.run_config(fsdp2_profile.build_parser().parse_args(args))


VALIDATORS: dict[str, Callable[[list[str]], None]] = {
    "demo": _demo_args, "bench": _bench_args, "depth": _depth_args, "fsdp2": _fsdp2_args, "fsdp2-profile": _profile_args,
    "warm-start": _warm_start_args,
}
"""Command of ``python -m tools`` -> parses (and validates, without running) its arguments with that command's own parser."""


def _parses(step: Step) -> tuple[str, list[str]]:
    command, args = step.argv[2], list(step.argv[3:])
    if command not in VALIDATORS:
        return "", [f"step {step.name}: no argument check for command {command!r} (known: {sorted(VALIDATORS)})"]
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            VALIDATORS[command](args)
    except SystemExit:
        lines = [line for line in captured.getvalue().splitlines() if line.strip()]
        return "", [f"step {step.name}: `python -m tools {command}` rejects its arguments: "
                    f"{lines[-1] if lines else 'argparse exited'}"]
    except ValueError as error:
        return "", [f"step {step.name}: `python -m tools {command}` rejects its arguments: {error}"]
    return f"arguments parse with `{command}`'s own parser", []


def _site_of(steps: Sequence[Step]) -> Path | None:
    """Where the ``wheels`` step installs (its ``--target``); None without one."""
    for step in steps:
        if step.name == "wheels" and "--target" in step.argv:
            return Path(step.argv[step.argv.index("--target") + 1])
    return None


def step_env(site: Path | None = None) -> dict[str, str]:
    """The environment of every step: the checkout (and the wheels' ``site``) first on ``PYTHONPATH``, unbuffered output."""
    return checkout_env({**os.environ, "PYTHONUNBUFFERED": "1"}, extra_paths=[site] if site else [])


def _installs(step: Step, python: str) -> tuple[str, list[str]]:
    """The wheels step, run: each wheel must be a wheel (a zip with a ``.dist-info/WHEEL``) and install offline."""
    wheels = [Path(a) for a in step.argv if a.endswith(".whl")]
    problems = []
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                if not any(name.endswith(".dist-info/WHEEL") for name in archive.namelist()):
                    problems.append(f"step {step.name}: {wheel.name} has no .dist-info/WHEEL: not a wheel")
        except (OSError, zipfile.BadZipFile) as error:
            problems.append(f"step {step.name}: {wheel.name} is not a readable wheel ({error})")
    if problems:
        return "", problems
    try:
        done = subprocess.run(step.command(python), cwd=ROOT, capture_output=True, text=True, timeout=step.timeout_s,
                              env=step_env())
    except subprocess.TimeoutExpired:
        return "", [f"step {step.name}: pip took over {step.timeout_s:.0f} s"]
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or done.stdout.strip().splitlines() or ["no output"])[-1]
        return "", [f"step {step.name}: pip install (offline) exited {done.returncode}: {tail}"]
    return f"installed offline: {', '.join(_wheel_name(w) for w in wheels)}", []


def _collects(step: Step, python: str, env: dict[str, str]) -> tuple[str, list[str]]:
    argv = [python, *(a for a in step.argv if not a.startswith("--junitxml")), "--collect-only"]
    missing = [f"step {step.name}: expected test file {path} is missing" for path in step.expect_tests if not (ROOT / path).is_file()]
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        return "", [*missing, f"step {step.name}: pytest --collect-only took over 120 s"]
    collected = [line.split("::")[0] for line in done.stdout.splitlines() if "::" in line]
    problems = list(missing)
    if done.returncode != 0 or not collected:
        tail = (done.stdout.strip().splitlines() or done.stderr.strip().splitlines() or ["no output"])[-1]
        problems.append(f"step {step.name}: pytest --collect-only collected {len(collected)} tests (exit {done.returncode}): {tail}")
    problems += [f"step {step.name}: no test collected from {path} (its CUDA params or marks are gone?)"
                 for path in step.expect_tests if (ROOT / path).is_file() and path not in collected]
    return f"{len(collected)} tests collected from {len(set(collected))} files", problems


def check_step(step: Step, python: str = sys.executable, *, env: dict[str, str] | None = None) -> tuple[str, list[str]]:
    """What --dry-run checked of ``step`` (one line) and the problems found (empty: none).

    The wheels step is run (offline, seconds), so that the pytest steps are collected with what it installs.
    """
    if step.argv[:2] == ("-m", "tools") and len(step.argv) > 2:
        return _parses(step)
    if step.argv[:2] == ("-m", "pytest"):
        return _collects(step, python, step_env() if env is None else env)
    if step.argv[:3] == ("-m", "subclass_ca", "check"):
        from subclass_ca.testing import _cli

        try:
            with contextlib.redirect_stderr(io.StringIO()):
                _cli._parser().parse_args(list(step.argv[3:]))
        except SystemExit:
            return "", [f"step {step.name}: `python -m subclass_ca check` rejects its arguments {list(step.argv[3:])}"]
        return "python -m subclass_ca check parses its arguments", []
    if step.argv[:3] == ("-m", "pip", "install"):
        return _installs(step, python)
    if step.argv[0] == "-c":
        try:
            compile(step.argv[1], step.name, "exec")
        except (SyntaxError, IndexError) as error:
            return "", [f"step {step.name}: its python -c code does not compile: {error}"]
        return "its code compiles", []
    return "", [f"step {step.name}: nothing to check it with (argv {step.argv[:2]!r})"]


def _torch_logic_problems() -> tuple[str, list[str]]:
    """The torch check against known answers: what a real run's up-front refusal relies on."""
    admitted = ("2.11.0+cu130", "2.12.1", "2.13.0", "2.15.0+cu128", "2.16.0.dev20260101+cu130")
    refused = ("2.10.0+cu128", "2.9.1", "1.13.1", "not-a-version")
    supported = torch_version.SUPPORTED_TORCH
    problems = []
    for version in admitted:
        try:
            check_torch(version)
        except Refused:
            problems.append(f"torch check: {version} refused, but subclass_ca supports torch{supported}")
    for version in refused:
        try:
            check_torch(version)
        except Refused as error:
            if version not in str(error) or supported not in str(error) or "GPU_PYTHON" not in str(error):
                problems.append(f"torch check: the refusal of {version} does not name the torch, the range and GPU_PYTHON")
        else:
            problems.append(f"torch check: {version} admitted, but subclass_ca supports torch{supported}")
    return f"torch{supported} admits {', '.join(admitted)}; refuses {', '.join(refused)}", problems


def dry_run(steps: Sequence[Step], *, budget_s: float = DEFAULT_BUDGET_S, python: str = sys.executable,
            echo: Callable[[str], None] = print) -> list[str]:
    """Check the plan without CUDA: every step, the budget and the torch check; print a line each; return the problems."""
    problems: list[str] = []
    env = step_env(_site_of(steps))
    checks = [(step.name, *check_step(step, python, env=env)) for step in steps]
    checks.append(("torch check", *_torch_logic_problems()))
    expected, usable = sum(step.expect_s for step in steps), budget_s - RESERVE_S
    over = [f"budget: the steps are expected to need {expected:.0f} s, more than the {usable:.0f} s that --budget-s "
            f"{budget_s:.0f} leaves them ({RESERVE_S:.0f} s are kept for stopping a step and the reports)"]
    checks.append(("budget", f"the steps are expected to need {expected:.0f} s of {usable:.0f} s", over if expected > usable else []))
    if not any(step.name == "wheels" for step in steps):
        checks.append(("wheels", "none carried: the tests that need torchao skip (make gpu-wheels, docs/gpu.md)", []))
    for name, checked, found in checks:
        echo(f"  {'ok  ' if not found else 'FAIL'} {name}: {checked or 'not checked'}")
        for problem in found:
            echo(f"       {problem}")
        problems += found
    import torch

    try:
        verdict = check_torch(torch.__version__) or "supported"
    except Refused:
        verdict = "NOT supported: a real run would stop here"
    cuda = "CUDA available" if torch.cuda.is_available() else "no CUDA: a real run would stop before the tests"
    echo(f"  this interpreter: {sys.executable}, torch {torch.__version__} ({verdict}), {cuda}")
    return problems


# --- running -------------------------------------------------------------------------------


def _stop(process: subprocess.Popen) -> None:
    """End the step's whole process group (launched ranks, compile workers), politely first."""
    for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
            return


def _run_one(step: Step, *, python: str, timeout_s: float, log: Path, clock: Callable[[], float], env: dict[str, str]) -> Outcome:
    command = step.command(python)
    with log.open("a") as handle:
        handle.write(f"\n===== {step.name}: {shlex.join(command)}  (timeout {timeout_s:.0f} s)\n")
        handle.flush()
        start = clock()
        try:
            process = subprocess.Popen(command, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT, start_new_session=True,
                                       env=env)
        except OSError as error:
            return Outcome(step=step.name, command=shlex.join(command), status="failed", reason=f"could not start: {error}")
        try:
            rc: int | None = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _stop(process)
            rc = None
        wall = clock() - start
        handle.write(f"===== {step.name}: {'timed out' if rc is None else f'exit {rc}'} after {wall:.1f} s\n")
    status = "timed-out" if rc is None else "passed" if rc == 0 else "failed"
    reason = f"stopped after {timeout_s:.0f} s" if rc is None else "" if rc == 0 else f"exit status {rc} (see gpu_check.log)"
    figures: dict[str, Any] = {}
    if step.figures is not None:
        try:
            figures = step.figures()
        except Exception as error:  # noqa: BLE001 - a missing figure is a note, the status stands
            figures = {"figures": f"not read ({type(error).__name__}: {error})"[:160]}
    return Outcome(step=step.name, command=shlex.join(command), status=status, rc=rc, wall_s=round(wall, 1),
                   reason=reason, figures=figures)


def run_steps(steps: Sequence[Step], *, python: str, log: Path, budget_s: float, spent_s: float = 0.0,
              reserve_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
              echo: Callable[[str], None] = print) -> list[Outcome]:
    """Run ``steps`` in order under one budget (``spent_s`` of it already gone, its last ``reserve_s`` kept for
    the caller); a step that would start with less than its ``expect_s`` left is skipped for budget, and runs at
    most until the steps' share of the budget ends.  Every step gets :func:`step_env` (with the wheels' site)."""
    deadline = clock() + budget_s - spent_s - reserve_s
    env = step_env(_site_of(steps))
    outcomes = []
    for index, step in enumerate(steps, 1):
        left = deadline - clock()
        if left < step.expect_s:
            kept = f" (and {reserve_s:.0f} s kept for the reports)" if reserve_s else ""
            reason = f"budget: {max(left, 0):.0f} s of {budget_s:.0f} s left{kept}, it is expected to need {step.expect_s:.0f} s"
            outcomes.append(Outcome(step=step.name, command=shlex.join(step.command(python)), status="skipped", reason=reason))
        else:
            echo(f"gpu-check [{index}/{len(steps)}] {step.name}: {step.what}")
            outcomes.append(_run_one(step, python=python, timeout_s=min(step.timeout_s, left), log=log, clock=clock, env=env))
        echo(f"gpu-check [{index}/{len(steps)}] {_screen_line(dataclasses.asdict(outcomes[-1]))}")
    return outcomes


# --- reports ---------------------------------------------------------------------------------


def _figure_text(figures: dict[str, Any]) -> str:
    return "; ".join(f"{key} {f'{value:g}' if isinstance(value, float) else value}" for key, value in figures.items())


def _detail(outcome: dict[str, Any]) -> str:
    return "; ".join(part for part in (outcome["reason"], _figure_text(outcome["figures"])) if part)


def _screen_line(outcome: dict[str, Any]) -> str:
    return f"{outcome['step']:21s} {outcome['status']:9s} {outcome['wall_s']:6.1f} s  {_detail(outcome)}"[:160]


def summary_markdown(record: dict[str, Any]) -> str:
    """The short markdown summary (``summary.md``; commit it as ``benchmarks/GPU.md``)."""
    env = record.get("env") or {}
    where = (f"{env['device']} (capability {env.get('capability', '?')}, {env.get('memory_gib', '?')} GiB)"
             if env.get("device") else "a machine without a CUDA device")
    lines = [
        "# GPU check",
        "",
        f"`{record['command']}` on {where}, torch {env.get('torch', record['torch'])} (CUDA {env.get('torch_cuda') or 'none'}), "
        f"Python {env.get('python', '?')}, {record['date']}: **{record['status']}**"
        + (f" ({record['reason']})" if record["reason"] else "") + f"; {record['wall_s']:.0f} s of a {record['budget_s']:.0f} s budget.",
        *([f"torchao: {env['torchao']}." if env.get("torchao") else "torchao: not installed (its tests skipped).",
           ] if env else []),
        *([record["note"] + "."] if record.get("note") else []),
        "",
        "| step | verdict | wall s | figures |",
        "|---|---|---:|---|",
    ]
    for outcome in record["steps"]:
        lines.append(f"| {outcome['step']} | {outcome['status']} | {outcome['wall_s']:.1f} | {_detail(outcome).replace('|', '/')} |")
    lines += ["", "Commands (from the checkout; every step's output is in `gpu_check.log`):", ""]
    lines += [f"* {outcome['step']}: `{outcome['command']}`" for outcome in record["steps"]]
    return "\n".join(lines) + "\n"


def _pack(work: Path, archive: Path) -> None:
    if work.is_dir() and any(work.iterdir()):
        with tarfile.open(archive, "w:gz") as tar:
            tar.add(work, arcname=WORK)
    shutil.rmtree(work, ignore_errors=True)


def run_check(steps: Sequence[Step], *, out: Path, python: str = sys.executable, budget_s: float = DEFAULT_BUDGET_S,
              spent_s: float = 0.0, refused: str = "", note: str = "", command: str = COMMAND,
              echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the steps (only ``env`` when ``refused`` says why not), write the reports into ``out``; return the record.

    The steps get the budget less :data:`RESERVE_S`, kept for stopping the last one and writing the reports;
    ``note`` (e.g. an untested torch) goes into the record and the summary.
    """
    import torch

    start = time.monotonic()
    out.mkdir(parents=True, exist_ok=True)
    for path in (*(out / name for name in (*REPORT_FILES, ARTIFACTS, "env.json")), *out.glob("junit-*.xml")):
        path.unlink(missing_ok=True)  # ours from an earlier run; nothing else in ``out`` is touched (it may be the device's $OUT)
    shutil.rmtree(out / WORK, ignore_errors=True)
    log = out / "gpu_check.log"
    log.write_text(f"{command}: refused: {refused}\n" if refused else "")
    runnable = [step for step in steps if not refused or step.name == "env"]
    outcomes = {o.step: o for o in run_steps(runnable, python=python, log=log, budget_s=budget_s, spent_s=spent_s,
                                             reserve_s=min(RESERVE_S, budget_s / 4), echo=echo)}
    for step in steps:
        outcomes.setdefault(step.name, Outcome(step=step.name, command=shlex.join(step.command(python)), status="skipped",
                                               reason="not run: the interpreter was refused (see the summary)"))
    _pack(out / WORK, out / ARTIFACTS)
    ordered = [outcomes[step.name] for step in steps]
    failed = [o.step for o in ordered if o.status in ("failed", "timed-out")]
    env_path = out / "env.json"
    record = {
        "command": command,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "python": python,
        "torch": torch.__version__,
        "supported_torch": torch_version.SUPPORTED_TORCH,
        "note": note,
        "status": "refused" if refused else "failed" if failed else "passed",
        "reason": refused or (f"failed: {', '.join(failed)}" if failed else ""),
        "budget_s": budget_s,
        "wall_s": round(spent_s + time.monotonic() - start, 1),
        "env": json.loads(env_path.read_text()) if env_path.is_file() else None,
        "steps": [{**dataclasses.asdict(o), "what": s.what, "timeout_s": s.timeout_s} for o, s in zip(ordered, steps)],
    }
    (out / "gpu_check.json").write_text(json.dumps(record, indent=2) + "\n")
    (out / "summary.md").write_text(summary_markdown(record))
    record["files"] = sorted(path.name for path in out.iterdir() if path.is_file())
    return record


# --- the environment step -------------------------------------------------------------------


def environment() -> dict[str, Any]:
    """What this interpreter's torch sees: versions, CUDA, the device and ``nvidia-smi``'s report (works without CUDA)."""
    import platform

    import torch

    env: dict[str, Any] = {
        "python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available(),
        "subclass_ca": _origin("subclass_ca"), "torchao": _torchao_version(),
    }
    if env["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        env.update(device=props.name, device_count=torch.cuda.device_count(),
                   capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                   memory_gib=round(props.total_memory / 2**30, 1),
                   nccl=".".join(map(str, torch.cuda.nccl.version())) if torch.distributed.is_nccl_available() else None)
    smi = shutil.which("nvidia-smi")
    env["nvidia_smi"] = None
    if smi:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            env["nvidia_smi"] = subprocess.run([smi], capture_output=True, text=True, timeout=30).stdout
    return env


def _origin(module: str) -> str | None:
    """Where ``module`` is imported from (the checkout's subclass_ca, not an installed copy, is what the steps test)."""
    spec = importlib.util.find_spec(module)
    return None if spec is None or not spec.origin else str(Path(spec.origin).parent)


def _torchao_version() -> str | None:
    try:
        import torchao
    except Exception:  # noqa: BLE001 - absent or broken: the torchao tests skip, the summary says which
        return None
    return str(getattr(torchao, "__version__", "?"))


def write_environment(path: str) -> None:
    """The ``env`` step: :func:`environment` into ``path`` and, without ``nvidia-smi``'s table, to stdout."""
    env = environment()
    Path(path).write_text(json.dumps(env, indent=2) + "\n")
    print(json.dumps({key: value for key, value in env.items() if key != "nvidia_smi"}, indent=1))
    print(env["nvidia_smi"] or "nvidia-smi: not found")


# --- CLI ------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools gpu-check``."""
    parser = argparse.ArgumentParser(prog=COMMAND, description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"folder of the results (default {DEFAULT_OUT}/; may be the device's $OUT)")
    parser.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                        help=f"seconds for the whole check, steps and reports (default {DEFAULT_BUDGET_S:.0f})")
    parser.add_argument("--started-at", type=float, metavar="UNIX_TIME",
                        help="count the budget from this time (make gpu-check and tools/gpu/device_check.sh pass their start)")
    parser.add_argument("--steps", help="comma-separated subset of the steps, in plan order (default: all)")
    parser.add_argument("--wheels", default=DEFAULT_WHEELS, metavar="DIR",
                        help=f"install the *.whl here offline before the steps (default {DEFAULT_WHEELS}/, from make gpu-wheels; "
                        "none there: no wheels step)")
    parser.add_argument("--site", default=DEFAULT_SITE, metavar="DIR",
                        help=f"where the wheels are installed, first on every step's PYTHONPATH (default {DEFAULT_SITE}/)")
    parser.add_argument("--dry-run", action="store_true", help="no CUDA needed: install the wheels, check the plan, the "
                        "arguments, the tests and the torch check, print the plan, run no step")
    return parser


def _print_plan(steps: Sequence[Step], *, budget_s: float, out: Path, echo: Callable[[str], None] = print) -> None:
    echo(f"gpu-check plan: {len(steps)} steps, expected to need {sum(s.expect_s for s in steps):.0f} s on one "
         f"H200-class GPU; budget {budget_s:.0f} s; results in {out}/")
    for index, step in enumerate(steps, 1):
        echo(f"  {index}. {step.name} (~{step.expect_s:.0f} s, timeout {step.timeout_s:.0f} s): {step.what}")
        echo(f"       python {shlex.join(step.argv)}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    site = Path(args.site) if Path(args.site).is_absolute() else ROOT / args.site
    steps = plan(out, wheels=Path(args.wheels), site=site, extra=bool(args.steps))
    if args.steps:
        names = [name.strip() for name in args.steps.split(",") if name.strip()]
        unknown = [name for name in names if name not in {step.name for step in steps}]
        if unknown or not names:
            print(f"{COMMAND}: --steps: unknown {unknown or 'nothing'}; the steps are {[s.name for s in steps]}", file=sys.stderr)
            return 2
        steps = tuple(step for step in steps if step.name in names or step.name == "wheels")  # the carried wheels always
    if args.budget_s <= 0:
        print(f"{COMMAND}: --budget-s must be positive, got {args.budget_s:g}", file=sys.stderr)
        return 2
    _print_plan(steps, budget_s=args.budget_s, out=out)
    if args.dry_run:
        print("dry run (no CUDA needed, nothing is run):")
        problems = dry_run(steps, budget_s=args.budget_s)
        print(f"dry run {'passed' if not problems else f'FAILED: {len(problems)} problem(s)'}")
        return 1 if problems else 0
    refused = note = ""
    try:
        note = preflight()
    except Refused as error:
        refused = str(error)
        print(f"{COMMAND}: refused: {refused}", file=sys.stderr)
    spent = max(0.0, time.time() - args.started_at) if args.started_at else 0.0
    record = run_check(steps, out=out, budget_s=args.budget_s, spent_s=spent, refused=refused, note=note,
                       command=shlex.join([*COMMAND.split(), *(sys.argv[1:] if argv is None else argv)]))
    counts = {status: sum(o["status"] == status for o in record["steps"]) for status in STATUSES}
    env = record["env"] or {}
    print(f"\ngpu-check: {record['status']} in {record['wall_s']:.0f} s of {args.budget_s:.0f} s "
          f"({', '.join(f'{n} {s}' for s, n in counts.items() if n)}); {env.get('device', 'no CUDA device')}, torch {record['torch']}")
    for outcome in record["steps"]:
        print("  " + _screen_line(outcome))
    print(f"files in {out}/: {', '.join(record['files'])}")
    return 2 if refused else 1 if record["status"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())

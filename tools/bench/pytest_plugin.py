"""What subclass_ca's pytest plugin costs a pytest run that does not use it (Note [A plugin that costs nothing until used]).

``python -m tools.bench.pytest_plugin [--runs N] [--out FILE]`` times whole processes from outside: a
one-test pytest run of a project that never mentions subclass_ca (a fresh folder: its own rootdir, no
conftest), in this interpreter's environment, where subclass_ca's ``pytest11`` entry point is installed:

* ``plugin`` — as pytest runs it: the entry point loaded;
* ``no plugin`` — ``-p no:subclass_ca``, the baseline;
* ``import at start-up`` — the baseline plus ``import subclass_ca.testing`` before pytest starts: what the
  entry point cost when it was ``subclass_ca.testing.plugin`` (for reference).

The modes run interleaved, one of each per round, the order rotated each round, after one unrecorded
warm-up round; a ratio is taken per round (Note [Verdicts on a shared machine] in tools/common/stats.py).
Target: plugin / no plugin <= 1.10.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tools.common.report import WITHIN_NOISE
from tools.common.stats import judge, paired_ratio

TARGET = 1.10
_TEST = "def test_one():\n    assert 1 + 1 == 2\n"
_PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "test_one.py"]
MODES: dict[str, list[str]] = {
    "plugin": [*_PYTEST],
    "no plugin": [*_PYTEST, "-p", "no:subclass_ca"],
    "import at start-up": ["-c", "import sys, subclass_ca.testing, pytest; "
                           f"sys.exit(pytest.main({[*_PYTEST[2:], '-p', 'no:subclass_ca']!r}))"],
}
"""Mode -> the interpreter's arguments (run in the test folder)."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.bench.pytest_plugin", description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="recorded rounds (one run of each mode per round); default 5")
    parser.add_argument("--out", help="write the Markdown report to this file (else print it only)")
    return parser


def _time_once(folder: Path, arguments: list[str]) -> float:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTEST_DISABLE_PLUGIN_AUTOLOAD", None)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *arguments], cwd=folder, env=env, capture_output=True, text=True, timeout=600)
    seconds = time.perf_counter() - start
    if done.returncode != 0 or "1 passed" not in done.stdout:
        raise RuntimeError(f"{arguments} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


def measure(runs: int) -> dict[str, list[float]]:
    """Mode -> wall seconds per recorded round."""
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    with tempfile.TemporaryDirectory(prefix="subclass_ca-pytest-plugin-") as name:
        folder = Path(name)
        (folder / "pytest.ini").write_text("[pytest]\n")
        (folder / "test_one.py").write_text(_TEST)
        order = list(MODES)
        for round_index in range(runs + 1):
            rotated = order[round_index % len(order):] + order[:round_index % len(order)]
            for mode in rotated:
                seconds = _time_once(folder, MODES[mode])
                if round_index > 0:  # round 0 warms the file system cache and .pyc files
                    samples[mode].append(seconds)
    return samples


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=30,
                              cwd=Path(__file__).resolve().parents[2]).stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def report(samples: dict[str, list[float]], argv: list[str]) -> str:
    import pytest

    lines = [
        "# What the pytest plugin costs a run that does not use it (issue 61)",
        "",
        f"- command: `{' '.join(['python -m tools.bench.pytest_plugin', *argv])}` (from the checkout's root)",
        f"- {datetime.date.today().isoformat()}, commit {_commit()}; Python {platform.python_version()}, pytest "
        f"{pytest.__version__}, {os.cpu_count()} logical cores; whole processes, wall time, one warm-up round not recorded",
        "- the run: `python -m pytest -q -p no:cacheprovider test_one.py`, one passing test that imports nothing, in a "
        "folder of its own, in the environment where subclass_ca is installed",
        "",
        "| mode | median s | min–max s |",
        "|---|---:|---:|",
    ]
    for mode, values in samples.items():
        lines.append(f"| {mode} | {statistics.median(values):.2f} | {min(values):.2f}–{max(values):.2f} |")
    lines += ["", "| ratio (per round) | median [95% interval] | target | verdict |", "|---|---:|---:|---|"]
    for mode in ("plugin", "import at start-up"):
        interval = paired_ratio(samples[mode], samples["no plugin"])
        if interval is None:
            continue
        if mode == "plugin":
            verdict = judge(interval, TARGET)
            verdict_text = "**met**" if verdict is True else "**missed**" if verdict is False else str(WITHIN_NOISE)
            target = f"<= {TARGET:.2f}"
        else:
            verdict_text, target = "reference (the entry point before)", "—"
        lines.append(f"| {mode} / no plugin | {interval['ratio']:.3f} [{interval['low']:.3f}–{interval['high']:.3f}] "
                     f"| {target} | {verdict_text} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    text = report(measure(args.runs), argv)
    print(text, end="")
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m subclass_ca gpu-check``: the plan, its dry run, the torch-range refusal, the budget and the reports (no CUDA needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from subclass_ca._tools import gpu_check
from subclass_ca._tools.gpu_check import Outcome, Refused, Step

ROOT = Path(__file__).resolve().parents[2]


def _step(name: str, code: str, *, expect_s: float = 0.1, timeout_s: float = 20.0, **kwargs) -> Step:
    return Step(name=name, what=f"fake step {name}", argv=("-c", code), expect_s=expect_s, timeout_s=timeout_s, **kwargs)


def test_dry_run_end_to_end_passes_and_lists_every_step() -> None:
    done = subprocess.run([sys.executable, "-m", "subclass_ca", "gpu-check", "--dry-run"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    for step in gpu_check.plan(ROOT / gpu_check.DEFAULT_OUT):
        assert f"{step.name} (~" in done.stdout and f"ok   {step.name}:" in done.stdout
    assert "ok   torch range:" in done.stdout and "dry run passed" in done.stdout
    assert " 0 tests collected" not in done.stdout


@pytest.mark.parametrize(("name", "extra", "words"), [
    ("demo", ("--bogus",), "unrecognized arguments: --bogus"),
    ("bench", ("--realistic-reps", "0"), "realistic_reps must be >= 1"),
    ("fsdp2", ("--fsdp2-modes", "eager,bogus"), "unknown ['bogus']"),
    ("fsdp2-profile", ("--model", "nope"), "--model: got 'nope'"),
])
def test_a_bad_argument_is_reported_naming_the_step(tmp_path: Path, name: str, extra: tuple[str, ...], words: str) -> None:
    step = next(s for s in gpu_check.plan(tmp_path) if s.name == name)
    checked, problems = gpu_check.check_step(step)
    assert problems == [] and "own parser" in checked
    _, problems = gpu_check.check_step(dataclasses.replace(step, argv=(*step.argv, *extra)))
    assert len(problems) == 1 and problems[0].startswith(f"step {name}: `python -m subclass_ca {name}` rejects")
    assert words in problems[0]


def test_a_pytest_step_collecting_nothing_or_missing_an_expected_file_fails(tmp_path: Path) -> None:
    step = next(s for s in gpu_check.plan(tmp_path) if s.name == "pytest-cuda-inductor")
    empty = dataclasses.replace(step, argv=tuple(a if a != "cuda and inductor" else "cuda and not cuda" for a in step.argv),
                                expect_tests=("tests/test_capture.py", "tests/no_such_file.py"))
    _, problems = gpu_check.check_step(empty)
    assert any("expected test file tests/no_such_file.py is missing" in p for p in problems)
    assert any("collected 0 tests" in p for p in problems)
    assert any("no test collected from tests/test_capture.py" in p for p in problems)


def test_an_out_of_range_torch_is_refused_naming_it_the_range_and_the_fix() -> None:
    with pytest.raises(Refused) as refused:
        gpu_check.check_torch("2.11.0+cu130", python="/opt/torch/.venv/bin/python3")
    message = str(refused.value)
    for words in ("/opt/torch/.venv/bin/python3 has torch 2.11.0+cu130", "torch>=2.13,<2.16", "2.13, 2.14 or 2.15",
                  "make gpu-check GPU_PYTHON=/path/to/venv/bin/python", "none is run"):
        assert words in message
    for version in ("2.13.0", "2.14.1+cu126", "2.15.1+cu128", "2.15.0a0+git1234"):
        gpu_check.check_torch(version)
    for version in ("2.12.9", "2.16.0", "2.16.0.dev20260101+cu130", "3.0"):
        with pytest.raises(Refused, match=version.replace("+", r"\+")):
            gpu_check.check_torch(version)
    assert gpu_check.release("2.16.0.dev20260101+cu130") == (2, 16, 0)
    assert gpu_check.torch_bounds(">=2.13,<2.16") == ((2, 13), (2, 16))
    with pytest.raises(ValueError, match="expected '>=A.B,<C.D'"):
        gpu_check.torch_bounds(">=2.13,!=2.14")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal shown without CUDA")
def test_without_cuda_a_real_run_is_refused_up_front_pointing_at_the_dry_run() -> None:
    with pytest.raises(Refused, match=r"torch.cuda.is_available\(\) is False.*--dry-run"):
        gpu_check.preflight()


def test_budget_exhaustion_skips_later_steps_and_a_slow_step_times_out(tmp_path: Path) -> None:
    steps = (
        _step("sleeps", "import time; time.sleep(0.3); print('slept')"),
        _step("fails", "raise SystemExit(3)"),
        _step("hangs", "import time; time.sleep(60)", timeout_s=1.0),
        _step("too-big", "print('never')", expect_s=30.0, timeout_s=60.0),
        _step("small", "print('still fits')"),
    )
    lines: list[str] = []
    record = gpu_check.run_check(steps, out=tmp_path, budget_s=20.0, echo=lines.append)
    by_name = {o["step"]: o for o in record["steps"]}
    assert [o["step"] for o in record["steps"]] == [s.name for s in steps]
    assert by_name["sleeps"]["status"] == "passed" and by_name["sleeps"]["rc"] == 0 and by_name["sleeps"]["wall_s"] >= 0.3
    assert by_name["fails"]["status"] == "failed" and by_name["fails"]["rc"] == 3
    assert by_name["hangs"]["status"] == "timed-out" and by_name["hangs"]["rc"] is None and by_name["hangs"]["wall_s"] < 15
    assert by_name["too-big"]["status"] == "skipped" and by_name["too-big"]["reason"].startswith("budget:")
    assert "it is expected to need 30 s" in by_name["too-big"]["reason"]
    assert by_name["small"]["status"] == "passed"  # a later step that fits still runs
    assert record["status"] == "failed" and record["reason"] == "failed: fails, hangs"
    assert any("too-big" in line and "skipped" in line for line in lines)
    log = (tmp_path / "gpu_check.log").read_text()
    assert "slept" in log and "still fits" in log and "never" not in log and "===== hangs: timed out" in log


def test_budget_already_spent_before_the_steps_skips_them(tmp_path: Path) -> None:
    record = gpu_check.run_check((_step("a", "pass", expect_s=1.0), _step("b", "pass", expect_s=1.0)),
                                 out=tmp_path, budget_s=10.0, spent_s=9.5, echo=lambda line: None)
    assert [o["status"] for o in record["steps"]] == ["skipped", "skipped"]
    assert record["status"] == "passed" and record["wall_s"] >= 9.5  # skipped for budget is reported, not a failure


def test_reports_hold_every_step_with_its_figures(tmp_path: Path) -> None:
    out, junit = tmp_path / "out", tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite tests="5" failures="1" errors="0" skipped="1"/></testsuites>')
    written = out / gpu_check.WORK / "x.txt"
    steps = (
        _step("tests", "pass", figures=lambda: gpu_check._junit_figures(junit)),
        _step("broken-figures", "pass", figures=lambda: json.loads("not json")),
        _step("writes", f"import pathlib; p = pathlib.Path({str(written)!r}); p.parent.mkdir(); p.write_text('x')"),
    )
    out.mkdir()
    for name in ("summary.md", "junit-old.xml", "keep.txt"):  # an earlier run's reports go, other files stay
        (out / name).write_text("stale")
    record = gpu_check.run_check(steps, out=out, budget_s=60.0, echo=lambda line: None)
    saved = json.loads((out / "gpu_check.json").read_text())
    assert [o["step"] for o in saved["steps"]] == ["tests", "broken-figures", "writes"]
    assert saved["steps"][0]["figures"] == {"passed": 3, "failed": 1, "skipped": 1}
    assert saved["steps"][1]["status"] == "passed" and saved["steps"][1]["figures"]["figures"].startswith("not read (JSONDecodeError")
    for key in ("command", "rc", "wall_s", "status", "reason", "timeout_s", "what"):
        assert key in saved["steps"][0]
    summary = (out / "summary.md").read_text()
    assert summary.startswith("# GPU check") and "**passed**" in summary
    assert "| tests | passed |" in summary and "passed 3; failed 1; skipped 1" in summary and "| writes | passed |" in summary
    assert record["files"] == ["artifacts.tar.gz", "gpu_check.json", "gpu_check.log", "keep.txt", "summary.md"]
    with tarfile.open(out / gpu_check.ARTIFACTS) as archive:
        assert archive.getnames() == ["work", "work/x.txt"]
    assert not (out / gpu_check.WORK).exists()


def test_a_refused_interpreter_runs_only_env_and_records_every_step(tmp_path: Path) -> None:
    steps = (_step("env", "print('env ran')"), _step("pytest-cuda", "print('must not run')"))
    record = gpu_check.run_check(steps, out=tmp_path, refused="torch 2.11.0 is outside >=2.13,<2.16", echo=lambda line: None)
    assert record["status"] == "refused" and [o["status"] for o in record["steps"]] == ["passed", "skipped"]
    assert record["steps"][1]["reason"].startswith("not run: the interpreter was refused")
    assert "torch 2.11.0 is outside" in (tmp_path / "summary.md").read_text()
    assert "must not run" not in (tmp_path / "gpu_check.log").read_text()


def test_the_plan_fits_its_budget_and_the_device_file_limit(tmp_path: Path) -> None:
    steps = gpu_check.plan(tmp_path)
    assert [s.name for s in steps] == ["env", "pytest-cuda", "pytest-cuda-inductor", "demo", "bench", "fsdp2", "fsdp2-profile"]
    assert sum(s.expect_s for s in steps) <= gpu_check.DEFAULT_BUDGET_S
    junits = [a for s in steps for a in s.argv if a.startswith("--junitxml=")]
    top_files = len(gpu_check.REPORT_FILES) + 1 + len(junits) + 1  # + env.json, the JUnit files, the archive
    assert top_files <= 8  # what the lent device returns from $OUT


def test_environment_step_works_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpu_check.write_environment(str(tmp_path / "env.json"))
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["cuda_available"] is torch.cuda.is_available()
    assert gpu_check._env_figures(tmp_path / "env.json")["torch"] == torch.__version__
    assert '"torch"' in capsys.readouterr().out


def test_cli_rejects_an_unknown_step_and_a_bad_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--dry-run", "--steps", "env,bogus"]) == 2
    assert "unknown ['bogus']" in capsys.readouterr().err
    assert gpu_check.main(["--dry-run", "--budget-s", "0"]) == 2
    assert "--budget-s must be positive" in capsys.readouterr().err


def test_outcome_rejects_an_unknown_status() -> None:
    with pytest.raises(ValueError, match="status 'ok'"):
        Outcome(step="x", command="x", status="ok")
    with pytest.raises(ValueError, match="expect_s <= timeout_s"):
        _step("x", "pass", expect_s=5.0, timeout_s=1.0)

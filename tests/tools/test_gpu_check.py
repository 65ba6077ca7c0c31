"""``python -m tools gpu-check``: the plan, its dry run, the torch check, the carried wheels, the budget and the reports (no CUDA needed)."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import torch

from tools import checkout_env
from tools.gpu import check as gpu_check
from tools.gpu.check import Outcome, Refused, Step

ROOT = Path(__file__).resolve().parents[2]


def _step(name: str, code: str, *, expect_s: float = 0.1, timeout_s: float = 20.0, **kwargs) -> Step:
    return Step(name=name, what=f"fake step {name}", argv=("-c", code), expect_s=expect_s, timeout_s=timeout_s, **kwargs)


def _wheel(folder: Path, name: str = "fake_extra", version: str = "0.1") -> Path:
    """A minimal pure-Python wheel (what ``make gpu-wheels`` would put into wheels/), built without network."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{version}-py3-none-any.whl"
    info = f"{name}-{version}.dist-info"
    files = {
        f"{name}/__init__.py": f"VERSION = {version!r}\n",
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    files[f"{info}/RECORD"] = "".join(f"{name},,\n" for name in [*files, f"{info}/RECORD"])
    with zipfile.ZipFile(path, "w") as archive:
        for member, text in files.items():
            archive.writestr(member, text)
    return path


def test_dry_run_of_the_device_invocation(tmp_path: Path) -> None:
    """tools/gpu/device_check.sh --dry-run: the device's one command, checked on this interpreter without CUDA.

    Kept in the lane suite (tests/conftest.py LANE_KEPT): on the 2.11 lane it is the device's torch release.
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GPU_PYTHON": sys.executable, "OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(ROOT / "tools" / "gpu" / "device_check.sh"), "--dry-run"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    for step in gpu_check.plan(ROOT / gpu_check.DEFAULT_OUT, wheels=ROOT / gpu_check.DEFAULT_WHEELS):
        assert f"{step.name} (~" in done.stdout and f"ok   {step.name}:" in done.stdout
    assert "ok   torch check:" in done.stdout and "ok   budget:" in done.stdout and "dry run passed" in done.stdout
    assert f"this interpreter: {sys.executable}, torch {torch.__version__}" in done.stdout and "NOT supported" not in done.stdout
    assert " 0 tests collected" not in done.stdout
    assert not (tmp_path / "out").exists()  # a dry run writes no results


def _make_dry_run(*variables: str) -> list[str]:
    """The command ``make -n`` prints for a target (its last line), split."""
    done = subprocess.run(["make", "-n", "--no-print-directory", *variables], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return shlex.split(done.stdout.strip().splitlines()[-1])


def _check_arguments(argv: list[str]) -> list[str]:
    """The arguments after ``-m tools gpu-check``, without the ones that differ on purpose between a run and its dry run."""
    args = argv[argv.index("gpu-check") + 1:]
    for flag in ("--started-at",):
        if flag in args:
            del args[args.index(flag):args.index(flag) + 2]
    return [a for a in args if a != "--dry-run"]


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_make_gpu_check_dry_runs_the_device_invocation_with_the_same_arguments() -> None:
    real = _make_dry_run("gpu-check", "GPU_PYTHON=python3", "OUT=/tmp/device-out")
    dry = _make_dry_run("gpu-check-dry", "OUT=/tmp/device-out")
    assert real[:4] == ["python3", "-m", "tools", "gpu-check"] and "--started-at" in real
    assert "--dry-run" in dry and _check_arguments(real) == _check_arguments(dry)
    assert _check_arguments(real) == ["--out", "/tmp/device-out", "--budget-s", "360", "--wheels", "wheels"]
    script = (ROOT / "tools" / "gpu" / "device_check.sh").read_text()
    assert re.search(r'-m tools gpu-check --out "\$\{OUT:-gpu-check-out\}" --budget-s "\$\{GPU_BUDGET:-360\}"', script)
    assert '--wheels "${GPU_WHEELS:-wheels}"' in script


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
    assert len(problems) == 1 and problems[0].startswith(f"step {name}: `python -m tools {name}` rejects")
    assert words in problems[0]


def test_a_pytest_step_collecting_nothing_or_missing_an_expected_file_fails(tmp_path: Path) -> None:
    step = next(s for s in gpu_check.plan(tmp_path) if s.name == "pytest-cuda-inductor")
    empty = dataclasses.replace(step, argv=tuple(a if a != "cuda and inductor" else "cuda and not cuda" for a in step.argv),
                                expect_tests=("tests/test_capture.py", "tests/no_such_file.py"))
    _, problems = gpu_check.check_step(empty)
    assert any("expected test file tests/no_such_file.py is missing" in p for p in problems)
    assert any("collected 0 tests" in p for p in problems)
    assert any("no test collected from tests/test_capture.py" in p for p in problems)


def test_an_unsupported_torch_is_refused_naming_it_the_range_and_the_fix() -> None:
    with pytest.raises(Refused) as refused:
        gpu_check.check_torch("2.10.0+cu128", python="/opt/torch/.venv/bin/python3")
    message = str(refused.value)
    for words in ("/opt/torch/.venv/bin/python3 has torch 2.10.0+cu128", "torch>=2.11", "tested: 2.11, 2.12",
                  "make gpu-check GPU_PYTHON=/path/to/python", "none is run"):
        assert words in message
    for version in ("2.9.1", "1.13.1", "nonsense"):
        with pytest.raises(Refused, match=re.escape(version)):
            gpu_check.check_torch(version)


def test_the_device_torch_and_newer_ones_are_admitted_an_untested_one_with_a_note() -> None:
    for version in ("2.11.0+cu130", "2.12.1", "2.13.0", "2.15.1+cu128", "2.15.0a0+git1234"):
        assert gpu_check.check_torch(version) == ""  # tested releases: no note
    note = gpu_check.check_torch("2.16.0.dev20260101+cu130")
    assert "2.16.0.dev20260101+cu130 is untested" in note and "the check runs" in note


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
    record = gpu_check.run_check(steps, out=tmp_path, refused="torch 2.10.0 is not supported", echo=lambda line: None)
    assert record["status"] == "refused" and [o["status"] for o in record["steps"]] == ["passed", "skipped"]
    assert record["steps"][1]["reason"].startswith("not run: the interpreter was refused")
    assert "torch 2.10.0 is not supported" in (tmp_path / "summary.md").read_text()
    assert "must not run" not in (tmp_path / "gpu_check.log").read_text()


def test_the_plan_fits_its_budget_and_the_device_file_limit(tmp_path: Path) -> None:
    bare = gpu_check.plan(tmp_path, wheels=tmp_path / "no-wheels")
    assert [s.name for s in bare] == ["env", "pytest-cuda", "pytest-cuda-inductor", "demo", "bench", "depth", "fsdp2", "fsdp2-profile"]
    _wheel(tmp_path / "wheels")
    steps = gpu_check.plan(tmp_path, wheels=tmp_path / "wheels")
    assert [s.name for s in steps] == ["wheels", *(s.name for s in bare)]  # the carried wheels first
    assert sum(s.expect_s for s in steps) <= gpu_check.DEFAULT_BUDGET_S - gpu_check.RESERVE_S
    assert gpu_check.DEFAULT_BUDGET_S <= 360  # twice in one 15-minute device session
    junits = [a for s in steps for a in s.argv if a.startswith("--junitxml=")]
    top_files = len(gpu_check.REPORT_FILES) + 1 + len(junits) + 1  # + env.json, the JUnit files, the archive
    assert top_files <= 8  # what the lent device returns from $OUT
    target = Path(steps[0].argv[steps[0].argv.index("--target") + 1])
    assert not target.is_relative_to(tmp_path)  # the installed wheels never land in --out (the device's $OUT)


def test_carried_wheels_install_offline_and_every_later_step_imports_them(tmp_path: Path) -> None:
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    _wheel(wheels)
    (wheels_step,) = [s for s in gpu_check.plan(tmp_path / "out", wheels=wheels, site=site) if s.name == "wheels"]
    assert {"--no-index", "--no-deps", "--target"} <= set(wheels_step.argv) and str(site) in wheels_step.argv
    uses = _step("uses", "import fake_extra, subclass_ca, tools; print('extra', fake_extra.VERSION, 'from', fake_extra.__file__)")
    record = gpu_check.run_check((wheels_step, uses), out=tmp_path / "out", budget_s=120.0, echo=lambda line: None)
    assert [o["status"] for o in record["steps"]] == ["passed", "passed"], (tmp_path / "out" / "gpu_check.log").read_text()
    assert record["steps"][0]["figures"] == {"installed": "fake_extra 0.1"}
    assert f"extra 0.1 from {site}" in (tmp_path / "out" / "gpu_check.log").read_text()
    checked, problems = gpu_check.check_step(wheels_step)  # the dry run installs them the same way
    assert problems == [] and checked == "installed offline: fake_extra 0.1"


def test_a_broken_wheel_fails_the_dry_run_naming_it(tmp_path: Path) -> None:
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "broken-1.0-py3-none-any.whl").write_text("not a zip")
    (step,) = [s for s in gpu_check.plan(tmp_path / "out", wheels=tmp_path / "wheels") if s.name == "wheels"]
    _, problems = gpu_check.check_step(step)
    assert len(problems) == 1 and "broken-1.0-py3-none-any.whl is not a readable wheel" in problems[0]


def test_steps_import_subclass_ca_and_tools_from_the_checkout_wherever_they_run(tmp_path: Path) -> None:
    code = "import subclass_ca, tools; print(subclass_ca.__file__); print(tools.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=gpu_check.step_env(), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert [Path(line).parent.parent for line in done.stdout.split()] == [ROOT, ROOT]
    assert checkout_env({"PYTHONPATH": "/x"}, extra_paths=["/site"])["PYTHONPATH"] == os.pathsep.join([str(ROOT), "/site", "/x"])


def test_environment_step_works_without_cuda(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    gpu_check.write_environment(str(tmp_path / "env.json"))
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["torch"] == torch.__version__ and env["cuda_available"] is torch.cuda.is_available()
    assert gpu_check._env_figures(tmp_path / "env.json")["torch"] == torch.__version__
    assert Path(env["subclass_ca"]) == ROOT / "subclass_ca"  # the checkout's, as every step's
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


def test_the_torchao_step_is_an_extra_call_that_checks_every_torchao_row_the_kit_and_the_matrix_name() -> None:
    import re

    from subclass_ca.testing.torchao_specs import TORCHAO_SPEC_NAMES

    assert gpu_check.TORCHAO_ROWS.split(",") == list(TORCHAO_SPEC_NAMES)
    extra = gpu_check.plan(Path("/tmp/out"), wheels=Path("/tmp/no-wheels"), extra=True)
    assert extra[-1].name == "torchao-check" and "torchao-check" not in [s.name for s in gpu_check.plan(Path("/tmp/out"))]
    assert extra[-1].expect_s <= gpu_check.DEFAULT_BUDGET_S - gpu_check.RESERVE_S  # a second call of its own
    summary, problems = gpu_check.check_step(extra[-1])
    assert problems == [] and "parses its arguments" in summary
    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert re.search(r"^TORCHAO_ROWS \?= (.*)$", makefile, re.M).group(1).split(",") == list(TORCHAO_SPEC_NAMES)


def test_the_warm_start_row_is_an_extra_step_that_parses_with_the_benchs_own_parser() -> None:
    """Issue 53: the first lent device measures the warm restart (its L = 32 row is the ``depth`` step)."""
    extra = gpu_check.plan(Path("/tmp/out"), wheels=Path("/tmp/no-wheels"), extra=True)
    step = next(s for s in extra if s.name == "warm-start")
    assert "warm-start" not in [s.name for s in gpu_check.plan(Path("/tmp/out"))]
    assert "--device" in step.argv and step.argv[step.argv.index("--device") + 1] == "cuda"
    assert step.expect_s <= gpu_check.DEFAULT_BUDGET_S - gpu_check.RESERVE_S
    summary, problems = gpu_check.check_step(step)
    assert problems == [] and "own parser" in summary
    broken = dataclasses.replace(step, argv=(*step.argv, "--models", "fsdp2_two_tensor"))
    _, problems = gpu_check.check_step(broken)
    assert len(problems) == 1 and "FSDP2 row runs on gloo" in problems[0]

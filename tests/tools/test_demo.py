"""``python -m tools demo``: table, results.json, PNG; failing modes are reported, not fatal."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools import checkout_env
from tools.demo import main as _demo
from tools.demo.main import MODES, DemoConfig, format_table, run_demo

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == PNG_SIGNATURE
    image = pytest.importorskip("matplotlib.image").imread(path)
    height, width = image.shape[:2]
    assert height >= 200 and width >= 400, image.shape
    assert image.std() > 0  # not a blank canvas


@pytest.mark.slow
def test_quick_demo_in_a_subprocess_writes_table_json_and_png(tmp_path: Path):
    env = checkout_env({**os.environ, "OMP_NUM_THREADS": "1"})
    env.pop("SUBCLASS_CA_LOG", None)
    result = subprocess.run(
        [sys.executable, "-m", "tools", "demo", "--quick", "--backend", "aot_eager", "--no-progress",
         "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=90, env=env, cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    # the table: a header and one row per (model, mode)
    assert "model" in out and "max|dloss|" in out and "max|dparam|" in out and "speedup" in out
    table_rows = [line.split() for line in out.splitlines() if line.split()[:1] in (["int8_lora"], ["pair"])]
    assert {(row[0], row[1]) for row in table_rows} == {(m, mode) for m in ("int8_lora", "pair") for mode in MODES}
    assert all(row[-1] == "ok" for row in table_rows), out
    # the capture report is printed at the end
    assert "[pair] subclass_ca:" in out and "2 x make_subclass PairTensor [proxy]" in out
    assert "cache-miss reason: not collected" in out  # collected only when asked for (report=True)

    results = json.loads((tmp_path / "results.json").read_text())
    tolerance = results["config"]["tolerance"]
    assert tolerance == 1e-5 and results["config"]["backend"] == "aot_eager"
    assert results["ok"] is True and results["config"]["steps"] == 8
    assert set(results["models"]) == {"int8_lora", "pair"}
    for name, model in results["models"].items():
        assert list(model["modes"]) == list(MODES), name
        for mode, entry in model["modes"].items():
            assert entry["status"] == "ok", (name, mode, entry["error"])
            assert len(entry["losses"]) == 8 and len(entry["step_times_s"]) == 8
            assert entry["median_step_s"] > 0 and entry["speedup_vs_eager"] > 0
        for mode in ("stock_ca", "subclass_ca"):
            entry = model["modes"][mode]
            assert entry["max_loss_diff_vs_eager"] <= tolerance, (name, mode)
            assert entry["max_param_diff_vs_eager"] <= tolerance, (name, mode)
            assert entry["within_tolerance"] is True
        assert model["modes"]["eager"]["max_loss_diff_vs_eager"] == 0.0
        ca = model["modes"]["subclass_ca"]
        assert ca["cache"]["runs"] == 8 and ca["cache"]["cache_hits"] == 8 - ca["cache"]["captures"]
    pair_nodes = results["models"]["pair"]["modes"]["subclass_ca"]["captures"][0]["make_subclass_nodes"]
    assert pair_nodes == [{"type": "PairTensor", "mode": "proxy", "count": 2}]
    lora_captures = results["models"]["int8_lora"]["modes"]["subclass_ca"]["captures"]
    assert all(c["make_subclass_nodes"] == [] for c in lora_captures)  # frozen int8 base: plain adapter grads

    assert results["plot"] == "demo.png"
    _check_png(tmp_path / "demo.png")


def _small(**options) -> DemoConfig:
    return DemoConfig(**{"steps": 3, "warmup": 1, "models": ("pair",), "progress": False, "backend": "aot_eager", **options})


@pytest.mark.inductor
def test_inductor_subclass_ca_run_matches_eager_within_tolerance(tmp_path: Path):
    results = run_demo(_small(backend="inductor", modes=("eager", "subclass_ca")), tmp_path)
    entry = results["models"]["pair"]["modes"]["subclass_ca"]
    assert entry["status"] == "ok", entry["error"]
    assert entry["max_param_diff_vs_eager"] <= results["config"]["tolerance"] == 1e-3
    assert entry["within_tolerance"] and results["ok"]


def test_a_failing_mode_is_reported_in_the_table_not_a_crash(monkeypatch, tmp_path: Path):
    def broken_stock(*args, **kwargs):
        raise RuntimeError("stock compiled autograd is broken here\nsecond line")

    monkeypatch.setattr(_demo, "_stock_context", broken_stock)
    results = run_demo(_small(), tmp_path)
    modes = results["models"]["pair"]["modes"]
    assert modes["stock_ca"]["status"] == "failed"
    assert modes["stock_ca"]["error"] == "RuntimeError: stock compiled autograd is broken here"
    assert modes["stock_ca"]["within_tolerance"] is False
    assert all(modes[m]["status"] == "ok" for m in ("eager", "compile", "subclass_ca"))
    assert results["ok"] is True  # only subclass_ca runs decide the verdict
    row = next(line for line in format_table(results).splitlines() if " stock_ca " in line)
    assert "FAILED: RuntimeError: stock compiled autograd is broken here" in row
    assert json.loads((tmp_path / "results.json").read_text())["models"]["pair"]["modes"]["stock_ca"]["status"] == "failed"


def test_a_failing_subclass_ca_run_makes_the_demo_exit_nonzero(monkeypatch, tmp_path: Path, capsys):
    original = _demo._backward_context

    def context(mode: str, backend: str):
        if mode == "subclass_ca":
            raise RuntimeError("capture broke")
        return original(mode, backend)

    monkeypatch.setattr(_demo, "_backward_context", context)
    code = _demo.main(["--steps", "3", "--models", "pair", "--backend", "aot_eager", "--no-progress", "--out", str(tmp_path)])
    captured = capsys.readouterr()
    assert code == 1
    assert "FAILED: RuntimeError: capture broke" in captured.out
    assert "subclass_ca runs FAILED or differ from eager" in captured.err


def test_without_matplotlib_the_demo_still_writes_json_and_says_how_to_get_the_plot(monkeypatch, tmp_path: Path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    results = run_demo(_small(modes=("eager", "subclass_ca")), tmp_path)
    assert results["plot"] is None
    assert "pip install 'subclass_ca[demo]'" in results["plot_note"]
    assert not (tmp_path / "demo.png").exists()
    assert json.loads((tmp_path / "results.json").read_text())["plot"] is None


def test_in_process_run_png_is_valid(tmp_path: Path):
    run_demo(_small(modes=("eager", "subclass_ca")), tmp_path)
    _check_png(tmp_path / "demo.png")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--models", "nope"], "DemoConfig.models: unknown ['nope']; allowed values are ['int8_lora', 'pair']"),
        (["--modes", "eager,fast"], "DemoConfig.modes: unknown ['fast']"),
        (["--steps", "1"], "DemoConfig.steps must be >= 2"),
        (["--backend", "no_such_backend"], "unknown backend 'no_such_backend'"),
    ],
)
def test_bad_arguments_exit_2_with_the_allowed_values(argv: list[str], message: str, tmp_path: Path, capsys):
    assert _demo.main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


@pytest.mark.cuda
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_cuda_demo_run_matches_eager(tmp_path: Path):
    results = run_demo(_small(device="cuda", models=("int8_lora", "pair"), modes=("eager", "subclass_ca")), tmp_path)
    for model in results["models"].values():
        assert model["modes"]["subclass_ca"]["within_tolerance"], model["modes"]["subclass_ca"]["error"]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_cuda_device_without_cuda_exits_2_with_the_fix(tmp_path: Path, capsys):
    assert _demo.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "CUDA is not available; use --device cpu" in capsys.readouterr().err


# --- --threads and the noisy-timing warning (synthetic timings: no training) -----------------


def test_step_time_spread_is_iqr_over_median_and_none_below_the_minimum():
    assert _demo.step_time_spread([1.0, 1.0, 1.0, 1.0]) == 0.0
    assert _demo.step_time_spread([1.0] * 3) is None  # fewer than MIN_TIMED_STEPS
    # quartiles (inclusive) of 1..5 are 2 and 4, median 3
    assert _demo.step_time_spread([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(2.0 / 3.0)
    # one slow step (a late recompile) does not make a steady run noisy
    assert _demo.step_time_spread([1.0] * 9 + [50.0]) == 0.0


def _synthetic_results(step_times: dict[str, list[float]]) -> dict:
    modes = {mode: {"status": "ok", "step_time_spread": _demo.step_time_spread(times), "timed_steps": len(times)}
             for mode, times in step_times.items()}
    modes["stock_ca"] = {"status": "failed"}
    return {"models": {"pair": {"modes": modes}}}


def test_noise_warnings_name_the_noisy_and_the_too_short_runs_only():
    steady = [1.0, 1.02, 0.99, 1.01, 1.0, 1.0]
    noisy = [1.0, 2.0, 0.5, 3.0, 1.0, 1.5]
    lines = _demo.noise_warnings(_synthetic_results({"eager": steady, "compile": noisy, "subclass_ca": [1.0, 1.0]}))
    assert len(lines) == 2, lines
    assert lines[0].startswith("pair/compile: step times spread") and "IQR/median > 25%" in lines[0]
    assert lines[1].startswith("pair/subclass_ca: only 2 timed step(s)")
    assert _demo.noise_warnings(_synthetic_results({"eager": steady, "compile": steady, "subclass_ca": steady})) == []


def _fake_train(step_times: dict[str, list[float]], seen_threads: list[int]):
    import torch

    def train(config, model_name, mode, tick):
        seen_threads.append(torch.get_num_threads())
        times = step_times[mode]
        return _demo.RunResult(mode=mode, losses=[[0.5]] * len(times), step_times_s=list(times),
                               final_params=[torch.zeros(2)])

    return train


def test_demo_warns_when_step_times_are_too_noisy_and_sets_threads_only_while_timing(monkeypatch, tmp_path: Path, capsys):
    import torch

    steady = [9.0, 9.0, 1.0, 1.01, 0.99, 1.0, 1.02, 1.0]  # the first 2 steps are warm-up
    noisy = [9.0, 9.0, 1.0, 3.0, 0.4, 2.5, 1.0, 0.5]
    seen: list[int] = []
    monkeypatch.setattr(_demo, "_train", _fake_train({"eager": steady, "subclass_ca": noisy}, seen))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        code = _demo.main(["--quick", "--models", "pair", "--modes", "eager,subclass_ca", "--backend", "aot_eager",
                           "--no-progress", "--out", str(tmp_path)])
        assert torch.get_num_threads() == 2  # restored after the run
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert code == 0
    assert seen == [1, 1]  # --threads defaults to 1 while timing
    assert "1 thread(s)" in out
    assert "warning: step times too noisy to compare" in out
    assert "pair/subclass_ca: step times spread" in out and "pair/eager" not in out.split("warning:")[1]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["threads"] == 1 and len(results["noise_warnings"]) == 1


def test_demo_prints_no_warning_for_steady_timings_and_honours_threads(monkeypatch, tmp_path: Path, capsys):
    steady = [9.0, 9.0, 1.0, 1.01, 0.99, 1.0, 1.02, 1.0]
    seen: list[int] = []
    monkeypatch.setattr(_demo, "_train", _fake_train({"eager": steady, "subclass_ca": steady}, seen))
    code = _demo.main(["--quick", "--models", "pair", "--modes", "eager,subclass_ca", "--backend", "aot_eager",
                       "--no-progress", "--threads", "2", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and seen == [2, 2]
    assert "too noisy" not in out


def test_threads_below_one_exit_2_naming_the_field(tmp_path: Path, capsys):
    assert _demo.main(["--threads", "-1", "--out", str(tmp_path)]) == 2
    assert "DemoConfig.threads must be a positive int" in capsys.readouterr().err

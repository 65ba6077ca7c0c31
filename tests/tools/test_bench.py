"""The benchmark: ``--quick`` runs end to end and writes the documented structure (not speed)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import main as _bench
from tools.bench import models as _bench_models
from tools.common import report
from tools.common import stats as bench_stats

REPO = Path(__file__).resolve().parents[2]
_MICRO = [m for m in _bench_models.MODELS if m not in _bench_models.REALISTIC]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    """One ``python -m tools bench --quick`` in a fresh process (DTensor needs its own process group)."""
    out = tmp_path_factory.mktemp("bench")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "tools", "bench", "--quick", "--threads", "1", "--no-progress",
         "--out-dir", str(out), "--note", "pytest"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=540,
    )
    return out, proc


@pytest.fixture(scope="module")
def results(quick_run) -> dict:
    out, proc = quick_run
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text())


@pytest.mark.slow
def test_quick_run_writes_results_md_json_and_png(quick_run, results):
    out, proc = quick_run
    assert (out / "RESULTS.md").is_file()
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "wrote" in proc.stdout


@pytest.mark.slow
def test_quick_run_measures_every_model_and_mode(results):
    measured = {(r["model"], r["mode"], r["backend"]) for r in results["rows"]}
    settings = results["settings"]
    assert set(_MICRO) | {"block_pair"} == set(settings["models"])  # the quick preset: micro MLPs + one block
    for model in settings["models"]:
        assert (model, "eager", None) in measured
        for mode in ("compile", "stock_ca", "subclass_ca", "subclass_ca_strict"):
            if mode == "subclass_ca_strict" and model in _bench_models.REALISTIC:
                assert (model, mode, "aot_eager") not in measured  # no strict row for the blocks
                continue
            assert (model, mode, "aot_eager") in measured
    for row in results["rows"]:
        assert row["peak_bytes"] is not None and row["peak_bytes"] > 0, row
        assert row["min"] <= row["q1"] <= row["median"] <= row["q3"] <= row["max"]
        assert row["median"] > 0 and math.isfinite(row["cold_ms"])
        if row["mode"] in _bench.CA_MODES:
            assert row["captures"] >= 1, row  # the backward really went through compiled autograd
        else:
            assert row["captures"] == 0, row
    assert results["steps"] == 1 + settings["warmup"] + settings["reps"] * settings["block"]
    assert results["realistic_steps"] == 1 + settings["warmup"] + settings["realistic_reps"] * settings["realistic_block"]
    block_rows = [r for r in results["rows"] if r["model"] == "block_pair"]
    assert block_rows and all(len(r["cold_samples_ms"]) == settings["realistic_cold_reps"] for r in block_rows)


@pytest.mark.slow
def test_quick_run_reports_growth_memory_and_ratios(results):
    growth = {(r["model"], r["mode"]) for r in results["growth"]}
    assert growth == {(m, mode) for m in _MICRO for mode in ("stock_ca", "subclass_ca")}
    for row in results["growth"]:
        assert row["recaptures"] == results["settings"]["recaptures"]
    memory = {r["model"]: r for r in results["memory"]}
    assert set(memory) == set(_MICRO)
    assert memory["pair"]["subclass_ca"]["make_subclass_nodes"] > 0
    ratios = results["ratios"]
    assert {r["model"] for r in ratios["subclass_ca_vs_stock"]} == set(_MICRO) | {"block_pair"}
    assert {r["model"] for r in ratios["subclass_vs_plain"]} == set(_MICRO) - {"plain"}
    assert {(r["model"], r["mode"]) for r in ratios["realistic"]} == {("block_pair", m) for m in ("compile", "stock_ca", "subclass_ca")}
    assert ratios["strict_vs_default"]
    assert all(r["steady_once"] > 0 for r in ratios["subclass_ca_vs_stock"])  # both styles on every row
    runtime = results["runtime"]
    assert runtime["enter_exit_us"]["subclass_ca"]["median"] > 0 and runtime["enter_exit_us"]["stock_ca"]["median"] > 0
    assert {r["mode"] for r in runtime["soak"]} == {"stock_ca", "subclass_ca"}
    assert {"enter_exit", "soak_rss", "soak_callables"} <= set(runtime["verdicts"])


@pytest.mark.slow
def test_render_rewrites_results_md_from_json_with_appended_notes(quick_run, results, tmp_path):
    out, _ = quick_run
    notes = tmp_path / "notes.md"
    notes.write_text("## Analysis\n\nhand-written words\n")
    rendered = tmp_path / "rendered"
    code = _bench.main(["--render", str(out / "results.json"), "--append", str(notes), "--out-dir", str(rendered), "--no-plot"])
    assert code == 0
    text = (rendered / "RESULTS.md").read_text()
    assert text.rstrip().endswith("hand-written words")
    assert "| subclass_ca / stock CA <= 1.00 (steady state, context entered per step; every row) |" in text


@pytest.mark.slow
def test_results_md_marks_every_target_and_the_cuda_column(quick_run, results):
    out, _ = quick_run
    text = (out / "RESULTS.md").read_text()
    for statement in _bench.TARGETS.values():
        line = next(line for line in text.splitlines() if line.startswith(f"| {statement} |"))
        assert any(word in line for word in ("**met**", "**missed**", "within noise", "not measured"))
    assert "torch " in text and "command: `python -m tools bench --quick" in text
    assert "CUDA" in text and "unmeasured" in text.lower()
    assert "machine: pytest" in text
    assert "## Realistic workloads" in text and "| block_pair | small | aot_eager | subclass_ca |" in text


def _synthetic_results(ours_ms: float, stock_ms: float, *, spread: float = 0.0) -> dict:
    """Nine rounds per mode; ``spread``: subclass_ca's samples swing by that fraction around ``ours_ms``."""
    settings = _bench.BenchSettings(models=("plain", "pair"), sizes=("small",), backends=("aot_eager",), strict_backends=())
    rows = []
    for model in ("plain", "pair"):
        for mode, ms in (("eager", 10.0), ("stock_ca", stock_ms), ("subclass_ca", ours_ms)):
            swing = spread if mode == "subclass_ca" else 0.0
            samples = [ms * (1 + swing * (-1) ** i) for i in range(9)]
            rows.append({"model": model, "size": "small", "mode": mode, "backend": None if mode == "eager" else "aot_eager",
                         "cold_ms": ms * 100, "cold_samples_ms": [ms * 100] * 2, "captures": 1, "recompiles_after_warmup": 0,
                         "cuda_peak_bytes": None, "samples_ms": samples, **_bench._stats(samples)})
    results = {
        "settings": {**_bench.dataclasses.asdict(settings), "command": "synthetic"},
        "steps": 1, "wall_s": 0.0, "rows": rows, "growth": [], "memory": [],
        "env": {"torch": "x", "python": "x", "platform": "x", "cpu": "x", "cpu_count": 1, "threads": 1,
                "cuda_note": "unmeasured", "noise_note": "synthetic"},
    }
    results["ratios"] = _bench._ratios(rows, settings)
    results["verdicts"] = _bench._verdicts(results)
    return results


def test_a_slower_subclass_ca_is_marked_missed_with_the_ratio():
    results = _synthetic_results(ours_ms=1.2, stock_ms=1.0)
    assert results["verdicts"]["steady"]["met"] is False
    assert "1.200" in results["verdicts"]["steady"]["detail"]
    assert "| subclass_ca / stock CA <= 1.00 (steady state, context entered per step; every row) | **missed** |" in _bench.render_markdown(results)


def test_a_ratio_whose_interval_straddles_the_target_is_within_noise_not_missed():
    results = _synthetic_results(ours_ms=1.0, stock_ms=1.0, spread=0.2)  # rounds at 0.8 and 1.2 of stock's
    assert results["verdicts"]["steady"]["met"] == report.WITHIN_NOISE
    assert "within noise: plain/small[aot_eager]" in results["verdicts"]["steady"]["detail"]
    row = results["ratios"]["subclass_ca_vs_stock"][0]["steady_interval"]
    assert row["low"] < 1.0 < row["high"] and row["rounds"] == 9
    assert "| within noise |" in _bench.render_markdown(results)
    # the same spread around a clearly slower median is still a miss
    assert _synthetic_results(ours_ms=1.5, stock_ms=1.0, spread=0.1)["verdicts"]["steady"]["met"] is False


def test_paired_ratios_are_seeded_and_judged_by_their_whole_interval():
    interval = bench_stats.paired_ratio([1.1, 0.9, 1.0, 1.2], [1.0, 1.0, 1.0, 1.0])
    assert interval == bench_stats.paired_ratio([1.1, 0.9, 1.0, 1.2], [1.0, 1.0, 1.0, 1.0])
    assert interval["low"] <= interval["ratio"] <= interval["high"]
    assert bench_stats.judge({"low": 0.9, "high": 0.99}, 1.0) is True
    assert bench_stats.judge({"low": 1.01, "high": 1.2}, 1.0) is False
    assert bench_stats.judge({"low": 0.9, "high": 1.1}, 1.0) == report.WITHIN_NOISE
    assert bench_stats.judge({"low": 2.1, "high": 3.0}, 2.0, at_least=True) is True
    assert bench_stats.judge({"low": 1.0, "high": 1.9}, 2.0, at_least=True) is False
    assert bench_stats.paired_ratio([], []) is None


def test_a_faster_subclass_ca_is_marked_met():
    results = _synthetic_results(ours_ms=0.9, stock_ms=1.0)
    assert results["verdicts"]["steady"]["met"] is True
    assert results["verdicts"]["vs_eager"]["met"] is True  # 10 ms eager / 0.9 ms
    assert results["verdicts"]["callables"]["met"] is None  # no growth rows: not measured, not "met"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"models": ("nope",)}, "models"), ({"sizes": ()}, "sizes"), ({"device": "tpu"}, "device"),
     ({"reps": 0}, "reps"), ({"recaptures": -1}, "recaptures"), ({"backends": ()}, "backends")],
)
def test_bench_settings_reject_bad_values_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"BenchSettings.{field}"):
        _bench.BenchSettings(**kwargs)


def test_cli_accepts_cuda_device_and_quick_preset():
    settings = _bench.settings_from_args(["--quick", "--device", "cuda", "--reps", "2"])
    assert settings.device == "cuda" and settings.reps == 2 and settings.sizes == ("small",)
    assert settings.command == "python -m tools bench --quick --device cuda --reps 2"


def test_bench_step_script_is_a_thin_entry_point():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_step.py"), "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "--quick" in proc.stdout and "--device" in proc.stdout


@pytest.mark.parametrize(("device", "backends", "expected"), [
    ("cuda", ("aot_eager", "inductor"), [("subclass_ca_cudagraphs", "inductor")]),
    ("cpu", ("aot_eager", "inductor"), []),
])
def test_the_cuda_graph_row_runs_on_cuda_with_inductor_only(monkeypatch, device, backends, expected):
    """The static CA graph replayed as a CUDA graph (mode='reduce-overhead'): a row of the GPU check's bench."""
    monkeypatch.setattr(_bench._bench_models, "build", lambda *args, **kwargs: object())

    def fake_step(workload, mode, backend, device):
        step = lambda: None  # noqa: E731
        step.in_one_context = lambda steps: None
        return step

    monkeypatch.setattr(_bench, "_make_step", fake_step)
    settings = _bench.BenchSettings(models=("block_pair",), realistic_sizes=("small",), backends=backends, device=device)
    configs = _bench._configs(settings)
    assert [(c.mode, c.backend) for c in configs if c.mode == "subclass_ca_cudagraphs"] == expected
    assert "subclass_ca_cudagraphs" in _bench.CA_MODES
    # the all-dynamic row beside the static-first default, on inductor (Note [Static-first CA graphs])
    # (on the CPU: the GPU check's bench step has a budget)
    dynamic = [("subclass_ca_dynamic", "inductor")] if device == "cpu" else []
    assert [(c.mode, c.backend) for c in configs if c.mode == "subclass_ca_dynamic"] == dynamic

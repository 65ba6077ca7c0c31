"""The depth sweep (``bench --depth``, issue 47): paired ratios, capture per block, targets, table and plot.

The sweep itself takes minutes (fresh inductor processes, ``make bench``); here its summary is checked on
synthetic samples: ratios paired per repetition, the targets, compiled autograd's capture per block, the table.
"""

from __future__ import annotations

import json

import pytest

from tools.bench import depth as bench_depth


def _sample(model, depth, mode, rep, cold, steady, capture=None):
    return {"model": model, "depth": depth, "mode": mode, "rep": rep, "cold_s": cold, "steady_ms": steady,
            "capture_s": capture, "max_abs_diff": 1e-7, "regional": None}


SAMPLES = [
    _sample("two_tensor_lora", 8, "compile", 0, 10.0, 2.0),
    _sample("two_tensor_lora", 8, "subclass_ca", 0, 11.0, 1.0, capture=0.2),
    _sample("two_tensor_lora", 8, "stock", 0, 14.0, 1.0, capture=0.2),
    _sample("two_tensor_lora", 32, "compile", 0, 10.0, 8.0),
    _sample("two_tensor_lora", 32, "subclass_ca", 0, 11.0, 4.0, capture=0.5),
    _sample("two_tensor_lora", 32, "stock", 0, 30.0, 4.0, capture=0.5),
    _sample("two_tensor_lora", 32, "compile", 1, 12.0, 8.0),
    _sample("two_tensor_lora", 32, "subclass_ca", 1, 15.0, 4.0, capture=0.6),
    _sample("two_tensor_lora", 32, "stock", 1, 30.0, 4.0, capture=0.6),
    {"model": "nf4_lora", "skipped": "torchao is not installed"},
]


def test_ratios_are_paired_per_repetition_and_judged_at_depth_32():
    rows = bench_depth.summarize(SAMPLES)
    ours = next(r for r in rows if (r["model"], r["depth"], r["mode"]) == ("two_tensor_lora", 32, "subclass_ca"))
    assert ours["cold_ratio"] == pytest.approx((1.175, 1.1, 1.25))  # 11/10 and 15/12, not 13/11
    assert ours["steady_ratio"] == pytest.approx((0.5, 0.5, 0.5))
    verdicts = bench_depth.verdicts(rows)
    assert verdicts["cold"]["met"] is True and verdicts["steady"]["met"] is True
    slow = [dict(s, cold_s=s["cold_s"] * 2) if s.get("mode") == "subclass_ca" else s for s in SAMPLES]
    assert bench_depth.verdicts(bench_depth.summarize(slow))["cold"]["met"] is False
    # capture: (0.55 - 0.2) s over 24 blocks
    assert bench_depth.capture_slopes(rows)["two_tensor_lora/subclass_ca"] == pytest.approx(350 / 24)
    skipped = next(r for r in rows if r["model"] == "nf4_lora")
    assert skipped["error"] == "torchao is not installed"


def test_the_section_renders_every_row_and_the_plot_is_written(tmp_path):
    rows = bench_depth.summarize(SAMPLES)
    result = {"settings": {**bench_depth.DepthBench().__dict__}, "torch": "x", "rows": rows, "samples": SAMPLES,
              "capture_per_block_ms": bench_depth.capture_slopes(rows), "verdicts": bench_depth.verdicts(rows),
              "wall_s": 1.0, "command": "python -m tools bench --depth"}
    text = bench_depth.markdown_section(result)
    assert "## Cold start against depth" in text and "two_tensor_lora/subclass_ca" in text
    assert text.count("| two_tensor_lora |") == 6 and "torchao is not installed" in text
    pytest.importorskip("matplotlib")
    assert bench_depth.plot(result, str(tmp_path / "depth.png")) and (tmp_path / "depth.png").stat().st_size > 0


def test_bad_settings_are_refused_by_name():
    with pytest.raises(ValueError, match="DepthBench.models"):
        bench_depth.DepthBench(models=("mlp",))
    with pytest.raises(ValueError, match="DepthBench.depths"):
        bench_depth.DepthBench(depths=(0,))
    with pytest.raises(ValueError, match="DepthBench.modes must include 'compile'"):
        bench_depth.DepthBench(modes=("subclass_ca",))
    with pytest.raises(ValueError, match="DepthBench.device"):
        bench_depth.DepthBench(device="tpu")


def test_the_command_line_gives_the_gpu_checks_row():
    settings = bench_depth.settings_from_args(["--device", "cuda", "--depths", "32", "--models", "two_tensor_lora",
                                               "--modes", "compile", "subclass_ca", "--target-reps", "1",
                                               "--whole-depth", "0", "--steady", "5"])
    assert settings == bench_depth.DepthBench(device="cuda", depths=(32,), models=("two_tensor_lora",),
                                              modes=("compile", "subclass_ca"), target_reps=1, whole_depth=0, steady=5)
    with pytest.raises(SystemExit):
        bench_depth.settings_from_args(["--models", "mlp"])
    several = bench_depth.settings_from_args(["--depths", "8", "64", "--whole-depth", "8", "64"])
    assert several.whole_depth == (8, 64)  # issue 53: regional against whole at every depth of the sweep


def test_the_gpu_checks_depth_step_reports_the_ratios(tmp_path):
    from tools.gpu import check as gpu_check

    (step,) = [s for s in gpu_check.plan(tmp_path) if s.name == "depth"]
    assert ("--depths", "32") == tuple(step.argv[step.argv.index("--depths"):][:2]) and "cuda" in step.argv
    work = tmp_path / gpu_check.WORK
    work.mkdir()
    rows = bench_depth.summarize([s for s in SAMPLES if s.get("mode", "compile") in ("compile", "subclass_ca")])
    (work / "depth.json").write_text(json.dumps(bench_depth.to_json({"rows": rows})))
    figures = step.figures()
    assert figures["two_tensor_lora L=32"].startswith("cold 1.18x, steady 0.50x compile-only")
    assert "two_tensor_lora L=8" in figures and figures["nf4_lora L=0"] == "torchao is not installed"

"""The depth sweep (``bench --depth``, issue 47): paired ratios, capture per block, targets, table and plot.

The sweep itself takes minutes (fresh inductor processes, ``make bench``); here its summary is checked on
synthetic samples: ratios paired per repetition, the targets, compiled autograd's capture per block, the table.
"""

from __future__ import annotations

import pytest

from tools import bench_depth


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

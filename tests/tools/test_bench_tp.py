"""The tensor-parallel block bench (``bench --tp``): runs on 2 processes, every mode's gradients equal eager's."""

from __future__ import annotations

import json
import math

import pytest

from tools.bench import main as _bench
from tools.bench import tp as bench_tp

TINY = bench_tp.TPBench(batch=1, seq=8, dim=16, heads=2, hidden=16, warmup=0, reps=2, block=1)


@pytest.fixture(scope="module")
def tp_result() -> dict:
    return bench_tp.bench(2, ("aot_eager",), settings=TINY, timeout_s=240)


@pytest.mark.distributed
@pytest.mark.slow
def test_tp_bench_times_every_mode_and_every_mode_matches_eager(tp_result):
    rows = {(r["mode"], r["backend"]): r for r in tp_result["rows"]}
    assert set(rows) == {("eager", None)} | {(m, "aot_eager") for m in bench_tp.MODES[1:]}
    for key, row in rows.items():
        assert row["error"] is None, (key, row["error"])
        assert row["grads_match_eager"], (key, row["grad_problems"])
        assert row["q1_ms"] <= row["median_ms"] <= row["q3_ms"] and row["median_ms"] > 0
        assert math.isfinite(row["cold_ms"]) and len(row["samples_ms"]) == TINY.reps
        # the weights really are sharded DTensors (colwise Shard(0), rowwise Shard(1)); the norms stay plain
        assert set(row["grad_types"]) == {"DTensor['S(0)']", "DTensor['S(1)']", "Tensor"}, row["grad_types"]
        assert (row["captures"] >= 1) == key[0].endswith("_ca"), (key, row["captures"])  # CA really captured
    assert tp_result["ok"] and tp_result["world_size"] == 2
    text = bench_tp.markdown_section(tp_result)
    assert "## Tensor-parallel transformer block, 2 processes" in text
    assert text.count("| yes (") == len(rows)


def test_bench_tp_rejects_sizes_that_do_not_shard():
    with pytest.raises(ValueError, match="multiple of heads"):
        bench_tp.TPBench(dim=10, heads=4)
    with pytest.raises(ValueError, match="world_size"):
        bench_tp.TPBench(heads=3, dim=12).check_world_size(2)


def test_bench_main_tp_flag_adds_the_section(tmp_path, monkeypatch):
    """``--tp`` calls bench_tp.bench with --nproc and --backends and renders its section (bench stubbed)."""
    calls = []
    canned = {
        "world_size": 2, "backends": ["aot_eager"], "settings": bench_tp.dataclasses.asdict(TINY), "torch": "x",
        "ok": True, "wall_s": 1.0, "command": "python -m tools bench --tp --nproc 2",
        "rows": [{"mode": "eager", "backend": None, "error": None, "median_ms": 2.0, "q1_ms": 1.0, "q3_ms": 3.0,
                  "x_eager": 1.0, "cold_ms": 5.0, "captures": 0, "grads_match_eager": True, "max_abs_diff": 0.0}],
    }
    monkeypatch.setattr(bench_tp, "bench", lambda **kw: calls.append(kw) or canned)
    source = tmp_path / "results.json"
    source.write_text(json.dumps({"env": {}, "rows": [], "wall_s": 0.0, "verdicts": {k: {"met": None, "detail": ""} for k in _bench.TARGETS}}))
    monkeypatch.setattr(_bench, "render_markdown", lambda results: "# stub\n")
    code = _bench.main(["--render", str(source), "--tp", "--backends", "aot_eager", "--out-dir", str(tmp_path / "out"), "--no-plot"])
    assert code == 0
    assert calls == [{"world_size": 2, "backends": ("aot_eager",)}]
    text = (tmp_path / "out" / "RESULTS.md").read_text()
    assert "## Tensor-parallel transformer block" in text and "| eager | - | 2.00 |" in text

"""The FSDP2 bench (``bench --fsdp2``): every row timed per round against eager FSDP2 and checked against it."""

from __future__ import annotations

import json

import pytest

from tools.bench import fsdp2 as bench_fsdp2
from tools.bench import main as _bench

TINY = bench_fsdp2.FSDP2Bench(models=("micro", "block_two_tensor"), backends=("aot_eager",), micro_runs=1,
                              warmup=0, reps=2, block=1)


@pytest.fixture(scope="module")
def fsdp2_result() -> dict:
    return bench_fsdp2.bench(2, settings=TINY, timeout_s=240)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.timeout(250)
def test_fsdp2_bench_times_every_mode_per_round_and_matches_eager_fsdp2_bitwise(fsdp2_result):
    rows = fsdp2_result["rows"]
    assert [(r["model"], r["backend"], r["run"]) for r in rows] == [("micro", "aot_eager", 0), ("block_two_tensor", "aot_eager", 0)]
    for row in rows:
        assert set(row["modes"]) == set(bench_fsdp2.MODES), row
        assert row["split_pieces"] >= 3  # the CA graph really was split at FSDP2's hooks
        for name, mode in row["modes"].items():
            assert mode["correct"] and mode["max_abs_diff"] == 0.0, (row["model"], name, mode["problems"])
            assert mode["iqr_ms"][0] <= mode["median_ms"] <= mode["iqr_ms"][1] and mode["median_ms"] > 0
            assert mode["ratio_iqr"][0] <= mode["ratio"] <= mode["ratio_iqr"][1]
        assert row["modes"]["eager"]["ratio"] == 1.0
    assert fsdp2_result["ok"]
    # one micro run is not enough to judge the micro target; no inductor row: the block target is not measured
    assert {k: v["met"] for k, v in fsdp2_result["verdicts"].items()} == {"micro": None, "blocks": None}
    text = bench_fsdp2.markdown_section(fsdp2_result)
    assert "## FSDP2 (fully_shard) training, 2 processes" in text and "--device cuda" in text
    assert text.count("| yes (0.0e+00) |") == 2 * (len(bench_fsdp2.MODES) - 1)


def _row(model: str, backend: str, run: int, ratio: float) -> dict:
    mode = {"median_ms": 1.0, "iqr_ms": (1.0, 1.0), "ratio": ratio, "ratio_iqr": (ratio, ratio), "cold_ms": 1.0,
            "correct": True, "max_abs_diff": 0.0, "problems": []}
    return {"model": model, "backend": backend, "run": run, "label": model, "split_pieces": 4,
            "modes": {"eager": dict(mode, ratio=1.0), "subclass_ca": mode}}


def test_verdicts_judge_the_median_of_three_micro_runs_and_the_worst_inductor_block_row():
    micro = [_row("micro", "aot_eager", i, r) for i, r in enumerate((0.97, 1.04, 0.99))]
    blocks = [_row("block_two_tensor", "inductor", 0, 0.85), _row("block_nf4_lora", "inductor", 0, 0.93)]
    verdicts = bench_fsdp2.verdicts(micro + blocks)
    assert verdicts["micro"]["met"] is True and "0.990x" in verdicts["micro"]["detail"]
    assert verdicts["blocks"]["met"] is False and "block_nf4_lora 0.930x" in verdicts["blocks"]["detail"]
    assert bench_fsdp2.verdicts(micro[:2])["micro"]["met"] is None  # fewer than 3 runs: not judged


def test_fsdp2_bench_settings_validate():
    with pytest.raises(ValueError, match="FSDP2Bench.models: unknown"):
        bench_fsdp2.FSDP2Bench(models=("resnet",))
    with pytest.raises(ValueError, match="FSDP2Bench.reps"):
        bench_fsdp2.FSDP2Bench(reps=0)
    with pytest.raises(ValueError, match="FSDP2Bench.device"):
        bench_fsdp2.FSDP2Bench(device="tpu")
    assert bench_fsdp2.FSDP2Bench(micro_runs=3, backends=("aot_eager", "inductor")).rows()[:3] == [("micro", "aot_eager", i) for i in range(3)]


def test_bench_main_fsdp2_flag_adds_the_section(tmp_path, monkeypatch):
    """``--fsdp2`` calls bench_fsdp2.bench with --nproc, --backends and --device and renders its section (stubbed)."""
    calls = []
    rows = [_row("micro", "aot_eager", i, 1.0) for i in range(3)]
    canned = {"world_size": 2, "settings": bench_fsdp2.dataclasses.asdict(TINY), "torch": "x", "rows": rows,
              "verdicts": bench_fsdp2.verdicts(rows), "ok": True, "wall_s": 1.0, "command": "python -m tools bench --fsdp2 --nproc 2"}
    monkeypatch.setattr(bench_fsdp2, "bench", lambda **kw: calls.append(kw) or canned)
    source = tmp_path / "results.json"
    source.write_text(json.dumps({"env": {}, "rows": [], "wall_s": 0.0, "verdicts": {k: {"met": None, "detail": ""} for k in _bench.TARGETS}}))
    monkeypatch.setattr(_bench, "render_markdown", lambda results: "# stub\n")
    code = _bench.main(["--render", str(source), "--fsdp2", "--backends", "aot_eager", "--out-dir", str(tmp_path / "out"), "--no-plot"])
    assert code == 0
    assert calls[0]["world_size"] == 2 and calls[0]["settings"].backends == ("aot_eager",) and calls[0]["settings"].device == "cpu"
    text = (tmp_path / "out" / "RESULTS.md").read_text()
    assert "## FSDP2 (fully_shard) training, 2 processes" in text and "**met** | 1.000x" in text

"""The runtime-overhead bench: settings validation, verdict logic, and one tiny real run."""

from __future__ import annotations

import pytest

from tools.bench import runtime as bench_runtime


def _stats(median: float) -> dict[str, float]:
    return {"median": median, "q1": median, "q3": median, "min": median, "max": median}


def _result(*, ours_enter: float, ours_rss: int, ours_callables: int = 0, ours_fresh: float | None = None) -> dict:
    soak = [
        {"mode": "stock_ca", "rss_growth_kib": 100, "callable_growth": 0, "capture_growth": 0, "steps": 1000},
        {"mode": "subclass_ca", "rss_growth_kib": ours_rss, "callable_growth": ours_callables, "capture_growth": 0,
         "steps": 1000},
    ]
    enter = {"stock_ca": _stats(5.0), "subclass_ca": _stats(ours_enter), "ratio": ours_enter / 5.0}
    if ours_fresh is not None:
        enter |= {"subclass_ca_fresh": _stats(ours_fresh), "ratio_fresh": ours_fresh / 5.0}
    return {"enter_exit_us": enter, "soak": soak}


def test_verdicts_meet_and_miss_on_the_numbers():
    good = bench_runtime.verdicts(_result(ours_enter=4.0, ours_rss=200, ours_fresh=4.9))
    assert all(v["met"] for v in good.values()), good
    bad = bench_runtime.verdicts(_result(ours_enter=6.0, ours_rss=100 + 257, ours_callables=1, ours_fresh=5.1))
    assert not any(v["met"] for v in bad.values()), bad
    assert "+357 KiB" in bad["soak_rss"]["detail"]
    assert "5.10 (5.10–5.10) vs 5.00 (5.00–5.00)" in bad["enter_exit_fresh"]["detail"]


def test_every_target_has_a_verdict_also_when_the_fresh_row_was_not_measured():
    result = bench_runtime.verdicts(_result(ours_enter=4.0, ours_rss=200))
    assert set(result) == set(bench_runtime.TARGETS)
    assert result["enter_exit_fresh"]["met"] is None


@pytest.mark.parametrize(
    "field, value", [("size", "huge"), ("enter_exit_pairs", 3), ("soak_steps", 50), ("soak_model", "nope")],
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        bench_runtime.RuntimeBench(**{field: value})


def test_a_tiny_run_measures_every_part_and_renders():
    settings = bench_runtime.RuntimeBench(enter_exit_pairs=70, soak_steps=200)
    result = bench_runtime.run(settings)
    enter = result["enter_exit_us"]
    assert all(enter[mode]["median"] > 0 for mode in bench_runtime.ENTER_EXIT_MODES)
    assert set(result["verdicts"]) == set(bench_runtime.TARGETS)
    assert {r["mode"] for r in result["soak"]} == {"stock_ca", "subclass_ca"}
    ours = next(r for r in result["soak"] if r["mode"] == "subclass_ca")
    assert ours["capture_growth"] == 0 and ours["callable_growth"] == 0  # steady after step 100: no recapture
    text = bench_runtime.markdown_section(result)
    assert "## Runtime overhead" in text and "subclass_ca.enable()" in text and "(200 steps)" in text
    assert "a fresh object each time" in text and "construction + enter + exit" in text
    assert f"in {bench_runtime._ROUNDS} interleaved rounds" in text

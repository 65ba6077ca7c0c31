"""The runtime-overhead bench: settings validation, verdict logic, and one tiny real run."""

from __future__ import annotations

import copy

import pytest

from subclass_ca._tools import bench_runtime


def _stats(median: float) -> dict[str, float]:
    return {"median": median, "q1": median, "q3": median, "min": median, "max": median}


def _result(*, ours_enter: float, ours_step: float, ours_rss: int, ours_callables: int = 0) -> dict:
    style = {"stock_ca": _stats(100.0), "subclass_ca": _stats(ours_step), "ratio": ours_step / 100.0,
             "rounds_at_or_below": 1, "rounds": 2}
    soak = [
        {"mode": "stock_ca", "rss_growth_kib": 100, "callable_growth": 0, "capture_growth": 0, "steps": 1000},
        {"mode": "subclass_ca", "rss_growth_kib": ours_rss, "callable_growth": ours_callables, "capture_growth": 0,
         "steps": 1000},
    ]
    return {
        "enter_exit_us": {"stock_ca": _stats(5.0), "subclass_ca": _stats(ours_enter), "ratio": ours_enter / 5.0},
        "styles": [{"model": "pair", "backend": "aot_eager", "per_step": style, "once": copy.deepcopy(style)}],
        "soak": soak,
    }


def test_verdicts_meet_and_miss_on_the_numbers():
    good = bench_runtime.verdicts(_result(ours_enter=4.0, ours_step=99.0, ours_rss=200))
    assert all(v["met"] for v in good.values()), good
    bad = bench_runtime.verdicts(_result(ours_enter=6.0, ours_step=101.0, ours_rss=100 + 257, ours_callables=1))
    assert not any(v["met"] for v in bad.values()), bad
    assert "pair[aot_eager] 1.010" in bad["per_step"]["detail"]


@pytest.mark.parametrize(
    "field, value",
    [("models", ("nope",)), ("size", "huge"), ("rounds", 0), ("soak_steps", 50), ("soak_model", "nope")],
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=field if field != "models" else "unknown models"):
        bench_runtime.RuntimeBench(**{field: value})


def test_a_tiny_run_measures_every_part_and_renders():
    settings = bench_runtime.RuntimeBench(models=("pair",), backends=("aot_eager",), rounds=2, block=2, warmup=1,
                                          enter_exit_pairs=70, soak_steps=200)
    result = bench_runtime.run(settings)
    (row,) = result["styles"]
    for style in ("per_step", "once"):
        assert row[style]["rounds"] == 2
        assert row[style]["stock_ca"]["median"] > 0 and row[style]["subclass_ca"]["median"] > 0
    assert {r["mode"] for r in result["soak"]} == {"stock_ca", "subclass_ca"}
    ours = next(r for r in result["soak"] if r["mode"] == "subclass_ca")
    assert ours["capture_growth"] == 0 and ours["callable_growth"] == 0  # steady after step 100: no recapture
    text = bench_runtime.markdown_section(result)
    assert "## Runtime overhead" in text and "| pair | aot_eager |" in text and "soak" in text

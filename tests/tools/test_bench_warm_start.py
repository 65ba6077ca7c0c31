"""The warm-start bench: fresh processes, per-(model, mode) cache folders, rows, targets and markdown."""

from __future__ import annotations

import pytest

from tools.bench import warm_start as ws


def _sample(first: float, *, digest: str = "d", hit: int = 1, mode: str = "subclass_ca") -> dict:
    timers = {k: 0.1 for k in ws._TIMERS}
    counters = {"aot_hit": hit, "aot_miss": 1 - hit, "aot_bypass": 0}
    return {"model": "pair", "mode": mode, "import_s": 2.0, "forward_s": first / 2, "backward_s": first / 2,
            "first_step_s": first, "steady_step_s": 0.001, "forward_timers": timers, "backward_timers": timers,
            "backward_counters": counters, "grad_digest": digest}


def test_rows_keep_the_first_restart_apart_and_take_the_median_of_the_later_ones():
    row = ws._row("pair/subclass_ca", {"cold": _sample(9.0), "warm": [_sample(4.0), _sample(1.0), _sample(3.0), _sample(2.0)]})
    assert row["cold_first_step_s"] == 9.0 and row["first_restart_s"] == 4.0
    assert row["warm_first_step_s"] == 2.0 and row["warm_spread_s"] == [1.0, 3.0]
    assert row["bitwise"]
    changed = ws._row("pair/subclass_ca", {"cold": _sample(9.0), "warm": [_sample(1.0, digest="other")]})
    assert not changed["bitwise"]


def test_verdicts_compare_subclass_ca_with_compile_only_and_stock_in_the_same_run():
    rows = [ws._row(f"pair/{mode}", {"cold": _sample(cold, mode=mode), "warm": [_sample(warm, mode=mode)]})
            for mode, cold, warm in (("compile", 5.0, 1.0), ("stock_ca", 6.0, 2.5), ("subclass_ca", 5.5, 2.0),
                                     ("subclass_ca_saved", 5.6, 1.2))]
    verdicts = ws._verdicts(rows)
    assert verdicts["vs_compile"]["met"] and verdicts["vs_stock"]["met"] and verdicts["cold"]["met"]
    assert verdicts["pair_1s"]["met"] is False and "1.20 s" in verdicts["pair_1s"]["detail"]
    assert verdicts["first_restart"]["met"] and "pair: 1 hit" in verdicts["first_restart"]["detail"]


def test_a_first_restart_that_compiles_a_ca_graph_misses_its_target_naming_the_row():
    row = ws._row("pair/subclass_ca_saved", {"cold": _sample(5.0, hit=0, mode="subclass_ca_saved"),
                                             "warm": [_sample(3.0, hit=0, mode="subclass_ca_saved"), _sample(1.0, mode="subclass_ca_saved")]})
    verdict = ws._verdicts([row])["first_restart"]
    assert verdict["met"] is False and verdict["detail"] == "pair: 1 miss, 0 bypass"


def test_a_failed_sample_is_a_row_error_not_a_figure():
    row = ws._row("pair/subclass_ca", {"cold": {"model": "pair", "mode": "subclass_ca", "error": ["boom"]}, "warm": []})
    assert row["errors"] == [["boom"]] and row["warm_first_step_s"] is None
    assert "FAILED" in ws.format_summary({"rows": [row], "verdicts": ws._verdicts([row])})


def test_settings_are_validated():
    with pytest.raises(ValueError, match="WarmStartBench.models"):
        ws.WarmStartBench(models=("nope",))
    with pytest.raises(ValueError, match="warm_reps"):
        ws.WarmStartBench(warm_reps=0)
    with pytest.raises(ValueError, match="forward-outside"):  # the FSDP2 row times a whole train step
        ws.WarmStartBench(forward_outside=True)
    assert ws.settings_from_args(["--models", "pair", "--forward-outside"]).forward_outside


def test_a_real_cold_and_warm_process_on_aot_eager_end_to_end():
    results = ws.bench(ws.WarmStartBench(models=("pair",), modes=("subclass_ca",), warm_reps=1, backend="aot_eager"))
    (row,) = results["rows"]
    assert not row["errors"], row["errors"]
    assert row["bitwise"]  # aot_eager: the same aten ops in both processes
    assert row["warm_first_step_s"] > 0 and row["cold_first_step_s"] > 0
    section = ws.markdown_section(results, command="python -m tools bench --warm-start")
    assert "| pair | subclass_ca |" in section and "bench --warm-start" in section
    # where the first step goes: every probe still names a function of this torch and subclass_ca, and the
    # backward's parts are inside it (its capture fakes the inputs; on aot_eager no persistent cache serves a graph,
    # so nothing gets a key by behaviour)
    sample = results["samples"]["pair/subclass_ca"]["warm"][0]
    assert sample["probes_missing"] == []
    parts = sample["backward_parts"]
    assert 0 < parts["capture_begin"] < sample["backward_s"] and 0 < parts["ca_first_call"] < sample["backward_s"]
    assert parts["key"] == 0 and sample["forward_parts"]["key"] == 0
    assert "| pair | subclass_ca | " in section.split("Where the later restarts' first step goes")[1]
    assert "Forward outside the block" not in section
    results["settings"]["forward_outside"] = True
    assert "Forward outside the block" in ws.markdown_section(results)


@pytest.mark.distributed
def test_the_fsdp2_row_runs_two_fresh_gloo_processes_per_sample():
    results = ws.bench(ws.WarmStartBench(models=("fsdp2_two_tensor",), modes=("subclass_ca",), warm_reps=1, backend="aot_eager"))
    (row,) = results["rows"]
    assert not row["errors"], row["errors"]
    assert row["bitwise"] and row["cold_first_step_s"] > 0
    assert "| fsdp2_two_tensor | subclass_ca |" in ws.markdown_section(results, command="bench --warm-start")


def test_a_warm_restart_that_traces_a_ca_graph_misses_the_no_retrace_target():
    def saved(traces: int) -> dict:
        return {**_sample(1.0, mode="subclass_ca_saved"), "backward_dynamo_traces": traces, "backward_replayed": 1 - traces}

    untraced = ws._row("pair/subclass_ca_saved", {"cold": saved(1), "warm": [saved(0), saved(0)]})
    verdict = ws._verdicts([untraced])["no_retrace"]
    assert verdict["met"] and verdict["detail"] == "pair: 0 traced, 1 replayed"
    assert "replayed untraced" in ws._verdicts([untraced])["first_restart"]["detail"]
    traced = ws._row("pair/subclass_ca_saved", {"cold": saved(1), "warm": [saved(0), saved(1)]})
    assert ws._verdicts([traced])["no_retrace"] == {"met": False, "detail": "pair: 1 traced, 0 replayed"}

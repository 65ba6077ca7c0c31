"""The step breakdown: every part measured, the parts adding up to the backward, each mode where it should be."""

from __future__ import annotations

import pytest

from subclass_ca._graph import CompiledCAGraph
from tools.bench import breakdown as bench_breakdown


@pytest.fixture(scope="module")
def result():
    return bench_breakdown.bench(models=("block_pair",), size="small", backend="aot_eager", rounds=3, block=1, warmup=1)


def test_each_mode_has_every_part_and_a_paired_ratio_to_compile_only(result):
    rows = {row["mode"]: row for row in result["rows"]}
    assert set(rows) == set(bench_breakdown.MODES)
    for row in rows.values():
        assert set(bench_breakdown.PARTS) | {"step", "backward"} <= set(row)
        assert row["vs_compile"]["rounds"] == 3
        assert row["step"]["median"] >= row["forward"]["median"] > 0
    assert rows["compile"]["vs_compile"]["ratio"] == 1.0
    # compile-only has no CA graph: its whole backward is the engine; both CA modes spend time in their graph
    assert rows["compile"]["ca_graph"]["median"] == 0.0 and rows["compile"]["enter_exit"]["median"] >= 0.0
    assert rows["compile"]["engine"]["median"] == rows["compile"]["backward"]["median"]
    for mode in ("stock_ca", "subclass_ca"):
        assert rows[mode]["ca_graph"]["median"] > 0.0
        assert 0.0 <= rows[mode]["engine"]["median"] < rows[mode]["backward"]["median"]
    assert rows["stock_ca"]["our_wrapper"]["median"] == 0.0
    assert rows["subclass_ca"]["our_wrapper"]["median"] >= 0.0


def test_the_clocks_are_removed_after_the_run(result):
    assert CompiledCAGraph.__call__.__name__ != "call" and CompiledCAGraph._compile.__name__ == "_compile"


def test_the_markdown_names_the_command_and_every_row(result):
    text = bench_breakdown.markdown_section(result, command="python -m tools bench --breakdown")
    assert "`python -m tools bench --breakdown`" in text
    assert sum(line.startswith("| block_pair |") for line in text.splitlines()) == 3
    assert "block_pair" in bench_breakdown.format_summary(result)

"""``python -m tools versions run``: progress on stderr from the start (stubbed rows: no training)."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from tools.support import table as support_table


def _rows(stream: io.StringIO, seen: list[str]) -> dict:
    def row() -> dict:
        seen.append(stream.getvalue())  # what was printed before this row finished
        return {mode: {"status": "pass", "detail": ""} for mode in support_table.MODES}

    return {"first row": row, "second row": row}


@pytest.mark.parametrize("with_tqdm", [True, False], ids=["tqdm", "plain"])
def test_progress_is_printed_before_the_first_row_finishes(with_tqdm: bool, monkeypatch, tmp_path: Path, capsys):
    if with_tqdm:
        pytest.importorskip("tqdm")
    else:
        monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import -> ImportError: plain lines
    stream, seen = io.StringIO(), []
    lane = support_table.run_lane(tmp_path / "lane.json", rows=_rows(stream, seen), stream=stream)
    assert "versions run: 2 rows x 2 modes" in seen[0]
    assert "first row" in seen[0]  # the row being run is named while it runs
    if not with_tqdm:
        assert "[1/2] first row ..." in seen[0] and "[2/2] second row ..." in seen[1]
    assert capsys.readouterr().out.splitlines() == ["first row: stock=pass, subclass_ca=pass",
                                                   "second row: stock=pass, subclass_ca=pass"]
    assert json.loads((tmp_path / "lane.json").read_text())["rows"] == lane["rows"]


def test_no_progress_prints_nothing_to_stderr(tmp_path: Path, capsys):
    stream, seen = io.StringIO(), []
    support_table.run_lane(tmp_path / "lane.json", rows=_rows(stream, seen), stream=stream, progress=False)
    assert stream.getvalue() == "" and seen == ["", ""]


def test_quick_lane_rows_are_the_training_style_rows():
    assert list(support_table.lane_rows(quick=True)) == list(support_table.EXTRA_ROWS)


def test_a_training_style_row_runs_in_its_own_process_and_reports_its_outcomes():
    name = "retry after a refused capture, cache-miss reasons on"
    outcomes = support_table._isolated_row(name)
    assert set(outcomes) == set(support_table.MODES)
    assert all(cell["status"] in ("pass", "fail", "skip") for cell in outcomes.values())
    assert outcomes == support_table._row_outcomes(name)  # the same row in this process gives the same cells


def test_a_row_process_that_dies_before_reporting_fails_every_mode(monkeypatch):
    class Died:
        returncode, stdout, stderr = -11, "", "Fatal Python error: Segmentation fault"

    monkeypatch.setattr(support_table.subprocess, "run", lambda *a, **k: Died())
    outcomes = support_table._isolated_row("nested jagged tensor through a compiled forward")
    for cell in outcomes.values():
        assert cell["status"] == "fail" and "exited -11 before reporting: Fatal Python error" in cell["detail"]

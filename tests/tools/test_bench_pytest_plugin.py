"""The pytest plugin's cost bench (tools/bench/pytest_plugin.py): its modes and its report (not speed)."""

from __future__ import annotations

from tools.bench import pytest_plugin


def test_the_baseline_disables_the_plugin_and_the_plugin_mode_does_not():
    assert pytest_plugin.MODES["no plugin"][-2:] == ["-p", "no:subclass_ca"]
    assert "no:subclass_ca" not in pytest_plugin.MODES["plugin"]
    assert "import sys, subclass_ca.testing, pytest" in pytest_plugin.MODES["import at start-up"][1]


def test_the_report_judges_plugin_over_no_plugin_against_the_target():
    samples = {"plugin": [2.0, 2.1, 2.05, 2.0, 2.02], "no plugin": [2.0, 2.0, 2.0, 2.0, 2.0],
               "import at start-up": [8.0, 8.2, 8.1, 8.0, 8.3]}
    text = pytest_plugin.report(samples, ["--runs", "5"])
    assert "`python -m tools.bench.pytest_plugin --runs 5`" in text
    assert "| plugin / no plugin | 1.010 [" in text and "| <= 1.10 | **met** |" in text
    assert "| import at start-up / no plugin | 4.050 [" in text
    slow = pytest_plugin.report({**samples, "plugin": [3.0] * 5}, [])
    assert "| plugin / no plugin | 1.500 [1.500–1.500] | <= 1.10 | **missed** |" in slow

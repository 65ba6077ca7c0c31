"""What the tools share: one result shape (tools/common/report.py), one progress display (tools/common/progress.py), public parsers."""

from __future__ import annotations

import ast
import importlib
import inspect
import io
import json
import sys
from pathlib import Path

import pytest

from tools.__main__ import COMMANDS, main, usage
from tools.common import report
from tools.common.progress import Progress

TOOLS = Path(__file__).resolve().parents[2] / "tools"
SECTIONS = ("bench.runtime", "bench.breakdown", "bench.fsdp2", "bench.tp", "bench.warm_start", "fsdp2.parity", "fsdp2.profiling", "fsdp2.cost")
"""Every tool whose results go into a report (Note [One shape for the tools' results])."""


@pytest.mark.parametrize("name", SECTIONS)
def test_every_reporting_tool_has_the_one_section_shape(name: str) -> None:
    module = importlib.import_module(f"tools.{name}")
    assert isinstance(module, report.Section)
    assert isinstance(module.TARGETS, dict)
    parameters = inspect.signature(module.markdown_section).parameters
    assert list(parameters) == [next(iter(parameters)), "command"]
    assert parameters["command"].kind is inspect.Parameter.KEYWORD_ONLY and parameters["command"].default is None
    assert list(inspect.signature(module.format_summary).parameters)[:1] == list(parameters)[:1]


def test_the_bench_renders_its_optional_sections_through_that_shape() -> None:
    from tools.bench import main as bench

    assert all(isinstance(bench.section(key), report.Section) for key in bench.SECTIONS)


def test_targets_table_and_verdict_lines_mark_met_missed_and_unmeasured() -> None:
    targets = {"a": "fast", "b": "small", "c": "cheap"}
    verdicts = {"a": {"met": True, "detail": "1.0x"}, "b": {"met": False, "detail": "2 MiB"}, "c": {"met": None, "detail": "-"}}
    assert report.targets_table(targets, verdicts)[2:] == ["| fast | **met** | 1.0x |", "| small | **missed** | 2 MiB |",
                                                           "| cheap | not measured | - |"]
    assert report.verdict_lines(targets, verdicts, indent="  ") == ["  met    fast: 1.0x", "  MISSED small: 2 MiB",
                                                                      "  n/a    cheap: -"]


def test_write_puts_the_json_and_the_markdown_section_where_asked(tmp_path: Path) -> None:
    from tools.fsdp2 import cost as fsdp2_cost

    result = {"command": "python -m tools fsdp2-cost", "value": 1}
    calls = []

    class Tool:
        TARGETS: dict[str, str] = {}

        @staticmethod
        def markdown_section(result: dict, *, command: str | None = None) -> str:
            calls.append(command)
            return f"## {report.command_of(result, command, 'default')}\n"

        @staticmethod
        def format_summary(result: dict) -> str:
            return ""

        to_json = staticmethod(report.as_json)

    assert isinstance(Tool, report.Section) and isinstance(fsdp2_cost, report.Section)
    report.write(Tool, result, json_path=tmp_path / "r.json", markdown_path=tmp_path / "r.md")
    assert json.loads((tmp_path / "r.json").read_text()) == result
    assert (tmp_path / "r.md").read_text() == "## python -m tools fsdp2-cost\n" and calls == [None]
    report.write(Tool, result)  # neither path: nothing written, nothing rendered
    assert calls == [None]


def _tool_module(path: Path) -> str:
    """``tools/bench/main.py`` -> ``bench.main``: a tool module's name inside ``tools``."""
    return ".".join(path.relative_to(TOOLS).with_suffix("").parts)


TOOL_MODULES = sorted(p for p in TOOLS.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts)


def _private_uses_of_other_tools(path: Path, package: str | None = None) -> list[str]:
    """``from .x import _y`` / ``x._y`` where ``x`` is another tool module: a tool reaching into another's privates.

    ``package`` is the file's package inside ``tools`` (``bench`` for ``tools/bench/main.py``; computed from
    ``path`` when it lies under ``tools/``), which relative imports resolve against.
    """
    tree = ast.parse(path.read_text())
    package = _tool_module(path.parent) if package is None and path.parent != TOOLS else (package or "")
    modules = {_tool_module(p) for p in TOOL_MODULES}
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "tools"):
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1] if package else []
                source = ".".join(filter(None, [*anchor, node.module or ""]))
            else:
                source = (node.module or "").removeprefix("tools").lstrip(".")
            for alias in node.names:
                full = f"{source}.{alias.name}" if source else alias.name
                if full in modules:
                    aliases[alias.asname or alias.name] = full
                elif source in modules and alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"from {source} import {alias.name}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases
                and node.attr.startswith("_") and not node.attr.startswith("__")):
            found.append(f"{aliases[node.value.id]}.{node.attr} (line {node.lineno})")
    return found


@pytest.mark.parametrize("path", TOOL_MODULES, ids=lambda p: str(p.relative_to(TOOLS)))
def test_no_tool_reaches_into_another_tools_private_names(path: Path) -> None:
    assert _private_uses_of_other_tools(path) == []


def test_the_private_use_check_sees_one(tmp_path: Path) -> None:
    """Guard against a vacuous pass: gpu_check calling demo's parser the old, private way."""
    text = (TOOLS / "gpu" / "check.py").read_text().replace("demo.build_parser()", "demo._parser()")
    line = next(i for i, text_line in enumerate(text.splitlines(), 1) if "demo._parser()" in text_line)
    (tmp_path / "check.py").write_text(text)
    assert _private_uses_of_other_tools(tmp_path / "check.py", "gpu") == [f"demo.main._parser (line {line})"]
    (tmp_path / "other.py").write_text("from ..fsdp2.parity import _setup_words\nfrom tools.bench.stats import _private\n")
    assert _private_uses_of_other_tools(tmp_path / "other.py", "bench") == [
        "from fsdp2.parity import _setup_words", "from bench.stats import _private"]
    (tmp_path / "sibling.py").write_text("from . import models\nmodels._cache\n")
    assert _private_uses_of_other_tools(tmp_path / "sibling.py", "bench") == ["bench.models._cache (line 2)"]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_every_command_has_a_public_parser_named_for_python_m_tools(command: str) -> None:
    module = importlib.import_module(COMMANDS[command][0])
    parser = module.build_parser()
    assert parser.prog == f"python -m tools {command}"
    assert callable(module.main) and command in usage()


def test_python_m_tools_dispatches_and_rejects_an_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0 and "gpu-check" in capsys.readouterr().out
    assert main([]) == 2
    assert main(["bogus"]) == 2 and "unknown command 'bogus'" in capsys.readouterr().err


def test_the_package_cli_keeps_only_check_and_points_at_the_tools(capsys: pytest.CaptureFixture[str]) -> None:
    from subclass_ca.__main__ import main as package_main

    assert package_main(["demo", "--quick"]) == 2
    assert "python -m tools demo" in capsys.readouterr().err
    assert package_main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "check" in out and "make demo" in out and "bench " not in out


@pytest.mark.parametrize("with_tqdm", [True, False], ids=["tqdm", "plain"])
def test_progress_names_each_item_as_it_starts(with_tqdm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if with_tqdm:
        pytest.importorskip("tqdm")
    else:
        monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import -> ImportError: plain lines
    stream = io.StringIO()
    with Progress(2, unit="row", stream=stream) as progress:
        assert progress.has_bar is with_tqdm
        progress.start("first")
        progress.update()
        progress.start("second")
        progress.update()
    text = stream.getvalue()
    assert "first" in text and "second" in text
    if not with_tqdm:
        assert text == "[1/2] first ...\n[2/2] second ...\n"


def test_progress_without_a_line_or_disabled_prints_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    for kwargs in ({"line": None}, {"enabled": False}, {"bar": False, "line": None}):
        stream = io.StringIO()
        with Progress(3, stream=stream, **kwargs) as progress:
            progress.start("x")
            progress.update(3)
        assert stream.getvalue() == "", kwargs
    stream = io.StringIO()
    with Progress(1, bar=False, line="  training {name} ...", stream=stream) as progress:  # the demo's --no-progress
        assert not progress.has_bar
        progress.start("pair/eager")
    assert stream.getvalue() == "  training pair/eager ...\n"

"""The one shape of a tool's results: a JSON-able dict, rendered as a markdown section and a plain summary.

Note [One shape for the tools' results]
---------------------------------------
Every tool whose results go into a report (``bench_runtime``, ``bench_fsdp2``, ``bench_tp``,
``bench_warm_start``, ``fsdp2_parity``, ``fsdp2_profile``, ``fsdp2_cost``) is a :class:`Section`:
the module itself provides

* ``TARGETS``: target id -> statement (``{}`` when the tool judges nothing); the result then
  holds ``"verdicts"``: target id -> ``{"met": True | False | None, "detail": str}``;
* ``markdown_section(result, *, command=None) -> str``: its part of a RESULTS.md (``command``
  overrides ``result["command"]``, the command line that produced it);
* ``format_summary(result) -> str``: the same as plain text for the terminal;
* ``to_json(result) -> dict``: what ``results.json`` / ``--json`` holds (:func:`as_json` for
  results that are JSON-able already).

``bench`` renders its optional sections (``--fsdp2``, ``--tp``, ``--warm-start``) through this
shape alone, and the CLIs write ``--json`` / ``--markdown`` with :func:`write`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

__all__ = ["Section", "WITHIN_NOISE", "as_json", "combine", "command_of", "targets_table", "verdict_lines", "write"]

WITHIN_NOISE = "within noise"
"""A verdict neither met nor missed: the run's own spread straddles the target (Note [Verdicts on a shared machine]
in ``tools/common/stats.py``)."""
_MARKS = {True: "**met**", False: "**missed**", None: "not measured", WITHIN_NOISE: "within noise"}
_SCREEN = {True: "met   ", False: "MISSED", None: "n/a   ", WITHIN_NOISE: "noise "}


@runtime_checkable
class Section(Protocol):
    """A tool module's report interface (Note [One shape for the tools' results])."""

    TARGETS: Mapping[str, str]

    def markdown_section(self, result: dict[str, Any], *, command: str | None = None) -> str: ...

    def format_summary(self, result: dict[str, Any]) -> str: ...

    def to_json(self, result: dict[str, Any]) -> dict[str, Any]: ...


def as_json(result: dict[str, Any]) -> dict[str, Any]:
    """``to_json`` of a tool whose results are JSON-able as they are."""
    return result


def combine(judged: list[tuple[bool | str, str]]) -> dict[str, Any]:
    """One target's verdict from its rows' (verdict, description) pairs: missed if any row is, else within
    noise if any row is, else met; the detail counts them and names every row that is not met."""
    if not judged:
        return {"met": None, "detail": "not measured in this run"}
    missed = [text for verdict, text in judged if verdict is False]
    noisy = [text for verdict, text in judged if verdict == WITHIN_NOISE]
    detail = f"{len(judged) - len(missed) - len(noisy)}/{len(judged)} met"
    if noisy:
        detail += f", {len(noisy)} within noise"
    if missed:
        detail += "; missed: " + ", ".join(missed)
    if noisy:
        detail += "; within noise: " + ", ".join(noisy)
    return {"met": False if missed else WITHIN_NOISE if noisy else True, "detail": detail}


def command_of(result: Mapping[str, Any], command: str | None, default: str) -> str:
    """The command line a section names: the caller's, else the result's own, else ``default``."""
    return command or result.get("command") or default


def targets_table(targets: Mapping[str, str], verdicts: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Markdown rows: each target, met / missed / not measured, and its detail."""
    lines = ["| target | verdict | detail |", "|---|---|---|"]
    for key, text in targets.items():
        verdict = verdicts[key]
        lines.append(f"| {text} | {_MARKS[verdict['met']]} | {verdict['detail']} |")
    return lines


def verdict_lines(targets: Mapping[str, str], verdicts: Mapping[str, Mapping[str, Any]], *, indent: str = "") -> list[str]:
    """Plain-text lines: ``met    <target>: <detail>`` (``MISSED``, ``n/a``), one per target that has a verdict."""
    return [f"{indent}{_SCREEN[verdicts[key]['met']]} {text}: {verdicts[key]['detail']}"
            for key, text in targets.items() if key in verdicts]


def write(section: Section, result: dict[str, Any], *, json_path: str | Path | None = None,
          markdown_path: str | Path | None = None, command: str | None = None) -> None:
    """Write ``section.to_json(result)`` to ``json_path`` and its markdown section to ``markdown_path`` (each optional)."""
    if json_path:
        Path(json_path).write_text(json.dumps(section.to_json(result), indent=2, default=str) + "\n")
    if markdown_path:
        Path(markdown_path).write_text(section.markdown_section(result, command=command))

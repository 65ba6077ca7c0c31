"""The torchao certification matrix (docs/torchao.md) from ``python -m subclass_ca check --json`` runs, one per lane.

``make torchao-matrix`` runs, on every torch lane, ``check`` over torchao's training subclasses on
``aot_eager`` and ``inductor`` with ``--compare-stock``, and then this command merges the JSON
reports into one page: a row per (subclass, scenario) that applies, a column per lane and
backend, each cell subclass_ca's verdict beside stock compiled autograd's.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

NOT_APPLICABLE = "does not apply: "
MARKS = {"pass": "✓", "fail": "✗", "skip": "skip"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools torchao-matrix", description=__doc__)
    parser.add_argument("reports", nargs="+", type=Path, help="check --json reports (one per lane)")
    parser.add_argument("--out", type=Path, required=True, help="the markdown page to write")
    parser.add_argument("--command", default="make torchao-matrix", help="the command that produced the reports")
    return parser


def _cell(result: dict[str, Any]) -> str:
    ours = MARKS[result["status"]]
    if result["status"] == "pass" and result.get("max_abs_error"):
        ours += f" {result['max_abs_error']:.0e}"
    stock = result.get("stock_status")
    return ours if stock is None else f"{ours} · stock {MARKS[stock]}"


Cell = tuple[str, str, str]
"""Where a reason applies: (``subclass/scenario``, lane, backend)."""


def _runs(items: list[str], chosen: set[str]) -> list[str]:
    """``chosen`` as runs of consecutive ``items``: ``a-c`` for three or more in a row, each alone otherwise."""
    runs: list[list[str]] = []
    for item in items:
        if item in chosen:
            if runs and items.index(runs[-1][-1]) == items.index(item) - 1:
                runs[-1].append(item)
            else:
                runs.append([item])
    return [f"{run[0]}–{run[-1]}" if len(run) > 2 else ", ".join(run) for run in runs]


def _span(cells: set[tuple[str, str]], lanes: list[str], backends: list[str]) -> str:
    """The lanes and backends of ``cells`` in a few words: lane ranges that share a set of backends."""
    if cells == {(lane, backend) for lane in lanes for backend in backends}:
        return "every lane, both backends" if len(backends) == 2 else "every lane and backend"
    by_backends: dict[tuple[str, ...], set[str]] = {}
    for lane in lanes:
        used = tuple(b for b in backends if (lane, b) in cells)
        if used:
            by_backends.setdefault(used, set()).add(lane)
    parts = []
    for used, chosen in by_backends.items():
        where = "every lane" if chosen == set(lanes) else ", ".join(_runs(lanes, chosen))
        parts.append(f"{where}, {'both backends' if len(used) == 2 == len(backends) else ' and '.join(used)}")
    return "; ".join(parts)


def reason_lines(reasons: dict[str, list[Cell]], lanes: list[str], backends: list[str]) -> list[str]:
    """One bullet per reason: its rows grouped by subclass, each group with the lanes and backends it holds for."""
    lines = []
    for text, where in reasons.items():
        per_row: dict[str, set[tuple[str, str]]] = {}
        for row, lane, backend in where:
            per_row.setdefault(row, set()).add((lane, backend))
        groups: dict[tuple[str, str], list[str]] = {}  # (subclass, span) -> scenarios
        for row, cells in per_row.items():
            subclass, _, scenario = row.partition("/")
            groups.setdefault((subclass, _span(cells, lanes, backends)), []).append(scenario)
        places = [f"{subclass}/{scenarios[0] if len(scenarios) == 1 else '{' + ', '.join(sorted(scenarios)) + '}'} ({span})"
                  for (subclass, span), scenarios in groups.items()]
        cells_count = len(where)
        lines.append(f"- **{text}** ({cells_count} cell{'s' if cells_count != 1 else ''}) — {'; '.join(places)}")
    return lines


def render(reports: list[dict[str, Any]], command: str) -> str:
    """The page: the matrix, then every non-pass cell's reason (first line), so no verdict goes unexplained."""
    reports = sorted(reports, key=lambda r: [int(p) for p in r["torch_version"].split("+")[0].split(".")])
    columns: list[tuple[str, str]] = []
    cells: dict[tuple[str, str], dict[tuple[str, str], dict[str, Any]]] = {}
    reasons: dict[str, list[Cell]] = {}
    for report in reports:
        lane = report["torch_version"].split("+")[0]
        for result in report["results"]:
            if result["status"] == "skip" and result["reason"].startswith(NOT_APPLICABLE):
                continue
            column = (lane, result["backend"])
            if column not in columns:
                columns.append(column)
            row = (result["subclass"], result["scenario"])
            cells.setdefault(row, {})[column] = result
            for who, status, reason in (("subclass_ca", result["status"], result["reason"]),
                                        ("stock", result.get("stock_status"), result.get("stock_reason", ""))):
                if status in ("fail", "skip") and reason:
                    first = reason.strip().splitlines()[0][:240]
                    reasons.setdefault(f"{who} {MARKS[status]}: {first}", []).append(
                        (f"{row[0]}/{row[1]}", lane, result["backend"]))
    versions = sorted({r["subclass_ca_version"] for r in reports})
    lines = [
        "# torchao certification matrix",
        "",
        f"Generated by `{command}` (`python -m subclass_ca check --compare-stock` on every lane; subclass_ca "
        f"{', '.join(versions)}). Each cell: subclass_ca's verdict against eager (✓ with the largest absolute "
        "difference; `✓` alone is bitwise), then stock compiled autograd's on the same program. Scenarios that do "
        "not apply to a subclass are left out; `check` prints why for each.",
        "",
        "| subclass | scenario | " + " | ".join(f"{lane} {backend}" for lane, backend in columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for (subclass, scenario), by_column in sorted(cells.items()):
        lines.append(f"| {subclass} | {scenario} | " + " | ".join(
            _cell(by_column[c]) if c in by_column else "" for c in columns) + " |")
    if reasons:
        lines += ["", "## Why a cell is not ✓", ""]
        lanes = list(dict.fromkeys(lane for lane, _ in columns))
        lines += reason_lines(reasons, lanes, list(dict.fromkeys(backend for _, backend in columns)))
    missing = [f"{r['torch_version']}" for r in reports if not r["results"]]
    if missing:
        lines += ["", f"Lanes with no result: {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    reports = [json.loads(path.read_text()) for path in args.reports]
    args.out.write_text(render(reports, args.command))
    print(f"wrote {args.out} from {len(reports)} report(s)")
    return 0

"""docs/torchao.md's "why a cell is not ✓" list: one bullet per cause, its cells grouped by subclass with lane and
backend ranges (issue 63: one bullet listed 60 cells one by one)."""

from __future__ import annotations

from tools.support.torchao_matrix import render

LANES = ("2.11.0", "2.12.1", "2.13.0", "2.14.1")


def _report(lane: str) -> dict:
    results = []
    for backend in ("aot_eager", "inductor"):
        for scenario in ("hook", "gradient_type"):  # the same known failure everywhere
            results.append({"subclass": "f8", "scenario": scenario, "backend": backend, "status": "skip",
                            "reason": "known failure (torch.compile alone fails the same way)\nmore", "stock_status": "pass"})
        late = lane >= "2.13.0" and backend == "inductor"  # stock fails from 2.13.0 on inductor only
        results.append({"subclass": "int8", "scenario": "module_swap", "backend": backend, "status": "pass",
                        "reason": "", "stock_status": "fail" if late else "pass",
                        "stock_reason": "NotImplementedError: empty_like" if late else ""})
    return {"torch_version": f"{lane}+cpu", "subclass_ca_version": "0.1.0", "results": results}


def test_each_cause_is_one_bullet_with_its_cells_grouped_by_subclass_and_lane_ranges():
    page = render([_report(lane) for lane in reversed(LANES)], "make torchao-matrix")
    bullets = [line for line in page.splitlines() if line.startswith("- **")]
    assert bullets == [
        "- **subclass_ca skip: known failure (torch.compile alone fails the same way)** (16 cells) — "
        "f8/{gradient_type, hook} (every lane, both backends)",
        "- **stock ✗: NotImplementedError: empty_like** (2 cells) — int8/module_swap (2.13.0, 2.14.1, inductor)",
    ]


def test_three_or_more_consecutive_lanes_read_as_a_range():
    reports = [_report(lane) for lane in LANES]
    for report in reports[1:]:  # the stock failure from the second lane on, on both backends
        for result in report["results"]:
            if result["subclass"] == "int8":
                result.update(stock_status="fail", stock_reason="NotImplementedError: empty_like")
    page = render(reports, "make torchao-matrix")
    assert "int8/module_swap (2.12.1–2.14.1, both backends)" in page

"""Issue 21.1 (2): after a registered handler's rebuild raised RebuildError and the handler was
unregistered, the next backward recaptures and equals eager and stock, without ``reset()``.

This is the one parity case with a difference on purpose: stock compiled autograd never
consults subclass_ca's registry, so its first backward works where ours raises RebuildError —
and that failed capture is counted, so ours captures once more than stock.
"""

from __future__ import annotations

import pytest

from ._harness import assert_same_values, run, run_both
from ._scenarios import rebuild_error_then_unregistered

REPORT = [
    pytest.param(False, id="default"),
    pytest.param(True, id="report"),
]


@pytest.mark.parametrize("report", REPORT)
def test_backward_after_rebuild_error_recaptures_without_reset(report):
    stock, ours = run_both(rebuild_error_then_unregistered, report=report)
    eager = run(rebuild_error_then_unregistered, "eager")
    assert stock.error is None and eager.error is None
    if ours.error is not None:
        raise AssertionError(f"subclass_ca raised {ours.error_summary}") from ours.error
    assert stock.values["first"] == eager.values["first"] == "ok"
    assert ours.values["first"].startswith("RebuildError: ") and "handler bug" in ours.values["first"]
    # the failed capture counts: stock captures once, ours fails once then recaptures
    assert (stock.captures, ours.captures) == (1, 2)
    assert (stock.reports, ours.reports) == (0, 1)  # only the recapture reached subclass_ca's compiler
    rest = {key: value for key, value in eager.values.items() if key != "first"}
    for outcome in (stock, ours):
        assert_same_values(rest, {key: outcome.values[key] for key in rest}, what=f"{outcome.mode} vs eager ")

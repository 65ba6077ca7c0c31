"""Stock parity: plain-tensor code behaves under ``subclass_ca.enable()`` exactly as under stock
compiled autograd — the same gradients bitwise (or the same exception), the same number of
captures — and equals eager wherever stock does.  Cases: ``_scenarios.SCENARIOS``."""

from __future__ import annotations

import pytest

from ._harness import check_parity
from ._scenarios import SCENARIOS


@pytest.mark.parametrize("case", [case.param() for case in SCENARIOS])
def test_matches_stock_compiled_autograd(case):
    check_parity(case)

"""Regression: scenario ``param_grad`` — a subclass parameter gets its gradient (plain loss)."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_param_grad_matches_eager(name):
    check_zoo_scenario("param_grad", name)

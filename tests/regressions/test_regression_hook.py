"""Regression: scenario ``hook`` — a tensor hook registered on a subclass leaf parameter."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_hook_matches_eager(name):
    check_zoo_scenario("hook", name)

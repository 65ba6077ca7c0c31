"""Regression: scenario ``activation`` — a subclass intermediate activation inside the compiled region (saved for backward)."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_activation_matches_eager(name):
    check_zoo_scenario("activation", name)

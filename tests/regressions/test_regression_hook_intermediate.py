"""Regression: scenario ``hook_intermediate`` — a tensor hook on a subclass intermediate created inside the compiled region."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_hook_intermediate_matches_eager(name):
    check_zoo_scenario("hook_intermediate", name)

"""Regression: scenario ``optimizer`` — mixed plain + subclass parameters, torch.optim.SGD over 3 steps."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_optimizer_matches_eager(name):
    check_zoo_scenario("optimizer", name)

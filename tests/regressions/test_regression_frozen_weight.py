"""Regression: scenario ``frozen_weight`` — frozen subclass weight with trainable plain neighbours (LoRA-like)."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_frozen_weight_matches_eager(name):
    check_zoo_scenario("frozen_weight", name)

"""Regression: scenario ``dynamic_batch`` — the batch size changes between steps (3, 5, 2)."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_dynamic_batch_matches_eager(name):
    check_zoo_scenario("dynamic_batch", name)


def test_dynamic_batch_pair_has_at_most_one_recompile_per_new_batch():
    result = check_zoo_scenario("dynamic_batch", "pair")
    assert 1 <= result.ca_compiles <= 3

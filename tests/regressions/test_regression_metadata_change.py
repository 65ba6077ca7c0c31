"""Regression: scenario ``metadata_change`` — constant flatten metadata changes between steps (must recompile, never stale)."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_metadata_change_matches_eager(name):
    check_zoo_scenario("metadata_change", name)


def test_tagged_tensor_recompiles_once_per_distinct_tag():
    result = check_zoo_scenario("metadata_change", "tagged")
    assert result.ca_compiles == 2  # tags v1, v2, then v1 again reuses the first graph

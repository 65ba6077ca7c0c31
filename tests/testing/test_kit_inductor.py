"""The kit on inductor: a small subset (2 scenarios x pair and int8); first compiles are slow."""

from __future__ import annotations

import pytest

from subclass_ca.testing import check_subclass
from subclass_ca.testing.specs import ZOO_SPECS

pytestmark = pytest.mark.inductor


@pytest.mark.parametrize("scenario", ["param_grad", "gradient_type"])
@pytest.mark.parametrize("name", ["pair", "int8"])
def test_inductor_matches_eager(name, scenario):
    report = check_subclass(ZOO_SPECS[name], scenarios=[scenario], backends=["inductor"], name=name)
    report.raise_for_failures()
    result = report.results[0]
    assert result.status == "pass" and result.ca_compiles == 1

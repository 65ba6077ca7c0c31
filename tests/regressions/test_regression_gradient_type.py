"""Regression: scenario ``gradient_type`` — the subclass as the gradient (tangent) type: out.backward(make_tensor(g))."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_gradient_type_matches_eager(name):
    check_zoo_scenario("gradient_type", name)

"""Regression: scenario ``autograd_function`` — a custom torch.autograd.Function inside the compiled region."""

from __future__ import annotations

import pytest

from ._zoo import ZOO_NAMES, check_zoo_scenario


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_autograd_function_matches_eager(name):
    check_zoo_scenario("autograd_function", name)

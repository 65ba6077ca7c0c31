"""One helper for the per-scenario regression files: run one scenario on one zoo subclass."""

from __future__ import annotations

import pytest

from subclass_ca.testing import check_subclass
from subclass_ca.testing.specs import ZOO_SPECS

ZOO_NAMES = list(ZOO_SPECS)

#: the only skips a zoo subclass may report (anything else is a failure of the kit or the zoo)
ALLOWED_SKIPS = {
    "metadata_change": "no constant metadata",
    "hook_intermediate": "known failure",
}


def check_zoo_scenario(scenario: str, name: str, backend: str = "aot_eager"):
    """Certify ``scenario`` on zoo subclass ``name``; a legitimate skip is reported as a pytest skip."""
    report = check_subclass(ZOO_SPECS[name], scenarios=[scenario], backends=[backend], name=name)
    report.raise_for_failures()
    result = report.results[0]
    if result.status == "skip":
        allowed = ALLOWED_SKIPS.get(scenario)
        assert allowed is not None and allowed in result.reason, f"unexpected skip of {name}/{scenario}: {result.reason}"
        pytest.skip(f"{name}/{scenario}: {result.reason}")
    assert result.status == "pass"
    assert result.ca_compiles is not None and result.ca_compiles >= 1, "the CA run never captured a backward"
    return result

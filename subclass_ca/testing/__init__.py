"""The testing kit: certify a wrapper subclass under subclass_ca against eager.

* :func:`check_subclass` runs the scenario battery on a factory and returns a :class:`CheckReport`;
* :class:`SubclassCATestSuite` is a pytest base class configured by class attributes;
* the pytest plugin (the ``pytest11`` entry point ``subclass_ca``, a top-level module that imports
  neither torch nor this package until a fixture is used; the fixtures' logic is
  :mod:`subclass_ca.testing.plugin`) adds ``ca_backend``, ``assert_ca_matches_eager`` and
  ``ca_check_subclass`` fixtures;
* ``python -m subclass_ca check`` certifies every registered and zoo subclass from the shell.

See docs/testing_kit.md.
"""

from . import subclasses
from .scenarios import SCENARIOS, Scenario, ScenarioSkip, scenario_names
from .suite import CheckReport, ScenarioResult, SubclassCATestSuite, SubclassSpec, check_subclass, compare_values

__all__ = [
    "check_subclass",
    "CheckReport",
    "ScenarioResult",
    "SubclassSpec",
    "SubclassCATestSuite",
    "compare_values",
    "SCENARIOS",
    "Scenario",
    "ScenarioSkip",
    "scenario_names",
    "subclasses",
]

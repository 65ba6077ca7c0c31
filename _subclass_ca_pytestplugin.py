"""subclass_ca's pytest plugin: the ``pytest11`` entry point ``subclass_ca``, loaded into every pytest run.

Fixtures (docs/testing_kit.md):

* ``ca_backend`` — the backend to certify on: ``--ca-backend`` (default ``aot_eager``).
* ``assert_ca_matches_eager`` — ``assert_ca_matches_eager(fn, *inputs, gradient=None, backend=None, atol=None,
  rtol=None)``: ``fn`` eagerly and under ``torch.compile`` + ``subclass_ca.enable()``, compared
  (:func:`subclass_ca.testing.plugin.ca_matches_eager`).
* ``ca_check_subclass`` — :func:`subclass_ca.testing.check_subclass` defaulting to ``ca_backend``.

Note [A plugin that costs nothing until used]
---------------------------------------------
pytest imports every installed ``pytest11`` entry point at start-up, in every run of the
environment, whether or not a test uses subclass_ca.  Importing anything under ``subclass_ca``
runs the package's ``__init__``, which imports torch (5-7 s), so the entry point is this
top-level module instead (as hypothesis ships ``_hypothesis_pytestplugin``): it imports pytest
only, and each fixture imports subclass_ca (and with it torch) when a test requests it.  The
fixtures' logic lives in :mod:`subclass_ca.testing.plugin`.  tests/testing/test_kit_plugin.py
checks that loading the entry point imports neither; benchmarks/PYTEST_PLUGIN.md measures a
one-test run with and without it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("subclass_ca")
    group.addoption(
        "--ca-backend",
        action="store",
        default="aot_eager",
        help="backend for subclass_ca fixtures (ca_backend, assert_ca_matches_eager); default aot_eager",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "inductor: compiles with the inductor backend (slow first compile)")
    config.addinivalue_line("markers", "cuda: needs a CUDA device (skipped without one)")


@pytest.fixture
def ca_backend(request: pytest.FixtureRequest) -> str:
    """The backend subclass_ca fixtures compile with (``--ca-backend``, default aot_eager)."""
    return str(request.config.getoption("--ca-backend", default="aot_eager") or "aot_eager")


@pytest.fixture
def assert_ca_matches_eager(ca_backend: str) -> Callable[..., dict[str, Any]]:
    """``assert_ca_matches_eager(fn, *inputs, gradient=None, backend=None, atol=None, rtol=None)``."""
    from subclass_ca.testing.plugin import assert_ca_matches_eager_with

    return assert_ca_matches_eager_with(ca_backend)


@pytest.fixture
def ca_check_subclass(ca_backend: str) -> Callable[..., Any]:
    """:func:`subclass_ca.testing.check_subclass` with ``backends=(ca_backend,)`` by default."""
    from subclass_ca.testing.plugin import check_subclass_with

    return check_subclass_with(ca_backend)

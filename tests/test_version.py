"""``subclass_ca.__version__``: public, and the version pip installed (pyproject.toml reads it from ``_version.py``)."""

from __future__ import annotations

import importlib.metadata
import re

import subclass_ca
from subclass_ca import _version


def test_version_is_public_and_is_the_version_module_s():
    assert "__version__" in subclass_ca.__all__
    assert subclass_ca.__version__ == _version.__version__
    assert re.fullmatch(r"\d+\.\d+\.\d+([.-]?\w+)*", subclass_ca.__version__), subclass_ca.__version__


def test_version_matches_the_installed_distribution():
    """The editable install's metadata comes from the same file (make reinstalls when _version.py changes)."""
    assert importlib.metadata.version("subclass_ca") == subclass_ca.__version__

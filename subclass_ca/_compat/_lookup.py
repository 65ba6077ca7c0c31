"""Resolve ``"module:attr.path"`` strings: the one way compat modules reach torch internals."""

from __future__ import annotations

import importlib
import sys
from typing import Any

__all__ = ["lookup"]


def lookup(dotted: str) -> Any:
    """The object at ``"package.module:attr.path"`` (ImportError/AttributeError when missing)."""
    module_name, _, attr_path = dotted.partition(":")
    value: Any = sys.modules.get(module_name) or importlib.import_module(module_name)
    for part in attr_path.split(".") if attr_path else ():
        value = getattr(value, part)
    return value

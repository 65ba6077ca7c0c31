"""Load ``examples/train_tp.py`` (not a package) as a module, once per process."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_tp.py"
_NAME = "subclass_ca_example_train_tp"


def load() -> ModuleType:
    module = sys.modules.get(_NAME)
    if module is None:
        spec = importlib.util.spec_from_file_location(_NAME, SCRIPT)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[_NAME] = module  # dataclasses look their module up by name
        spec.loader.exec_module(module)
    return module

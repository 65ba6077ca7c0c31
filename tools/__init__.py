"""The repository's tools: demo, benchmarks, FSDP2 runs, the support table and the GPU check.

They are not part of the installed package (the wheel holds the library only); run them from a
checkout, from its root, as ``python -m tools COMMAND`` (``python -m tools --help`` lists the
commands) or through ``make`` (``make demo``, ``make bench``, ...).  They may import anything of
``subclass_ca``; nothing in ``subclass_ca`` imports them (tests/test_import_rules.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
"""The checkout: where ``tools`` and (when it is not installed) ``subclass_ca`` are imported from."""


def checkout_env(env: Mapping[str, str] | None = None, *, extra_paths: Iterable[str | os.PathLike[str]] = ()) -> dict[str, str]:
    """``env`` (default ``os.environ``) with the checkout, then ``extra_paths``, first on ``PYTHONPATH``.

    A subprocess started with it imports ``tools`` and ``subclass_ca`` from this checkout whatever
    its working directory, also where subclass_ca is not installed (the GPU check's device).
    """
    env = dict(os.environ if env is None else env)
    paths = [str(ROOT), *map(str, extra_paths), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env

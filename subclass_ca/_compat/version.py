"""Which torch releases subclass_ca supports, and the one parser of torch version strings.

pyproject.toml declares no torch requirement (pip must never manage the user's torch), so this
module is where an unsupported torch is refused: at ``enable()``, with one error naming the torch
found and the releases supported.  A torch *newer* than the tested releases runs, with a warning,
as long as every internal of the feature table is present (``_compat.require_support``); an older
one is refused outright.
"""

from __future__ import annotations

import re

import torch

from ..errors import UnsupportedTorchError

__all__ = [
    "TORCH_VERSION",
    "TESTED_TORCH",
    "SUPPORTED_TORCH",
    "MINIMUM_TORCH",
    "parse_torch_version",
    "release",
    "is_tested",
    "require_minimum",
]

TORCH_VERSION: str = str(torch.__version__)
#: The torch releases the suite runs against (one CI lane each).
TESTED_TORCH: tuple[str, ...] = ("2.11", "2.12", "2.13", "2.14", "2.15")
#: The oldest torch subclass_ca runs on (older ones lack internals it needs).
MINIMUM_TORCH: tuple[int, int] = (2, 11)
#: The supported range, as a version specifier (for messages and tools; pip never sees it).
SUPPORTED_TORCH: str = ">=2.11"

_VERSION = re.compile(r"^\s*(\d+)\.(\d+)(?:\.(\d+))?")


def parse_torch_version(version: str) -> tuple[int, int, int]:
    """``"2.11.0+cu130"`` -> ``(2, 11, 0)``; ``"2.16.0.dev20260101"`` -> ``(2, 16, 0)``.

    Raises ValueError naming the string when it does not start with a release number.
    """
    match = _VERSION.match(str(version))
    if match is None:
        raise ValueError(f"not a torch version: {version!r} (expected e.g. '2.11.0+cu130')")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def release(version: str) -> str:
    """``"2.11.0+cu130"`` -> ``"2.11"``: the release a version belongs to."""
    major, minor, _ = parse_torch_version(version)
    return f"{major}.{minor}"


def is_tested(version: str = TORCH_VERSION) -> bool:
    return release(version) in TESTED_TORCH


def require_minimum(version: str = TORCH_VERSION) -> None:
    """Raise :class:`UnsupportedTorchError` for a torch older than :data:`MINIMUM_TORCH`."""
    if parse_torch_version(version)[:2] < MINIMUM_TORCH:
        raise UnsupportedTorchError(
            f"subclass_ca supports torch {SUPPORTED_TORCH} (tested: {', '.join(TESTED_TORCH)}); found torch {version}. "
            f"Install a supported torch (e.g. pip install torch=={TESTED_TORCH[-1]}.0) in this environment; "
            "installing subclass_ca never changes your torch."
        )

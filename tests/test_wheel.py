"""The wheel holds the library only (issue 38): every module of subclass_ca, its pytest plugin, no tools, no tests.

The plugin is the one top-level module beside the package, ``_subclass_ca_pytestplugin`` (issue 61: an entry
point that imports neither torch nor subclass_ca).

The repository's tools (``tools/``: demo, benchmarks, FSDP2 runs, the support table, the GPU
check) and its tests run from a checkout and are not installed; the package's own command is
``python -m subclass_ca check``.
"""

from __future__ import annotations

import configparser
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = "_subclass_ca_pytestplugin.py"


@pytest.fixture(scope="module")
def wheel_names(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Every file of the wheel built from this checkout (as tests/test_install.py builds it): name -> bytes."""
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                           str(ROOT)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (found,) = out.glob("subclass_ca-*.whl")
    with zipfile.ZipFile(found) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def _dist_info(wheel_names: dict[str, bytes], name: str) -> str:
    (path,) = [n for n in wheel_names if n.endswith(f".dist-info/{name}")]
    return wheel_names[path].decode()


def test_every_module_of_the_package_is_in_the_wheel(wheel_names: dict[str, bytes]) -> None:
    modules = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "subclass_ca").rglob("*.py") if "__pycache__" not in p.parts)
    assert "subclass_ca/distributed.py" in modules and "subclass_ca/testing/plugin.py" in modules
    missing = [m for m in modules if m not in wheel_names]
    assert not missing, f"modules missing from the wheel: {missing}"
    for module in [*modules, PLUGIN]:  # the checkout's source, not a stale copy from an old build/ folder
        assert wheel_names[module] == (ROOT / module).read_bytes(), module


def test_the_wheel_holds_no_tools_and_no_tests(wheel_names: dict[str, bytes]) -> None:
    top_level = {name.split("/")[0] for name in wheel_names if not name.split("/")[0].endswith(".dist-info")}
    assert top_level == {"subclass_ca", PLUGIN}
    assert sorted(_dist_info(wheel_names, "top_level.txt").split()) == ["_subclass_ca_pytestplugin", "subclass_ca"]
    assert not [n for n in wheel_names if "/_tools/" in n or n.startswith(("tools/", "tests/", "benchmarks/", "examples/"))]
    tests = [n for n in wheel_names if Path(n).name.startswith("test_") or Path(n).name == "conftest.py"]
    assert not tests, f"test files in the wheel: {tests}"


def test_the_wheel_declares_the_pytest_plugin_entry_point(wheel_names: dict[str, bytes]) -> None:
    entry_points = configparser.ConfigParser()
    entry_points.read_string(_dist_info(wheel_names, "entry_points.txt"))
    assert dict(entry_points["pytest11"]) == {"subclass_ca": "_subclass_ca_pytestplugin"}
    assert PLUGIN in wheel_names and "subclass_ca/testing/plugin.py" in wheel_names


def test_the_wheel_ships_the_py_typed_marker(wheel_names: dict[str, bytes]) -> None:
    """PEP 561: without the marker, users' type checkers ignore the package's annotations."""
    assert "subclass_ca/py.typed" in wheel_names


def test_the_wheel_carries_the_licence_and_its_metadata(wheel_names: dict[str, bytes]) -> None:
    metadata = _dist_info(wheel_names, "METADATA").splitlines()
    assert "License-Expression: BSD-3-Clause" in metadata
    assert "License-File: LICENSE" in metadata
    assert _dist_info(wheel_names, "licenses/LICENSE") == (ROOT / "LICENSE").read_text()
    assert "BSD 3-Clause License" in (ROOT / "LICENSE").read_text()


def test_the_wheel_version_is_the_package_version(wheel_names: dict[str, bytes]) -> None:
    """One source: pyproject.toml reads the version from subclass_ca/_version.py, which ``__version__`` exposes."""
    from subclass_ca._version import __version__

    (version,) = [line.split(":", 1)[1].strip() for line in _dist_info(wheel_names, "METADATA").splitlines()
                  if line.startswith("Version:")]
    assert version == __version__

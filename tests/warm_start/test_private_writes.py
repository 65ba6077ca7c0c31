"""Every file subclass_ca writes is private and atomic (issue 60, point 2): ``trust.write_private_file``.

A random name beside the target (``O_CREAT|O_EXCL|O_NOFOLLOW``, 0600), removed on failure, then
renamed over it: a link planted at a name that was predictable before (``{path}.tmp{pid}``) is
never followed, nobody else may read what was written, and nothing is left behind.
"""

from __future__ import annotations

import ast
import os
import stat
from pathlib import Path

import pytest

import subclass_ca
from subclass_ca import _compat
from subclass_ca._warm_start import traced, trust

PACKAGE = Path(subclass_ca.__file__).parent


@pytest.fixture
def artifacts(monkeypatch) -> None:
    monkeypatch.setattr(_compat, "save_cache_artifacts", lambda: b"artifacts")


def test_save_cache_never_follows_a_link_planted_at_the_old_temporary_name(tmp_path, artifacts, cache_folder):
    """The old save opened ``{path}.tmp{pid}`` with open(): a link there made the save overwrite the link's target."""
    path = tmp_path / "compile.cache"
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    (tmp_path / f"compile.cache.tmp{os.getpid()}").symlink_to(victim)
    subclass_ca.save_cache(path)
    assert victim.read_bytes() == b"someone else's file"
    assert stat.S_ISREG(os.lstat(path).st_mode) and subclass_ca.load_cache(path).artifact_bytes == len(b"artifacts")


def test_save_cache_writes_a_file_only_its_owner_may_read_whatever_the_umask(tmp_path, artifacts, cache_folder):
    path = tmp_path / "compile.cache"
    previous = os.umask(0o022)
    try:
        subclass_ca.save_cache(path)
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compile.cache", "inductor-cache"]  # no temporary file left


def test_a_failed_save_removes_its_temporary_file_and_keeps_the_old_file(tmp_path, artifacts, cache_folder, monkeypatch):
    path = tmp_path / "compile.cache"
    path.write_bytes(b"the previous checkpoint's file")

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(subclass_ca.CacheFileError, match=f"save_cache\\('{path}'\\): cannot write the file .*No space left"):
        subclass_ca.save_cache(path)
    assert path.read_bytes() == b"the previous checkpoint's file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["compile.cache", "inductor-cache"]


def test_saving_onto_a_directory_is_a_cache_file_error_naming_it(tmp_path, artifacts, cache_folder):
    path = tmp_path / "compile.cache"
    path.mkdir()
    with pytest.raises(subclass_ca.CacheFileError, match=f"save_cache\\('{path}'\\): cannot write the file"):
        subclass_ca.save_cache(path)
    assert list(path.iterdir()) == []


def test_a_kept_trace_replaces_a_link_at_its_name_without_following_it(cache_folder, tmp_path):
    records = cache_folder / traced._SUBDIR
    records.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_bytes(b"someone else's file")
    (records / "graph-a").symlink_to(victim)
    assert traced.write_records({"graph-a": b"record a"}) == 1
    assert victim.read_bytes() == b"someone else's file"
    assert stat.S_ISREG(os.lstat(records / "graph-a").st_mode) and stat.S_IMODE(os.lstat(records / "graph-a").st_mode) == 0o600
    assert traced._find("graph-a") == b"record a"


def test_write_private_file_refuses_nothing_it_should_not_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "file"
    assert trust.write_private_file(target, b"one") and target.read_bytes() == b"one"
    assert not trust.write_private_file(target, b"two", overwrite=False) and target.read_bytes() == b"one"
    assert trust.write_private_file(target, b"three") and target.read_bytes() == b"three"
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and stat.S_IMODE(target.stat().st_mode) == 0o600


def _writes(path: Path) -> list[str]:
    """Calls in ``path`` that create or replace a file some other way than trust.write_private_file."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Call):
            continue
        name = ast.unparse(node.func)
        if name in ("os.replace", "os.rename", "shutil.move", "shutil.copy", "shutil.copyfile") or name.endswith(
                (".write_bytes", ".write_text")):
            found.append(f"{path.name}:{node.lineno}: {name}")
        elif name == "open" and any(isinstance(a, ast.Constant) and isinstance(a.value, str) and set(a.value) & set("wax+")
                                    for a in node.args[1:2]):
            found.append(f"{path.name}:{node.lineno}: open(..., {ast.unparse(node.args[1])})")
        elif name == "os.open" and "O_CREAT" in ast.unparse(node) and path.name != "trust.py":
            found.append(f"{path.name}:{node.lineno}: os.open(O_CREAT)")
    return found


def test_the_warm_start_code_writes_files_through_the_one_helper_only():
    outside = [w for module in sorted((PACKAGE / "_warm_start").glob("*.py")) if module.name != "trust.py" for w in _writes(module)]
    assert outside == []
    tree = ast.parse((PACKAGE / "_warm_start" / "trust.py").read_text())
    creating = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                and any(key in ast.unparse(f) for key in ("os.replace(", "os.link(", "O_CREAT"))}
    assert creating == {"write_private_file"}

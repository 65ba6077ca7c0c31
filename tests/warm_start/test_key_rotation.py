"""A key that may have been copied is rotated, not re-permissioned (issue 60, point 4).

A key file (or its folder) others could read or write is refused with the advice to rotate it:
``python -m subclass_ca cache-key --rotate`` makes a new private key and names the caches to save
again.  After a rotation a file forged with the exposed key is refused; with only a ``chmod 600``
it loaded.  A key folder that is a link or not this user's alone is refused like the key file.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import subclass_ca
from subclass_ca._warm_start import cli, trust
from tests.warm_start.payloads import payload_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def key_path(monkeypatch, tmp_path) -> Path:
    """This user's key file for the test, in a private folder of its own; no key in the environment."""
    folder = tmp_path / "config"
    folder.mkdir(mode=0o700)
    monkeypatch.delenv(trust.KEY_ENV, raising=False)
    monkeypatch.setenv(trust.KEY_FILE_ENV, str(folder / "cache-key"))
    return folder / "cache-key"


def _rotate(key_path: Path, cache_dir: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, trust.KEY_FILE_ENV: str(key_path), "TORCHINDUCTOR_CACHE_DIR": str(cache_dir)}
    env.pop(trust.KEY_ENV, None)
    return subprocess.run([sys.executable, "-m", "subclass_ca", "cache-key", "--rotate"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


def test_a_file_forged_with_a_key_others_could_read_loads_after_chmod_but_not_after_the_advised_rotation(key_path, tmp_path, monkeypatch):
    """The issue's story: the key was readable, someone copied it and signed a file; the user follows the advice."""
    monkeypatch.setattr(subclass_ca._compat, "load_cache_artifacts", lambda data: None)
    exposed = trust.resolve_key()
    key_path.chmod(0o644)
    marker = tmp_path / "PWNED"
    forged = tmp_path / "forged.cache"
    forged.write_bytes(payload_file(marker, exposed))  # signed with the copied key
    with pytest.raises(trust.KeyUnavailable, match=r"readable by others.*rotate the key with python -m subclass_ca cache-key --rotate") as refused:
        subclass_ca.load_cache(forged)
    assert "chmod" not in str(refused.value) and not marker.exists()
    done = _rotate(key_path, tmp_path / "inductor")
    assert done.returncode == 0, done.stdout + done.stderr
    new = trust.resolve_key()
    assert new != exposed and stat.S_IMODE(key_path.stat().st_mode) == 0o600
    assert f"key id {trust.key_id(new)}" in done.stdout and f"key id {trust.key_id(exposed)}" in done.stdout, done.stdout
    assert "save_cache(path) again" in done.stdout and str(tmp_path / "inductor" / "subclass_ca_traced") in done.stdout
    with pytest.raises(subclass_ca.CacheFileError, match=f"signed with another key \\(key id {trust.key_id(exposed)}"):
        subclass_ca.load_cache(forged)
    assert not marker.exists()
    assert sorted(p.name for p in key_path.parent.iterdir()) == ["cache-key"]  # replaced atomically, nothing left over


def test_rotation_counts_the_kept_traces_to_save_again_and_names_an_environment_key(key_path, tmp_path, monkeypatch, capsys):
    records = tmp_path / "traced"
    records.mkdir()
    for name in ("graph-a", "graph-b"):
        (records / name).write_bytes(b"old")
    monkeypatch.setattr(cli, "_records_folder", lambda: str(records))
    monkeypatch.setenv(trust.KEY_ENV, "a" * 32)
    assert cli.main(["--rotate"]) == 0
    out = capsys.readouterr().out
    assert f"kept traces in {records} (2 now)" in out and f"{trust.KEY_ENV} is set here" in out, out
    assert key_path.exists() and stat.S_IMODE(key_path.stat().st_mode) == 0o600


def test_the_command_without_rotate_shows_the_key_file_and_its_id(key_path, capsys):
    assert cli.main([]) == 0
    assert f"{key_path} (key id {trust.key_id(trust.resolve_key())})" in capsys.readouterr().out
    key_path.chmod(0o604)
    assert cli.main([]) == 1
    assert "rotate the key" in capsys.readouterr().out


def test_a_key_folder_that_is_a_link_is_refused_and_rotation_says_where_to_keep_one(tmp_path, monkeypatch, capsys):
    real = tmp_path / "real"
    real.mkdir(mode=0o700)
    (tmp_path / "linked").symlink_to(real)
    monkeypatch.delenv(trust.KEY_ENV, raising=False)
    monkeypatch.setenv(trust.KEY_FILE_ENV, str(tmp_path / "linked" / "cache-key"))
    trust.write_private_file(real / "cache-key", b"k" * 64)  # a good key file, reached through a linked folder
    with pytest.raises(trust.KeyUnavailable, match=f"key folder {tmp_path / 'linked'} is a link or not a folder"):
        trust.resolve_key()
    assert cli.main(["--rotate"]) == 1
    assert "is a link" in capsys.readouterr().out and (real / "cache-key").read_bytes() == b"k" * 64


@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777])
def test_a_key_folder_others_can_write_is_refused(key_path, mode):
    trust.resolve_key()
    key_path.parent.chmod(mode)
    with pytest.raises(trust.KeyUnavailable, match=f"key folder {key_path.parent} is writable by .*chmod 700.*rotate the key"):
        trust.resolve_key()
    key_path.parent.chmod(0o700)
    assert trust.resolve_key()


def test_a_key_folder_of_another_user_is_refused(key_path, monkeypatch):
    trust.resolve_key()
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    with pytest.raises(trust.KeyUnavailable, match=f"key folder {key_path.parent} belongs to another user"):
        trust.resolve_key()

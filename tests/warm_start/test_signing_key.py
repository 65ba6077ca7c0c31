"""``signing_key=`` is the name of the key a cache file is signed with; ``key=``, its spelling before the rename, is a
deprecated alias (issue 63: "key" alone also names lookup keys and handler metadata keys; the glossary in
docs/design.md).  Each call proves which key was used by the file's signature, not by the argument's name."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import subclass_ca
from subclass_ca import _compat
from subclass_ca._warm_start import traced
from tests.warm_start.payloads import OTHER_KEY, records_file

JOB_KEY = b"the job's key, 32 bytes long...."


@pytest.fixture
def loaded_into_torch(monkeypatch) -> list[bytes]:
    """What load_cache hands torch's loader (torch's loader itself is not called)."""
    loaded: list[bytes] = []
    monkeypatch.setattr(_compat, "load_cache_artifacts", loaded.append)
    monkeypatch.setattr(traced, "_records", {})
    return loaded


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    path = tmp_path / "compile.cache"
    path.write_bytes(records_file(JOB_KEY, {"graph-key": b"record"}))
    return path


@pytest.fixture
def artifacts_to_save(monkeypatch, cache_folder) -> None:
    """torch's recorded artifacts, as if this process had compiled (nothing is compiled)."""
    monkeypatch.setattr(_compat, "save_cache_artifacts", lambda: b"artifacts")


def test_load_cache_takes_the_signing_key_as_signing_key_without_a_warning(job_file, loaded_into_torch):
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        assert subclass_ca.load_cache(job_file, signing_key=JOB_KEY).traced_graphs == 1
    assert loaded_into_torch == [b"artifacts"]


def test_load_cache_key_still_works_and_warns_naming_signing_key(job_file, loaded_into_torch):
    with pytest.warns(DeprecationWarning, match=r"load_cache\(key=...\) is deprecated: pass the same key as signing_key="):
        assert subclass_ca.load_cache(job_file, key=JOB_KEY).traced_graphs == 1
    with pytest.warns(DeprecationWarning), pytest.raises(subclass_ca.CacheFileError, match="another key"):
        subclass_ca.load_cache(job_file, key=OTHER_KEY)  # the alias really is the signing key
    assert loaded_into_torch == [b"artifacts"]


def test_load_cache_with_both_spellings_raises_type_error(job_file, loaded_into_torch):
    with pytest.raises(TypeError, match="both signing_key= and key="):
        subclass_ca.load_cache(job_file, signing_key=JOB_KEY, key=JOB_KEY)
    assert loaded_into_torch == []


def test_save_cache_signs_with_signing_key_without_a_warning(tmp_path, artifacts_to_save, loaded_into_torch):
    path = tmp_path / "saved.cache"
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        subclass_ca.save_cache(path, signing_key=JOB_KEY)
    subclass_ca.load_cache(path, signing_key=JOB_KEY)
    with pytest.raises(subclass_ca.CacheFileError, match="another key"):
        subclass_ca.load_cache(path, signing_key=OTHER_KEY)


def test_save_cache_key_still_works_and_warns_naming_signing_key(tmp_path, artifacts_to_save, loaded_into_torch):
    path = tmp_path / "saved.cache"
    with pytest.warns(DeprecationWarning, match=r"save_cache\(key=...\) is deprecated: pass the same key as signing_key="):
        subclass_ca.save_cache(path, key=JOB_KEY)
    subclass_ca.load_cache(path, signing_key=JOB_KEY)  # signed with the key given under its old name
    with pytest.raises(subclass_ca.CacheFileError, match="another key"):
        subclass_ca.load_cache(path, signing_key=OTHER_KEY)


def test_save_cache_with_both_spellings_raises_type_error_and_writes_nothing(tmp_path, artifacts_to_save):
    path = tmp_path / "saved.cache"
    with pytest.raises(TypeError, match="both signing_key= and key="):
        subclass_ca.save_cache(path, signing_key=JOB_KEY, key=JOB_KEY)
    assert not path.exists()

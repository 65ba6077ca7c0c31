"""Only regular files are read back (issue 60, point 3), and a damaged file is always a CacheFileError.

A FIFO at the cache file, at a record's name or at the key file used to block forever (an open
for reading waits for a writer); a directory there raised IsADirectoryError, even with
``strict=False``.  Every file is now opened without blocking or following a link and checked with
``fstat`` first: anything but a regular file is refused with :class:`CacheFileError`, or the one
warning where the job goes on without it.  Each FIFO test runs under ``no_hang``: a regression
fails instead of hanging the suite.
"""

from __future__ import annotations

import os
import pickle
import warnings

import pytest

import subclass_ca
from subclass_ca import _compat
from subclass_ca._warm_start import traced, trust
from tests.cache_worker import assert_matches_eager, copy_cache, run_step, shared_cold_run
from tests.warm_start.payloads import OTHER_KEY, records_file

KINDS = ["fifo", "directory"]


def _make(path, kind: str) -> None:
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.mkdir(mode=0o700)


@pytest.fixture
def loaded_into_torch(monkeypatch) -> list[bytes]:
    loaded: list[bytes] = []
    monkeypatch.setattr(_compat, "load_cache_artifacts", loaded.append)
    monkeypatch.setattr(traced, "_records", {})
    return loaded


@pytest.mark.parametrize("kind", KINDS)
def test_a_cache_file_that_is_not_a_regular_file_is_refused_and_skipped_with_strict_false(tmp_path, kind, no_hang, loaded_into_torch):
    path = tmp_path / "compile.cache"
    _make(path, kind)
    what = r"a FIFO \(named pipe\)" if kind == "fifo" else "a directory"
    with no_hang():
        with pytest.raises(subclass_ca.CacheFileError, match=f"load_cache\\('{path}'\\): the cache file {path} is {what}, not a regular file"):
            subclass_ca.load_cache(path)
        with pytest.raises(subclass_ca.CacheFileError, match="not a regular file"):
            subclass_ca.load_cache(path, missing_ok=True)  # it is there: not a first run
        with pytest.warns(RuntimeWarning, match="not a regular file.*compiles afresh"):
            assert subclass_ca.load_cache(path, strict=False) is None
    assert loaded_into_torch == []


def test_a_cache_file_that_is_a_link_is_not_followed(tmp_path, loaded_into_torch):
    real = tmp_path / "real.cache"
    real.write_bytes(records_file(trust.resolve_key(), {}))
    (tmp_path / "link.cache").symlink_to(real)
    with pytest.raises(subclass_ca.CacheFileError, match="cannot be opened as a plain file.*Replace it with the file itself"):
        subclass_ca.load_cache(tmp_path / "link.cache")
    assert subclass_ca.load_cache(real).artifact_bytes == len(b"artifacts")  # the control: the file itself loads


@pytest.mark.parametrize("kind", KINDS)
def test_a_record_that_is_not_a_regular_file_is_ignored_with_one_warning(cache_folder, kind, no_hang):
    traced.write_records({"graph-b": b"record b"})
    _make(cache_folder / traced._SUBDIR / "graph-a", kind)
    with no_hang(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = [traced._find("graph-a"), traced._find("graph-b"), traced._find("graph-a")]
    assert found == [None, b"record b", None]
    messages = [str(w.message) for w in caught]
    assert [w.category for w in caught] == [subclass_ca.UntrustedCacheWarning], messages
    assert "not a regular file" in messages[0] and str(cache_folder / traced._SUBDIR / "graph-a") in messages[0]


def test_a_directory_at_a_records_name_does_not_fail_the_save(cache_folder, no_hang):
    (cache_folder / traced._SUBDIR).mkdir(mode=0o700)
    (cache_folder / traced._SUBDIR / "graph-a" / "inside").mkdir(parents=True)
    with no_hang(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert traced.write_records({"graph-a": b"record a", "graph-b": b"record b"}) == 1
    assert [w.category for w in caught] == [subclass_ca.UntrustedCacheWarning]
    assert "could not write the kept trace" in str(caught[0].message)
    assert traced._find("graph-b") == b"record b"


@pytest.mark.parametrize("kind", KINDS)
def test_a_key_file_that_is_not_a_regular_file_is_refused_and_the_folder_reader_only_warns(cache_folder, tmp_path, monkeypatch, kind, no_hang):
    key = tmp_path / "keys" / "cache-key"
    key.parent.mkdir(mode=0o700)
    _make(key, kind)
    monkeypatch.delenv(trust.KEY_ENV, raising=False)
    monkeypatch.setenv(trust.KEY_FILE_ENV, str(key))
    (cache_folder / traced._SUBDIR).mkdir(mode=0o700)
    (cache_folder / traced._SUBDIR / "graph-a").write_bytes(b"anything")
    with no_hang():
        with pytest.raises(trust.KeyUnavailable, match=f"cache signing key file {key} is a .*not a regular file"):
            trust.resolve_key()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert traced._find("graph-a") is None
    assert [w.category for w in caught] == [subclass_ca.UntrustedCacheWarning]


# --- a header that lies about sizes, under the opt-in ------------------------------------------


@pytest.mark.parametrize("size", [-1, 10**9, 2**70, True, "9", None, 3.0])
def test_an_out_of_range_artifact_size_is_a_cache_file_error_even_under_the_opt_in(tmp_path, size, loaded_into_torch):
    """Unsigned (or foreign) files are checked only for their checksum under the opt-in: the size is checked too."""
    path = tmp_path / "crafted.cache"
    for signing_key in (None, OTHER_KEY):
        path.write_bytes(records_file(signing_key, {"k": b"v"}, header={"artifact_bytes": size}))
        with pytest.raises(subclass_ca.CacheFileError, match="damaged"):
            subclass_ca.load_cache(path, trust_unsigned_code=True)
        with pytest.warns(RuntimeWarning, match="damaged.*compiles afresh"):
            assert subclass_ca.load_cache(path, trust_unsigned_code=True, strict=False) is None
    assert loaded_into_torch == []


@pytest.mark.parametrize("records", [b"", b"\x80\x04", pickle.dumps({"k": b"v"})[:-3], b"not a pickle", pickle.dumps(["a list"])])
def test_records_that_cannot_be_read_are_a_cache_file_error_even_under_the_opt_in(tmp_path, records, loaded_into_torch):
    """A size that points into the artifacts leaves a truncated pickle: EOFError / UnpicklingError before; CacheFileError now."""
    path = tmp_path / "crafted.cache"
    import hashlib
    import json

    from subclass_ca._warm_start import files as cache

    payload = b"artifacts" + records
    header = {**cache._header(), "artifact_bytes": len(b"artifacts"), "sha256": hashlib.sha256(payload).hexdigest()}
    path.write_bytes(cache._MAGIC + json.dumps(header).encode() + b"\n" + payload)
    with pytest.raises(subclass_ca.CacheFileError, match="damaged"):
        subclass_ca.load_cache(path, trust_unsigned_code=True)
    with pytest.warns(RuntimeWarning, match="damaged"):
        assert subclass_ca.load_cache(path, trust_unsigned_code=True, strict=False) is None


# --- end to end: a restart with a FIFO where a record was ---------------------------------------

needs_replay = pytest.mark.skipif(not (_compat.marked_cacheable_supported() and _compat.precompile_supported()),
                                  reason="this torch cannot cache CA graphs or replay a Dynamo trace")


@pytest.mark.inductor
@needs_replay
def test_a_restart_with_a_fifo_at_a_records_name_traces_afresh_instead_of_hanging(tmp_path_factory, tmp_path):
    """The restart's first backward used to block forever in the record's open(); now it warns once and traces."""
    folder, _ = shared_cold_run(tmp_path_factory, "pair-tanh", save=None)
    restart_folder = copy_cache(folder, tmp_path / "job", traces=True)
    records = sorted((restart_folder / traced._SUBDIR).iterdir())
    assert records
    for record in records:
        record.unlink()
        os.mkfifo(record, 0o600)
    restart = run_step(restart_folder)  # a hang is a TimeoutExpired failure after run_step's timeout
    assert restart["traced"]["replayed"] == 0 and restart["ca_traces"] == 1, restart
    assert len(restart["untrusted_warnings"]) == 1 and "not a regular file" in restart["untrusted_warnings"][0], restart
    assert_matches_eager(restart)

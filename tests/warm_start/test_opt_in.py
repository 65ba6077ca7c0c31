"""``load_cache(..., trust_unsigned_code=True)`` ends with its call (issue 60, point 1).

What the opt-in let in is replayed by this process only: ``save_cache()`` never signs it into this
user's cache folder, and ``save_cache(path)`` never into a file, so a later plain run never reads
it.  A record is signed only if this process made it, or its file verified under the signing key;
the controls show that such records still travel (the restart chain of tests/test_cache.py).
"""

from __future__ import annotations

import pickle

import pytest

import subclass_ca
from subclass_ca import _compat
from subclass_ca._compat import caches as torch_caches
from subclass_ca._warm_start import files, traced, trust
from tests.warm_start.payloads import OTHER_KEY, Payload, records_file

JOB_KEY = "the job's shared secret, 32 chars or more"


@pytest.fixture
def torch_io(monkeypatch) -> list[bytes]:
    """torch's side of a cache file, stubbed: what load_cache hands torch, and what save_cache gets from it."""
    loaded: list[bytes] = []
    monkeypatch.setattr(_compat, "load_cache_artifacts", loaded.append)
    monkeypatch.setattr(_compat, "save_cache_artifacts", lambda: b"artifacts")
    return loaded


def _saved_records(path) -> dict[str, bytes]:
    """The records a plain load of ``path`` (this user's key, no opt-in) would let in, read without keeping them."""
    kept = dict(traced._records)
    try:
        traced._records.clear()
        subclass_ca.load_cache(path)
        return {key: record.data for key, record in traced._records.items()}
    finally:
        traced._records.clear()
        traced._records.update(kept)


def test_records_let_in_by_the_opt_in_are_used_here_but_never_signed_into_the_cache_folder(cache_folder, tmp_path, torch_io, marker):
    foreign = tmp_path / "foreign.cache"
    planted = pickle.dumps(Payload(marker))  # a kept trace is unpickled when installed: code
    foreign.write_bytes(records_file(OTHER_KEY, {"graph-a": planted}))
    assert subclass_ca.load_cache(foreign, trust_unsigned_code=True).traced_graphs == 1
    assert traced._find("graph-a") == planted  # this process replays it: the opt-in's purpose
    saved = subclass_ca.save_cache()
    records = cache_folder / traced._SUBDIR
    assert not (records / "graph-a").exists(), "the opt-in's record was signed into this user's folder"
    assert saved.traced_graphs == 0
    traced._records.clear()  # a later plain run of another program: nothing of it in the folder
    assert traced._find("graph-a") is None and not marker.exists()


def test_records_let_in_by_the_opt_in_are_never_signed_into_a_saved_file(cache_folder, tmp_path, torch_io):
    foreign = tmp_path / "foreign.cache"
    foreign.write_bytes(records_file(None, {"graph-a": b"unsigned record"}))  # unsigned, as issue 52's file
    subclass_ca.load_cache(foreign, trust_unsigned_code=True)
    saved = subclass_ca.save_cache(tmp_path / "mine.cache")
    assert saved.traced_graphs == 0
    assert _saved_records(tmp_path / "mine.cache") == {}  # signed with this user's key, but without the record


def test_a_file_that_verifies_under_the_signing_key_is_signed_again_and_under_another_key_is_not(cache_folder, tmp_path, torch_io, monkeypatch):
    """The control: this user's own file travels on (a checkpoint chain); a job's file only under the job's key."""
    mine, jobs = tmp_path / "mine.cache", tmp_path / "job.cache"
    mine.write_bytes(records_file(trust.resolve_key(), {"graph-mine": b"my record"}))
    jobs.write_bytes(records_file(JOB_KEY.encode(), {"graph-job": b"the job's record"}))
    subclass_ca.load_cache(mine)
    subclass_ca.load_cache(jobs, signing_key=JOB_KEY)
    assert subclass_ca.save_cache(tmp_path / "again.cache").traced_graphs == 1
    assert _saved_records(tmp_path / "again.cache") == {"graph-mine": b"my record"}
    assert sorted(p.name for p in (cache_folder / traced._SUBDIR).iterdir()) == ["graph-mine"]
    assert subclass_ca.save_cache(tmp_path / "job-again.cache", signing_key=JOB_KEY).traced_graphs == 1  # the job's key: the job's record
    traced._records.clear()
    assert subclass_ca.load_cache(tmp_path / "job-again.cache", signing_key=JOB_KEY).traced_graphs == 1
    assert traced._find("graph-job") == b"the job's record"


def test_the_opt_in_on_a_file_that_does_verify_counts_as_verified(cache_folder, tmp_path, torch_io):
    mine = tmp_path / "mine.cache"
    mine.write_bytes(records_file(trust.resolve_key(), {"graph-mine": b"my record"}))
    subclass_ca.load_cache(mine, trust_unsigned_code=True)
    assert subclass_ca.save_cache(tmp_path / "again.cache").traced_graphs == 1


def test_this_processs_own_record_replaces_one_the_opt_in_let_in(cache_folder, tmp_path, torch_io, monkeypatch):
    """A graph this process compiled itself (its record made here) is signed, even under a key the opt-in's file took."""
    foreign = tmp_path / "foreign.cache"
    foreign.write_bytes(records_file(OTHER_KEY, {"graph-a": b"foreign record"}))
    subclass_ca.load_cache(foreign, trust_unsigned_code=True)
    monkeypatch.setattr(_compat, "recorded_frame", lambda package: b"own record")
    traced._pending["graph-a"] = object()  # compiled here, with a recording
    assert subclass_ca.save_cache(tmp_path / "mine.cache").traced_graphs == 1
    assert _saved_records(tmp_path / "mine.cache") == {"graph-a": b"own record"}
    assert (cache_folder / traced._SUBDIR / "graph-a").exists()


@pytest.fixture
def marker(tmp_path):
    return tmp_path / "PWNED"


def _mega_cache(*entries: tuple[str, bytes]) -> bytes:
    """torch's mega-cache format holding inductor artifacts (key, content), as save_cache_artifacts() returns it."""
    from torch.compiler._cache import CacheArtifactFactory, _serialize_single_cache
    from torch.utils._appending_byte_serializer import AppendingByteSerializer

    serializer = AppendingByteSerializer(serialize_fn=_serialize_single_cache)
    serializer.extend([("inductor", [CacheArtifactFactory.create("inductor", key, content) for key, content in entries])])
    return bytes(serializer.to_bytes())


def test_torchs_artifacts_let_in_by_the_opt_in_are_left_out_of_a_saved_file(cache_folder, tmp_path, monkeypatch):
    """torch records an entry again when this process reads it: the file save_cache(path) signs leaves those out."""
    monkeypatch.setattr(files, "_unverified_artifacts", set())
    monkeypatch.setattr(_compat, "load_cache_artifacts", lambda data: None)  # torch's caches untouched by the test
    foreign = tmp_path / "foreign.cache"
    foreign.write_bytes(records_file(OTHER_KEY, {}, artifacts=_mega_cache(("foreign-entry", b"their kernel"))))
    subclass_ca.load_cache(foreign, trust_unsigned_code=True)
    monkeypatch.setattr(_compat, "save_cache_artifacts", lambda: _mega_cache(("foreign-entry", b"their kernel"), ("own-entry", b"my kernel")))
    subclass_ca.save_cache(tmp_path / "mine.cache")
    saved = (tmp_path / "mine.cache").read_bytes()
    header, payload = files._parse(str(tmp_path / "mine.cache"), saved, None, False)[:2]
    assert torch_caches.artifact_ids(payload[:header["artifact_bytes"]]) == {("inductor", "own-entry")}
    mine = tmp_path / "verified.cache"  # the control: a file of this user's own is no opt-in, and its entries travel on
    monkeypatch.setattr(files, "_unverified_artifacts", set())
    mine.write_bytes(records_file(trust.resolve_key(), {}, artifacts=_mega_cache(("mine-entry", b"k"))))
    subclass_ca.load_cache(mine, trust_unsigned_code=True)
    assert files._unverified_artifacts == set()

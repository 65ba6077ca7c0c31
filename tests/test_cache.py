"""save_cache / load_cache: a cache file travels with a checkpoint; a damaged or foreign one is refused."""

from __future__ import annotations

import pytest

import subclass_ca
from subclass_ca import _compat
from subclass_ca._warm_start import files as cache
from tests.cache_worker import assert_matches_eager, copy_cache, run_step, shared_cold_run

needs_cache_hooks = pytest.mark.skipif(
    not _compat.marked_cacheable_supported(), reason="this torch has no AOTAutogradCache allowlist"
)


def assert_ca_graph_not_compiled(result: dict) -> None:
    """The restart's CA graph came from what the earlier run kept: its Dynamo trace where torch can replay one
    (Note [Skipping Dynamo's trace of an unchanged CA graph]: no trace, no AOTAutogradCache lookup), else the cache."""
    ca = result["ca"]
    assert ca["aot_miss"] == 0 and ca["fx_miss"] == 0, ca
    if _compat.precompile_supported():
        assert result["traced"]["replayed"] == 1 and result["ca_traces"] == 0 and ca["aot_hit"] == 0, result
    else:
        assert ca["aot_hit"] == 1, ca


@pytest.mark.inductor
@needs_cache_hooks
def test_a_saved_cache_warms_a_process_with_an_empty_cache_folder(tmp_path_factory, tmp_path):
    """Each run ships its file to the next machine (an empty cache folder), as a job saving with its checkpoints does.

    The first restart takes its forward from the file, and the CA graph captured from that forward
    is the one the cold run compiled and saved (Note [One CA graph for fresh and cached forwards]):
    nothing compiles again, from the first restart on.
    """
    _, first = shared_cold_run(tmp_path_factory, "pair-relu-file", save="compile.cache", activation="relu")
    assert first["saved_bytes"] > 0 and first["forward_entries_written"] == 1
    assert first["traced_graphs_saved"] == (1 if _compat.precompile_supported() else 0), first
    second = run_step(tmp_path / "job-2", load=first["saved_path"], save=str(tmp_path / "after-2.cache"), activation="relu")
    assert second["loaded"] and second["forward"]["aot_hit"] == 1, second["forward"]
    assert_ca_graph_not_compiled(second)
    third = run_step(tmp_path / "job-3", load=str(tmp_path / "after-2.cache"), activation="relu")
    assert third["forward"]["aot_hit"] == 1 and third["forward"]["aot_miss"] == 0, third["forward"]
    assert_ca_graph_not_compiled(third)
    assert second["grads"] == first["grads"] and third["grads"] == first["grads"]


@pytest.mark.inductor
@needs_cache_hooks
@pytest.mark.skipif(not _compat.precompile_supported(), reason="this torch cannot replay a Dynamo trace")
def test_a_kept_trace_whose_guards_refuse_the_restart_is_traced_again(tmp_path_factory, tmp_path):
    """A restart in another global state (here torch's thread count, which Dynamo guards): the kept trace is
    installed on the same CA graph, its guards refuse the call, and Dynamo traces it as without one.
    """
    folder, _ = shared_cold_run(tmp_path_factory, "pair-tanh", save=None)  # a cold run that kept its traces
    other = run_step(copy_cache(folder, tmp_path / "job", traces=True), threads=2)
    assert other["traced"]["replayed"] == 1 and other["ca_traces"] == 1, other
    assert other["untrusted_warnings"] == []  # this user's own folder and record: trusted (the control of test_trust.py)
    assert_matches_eager(other)


@pytest.mark.inductor
@needs_cache_hooks
def test_a_forward_compiled_outside_the_block_is_saved_and_found_by_behaviour(tmp_path_factory, tmp_path):
    """Note [Forwards compiled outside a block]: ``loss = step(...)`` outside, ``loss.backward()`` inside.  The cold
    run's ``save_cache(path)`` writes that forward's entry under its behaviour key and marks torch's key; a restart
    from the file, or from the folder, finds it and compiles nothing again.  The same program under another build of
    the code its subclass dispatch reaches (our build's digest is in every behaviour key) finds the marker, misses
    the entry and compiles afresh: never stale."""
    folder, first = shared_cold_run(tmp_path_factory, "pair-tanh-outside", save="outside.cache", forward_outside=True)
    assert first["forward"]["aot_miss"] == 1 and first["forward_entries_written"] == 1, first
    from_file = run_step(tmp_path / "job-file", load=first["saved_path"], forward_outside=True)
    from_folder = run_step(copy_cache(folder, tmp_path / "job-folder", traces=True), forward_outside=True)
    for restart in (from_file, from_folder):
        assert restart["forward"]["aot_hit"] == 1 and restart["forward"]["aot_miss"] == 0, restart["forward"]
        assert_ca_graph_not_compiled(restart)
        assert restart["grads"] == first["grads"]
        assert_matches_eager(restart)
    other_build = run_step(copy_cache(folder, tmp_path / "job-other", traces=True), forward_outside=True,
                           package="another subclass_ca build")
    assert other_build["forward"]["aot_hit"] == 0 and other_build["forward"]["aot_miss"] == 1, other_build["forward"]
    assert_matches_eager(other_build)
    without_marker = run_step(copy_cache(folder, tmp_path / "job-unmarked", traces=False), forward_outside=True)
    assert without_marker["forward"]["aot_hit"] == 0, without_marker["forward"]  # torch's own key: no entry under it


@pytest.mark.inductor
@needs_cache_hooks
def test_a_strict_restart_from_a_cached_forward_rebuilds_float64_gradients(tmp_path):
    """A cached forward has no fake values: strict checks what it still knows instead of assuming float32 on the CPU.

    Before, the restart's strict recipe expected the default dtype and refused every float64
    gradient (UnsupportedSubclassError on the first backward of the restarted job).
    """
    first = run_step(tmp_path / "job-1", save=str(tmp_path / "after-1.cache"), strict=True, dtype="float64")
    second = run_step(tmp_path / "job-2", load=str(tmp_path / "after-1.cache"), strict=True, dtype="float64")
    assert second["forward"]["aot_hit"] == 1, second["forward"]
    assert second["grads"] == first["grads"]
    assert_matches_eager(second)


@pytest.fixture
def loaded_into_torch(monkeypatch) -> list[bytes]:
    """What load_cache hands torch's loader (torch's loader itself is not called)."""
    loaded: list[bytes] = []
    monkeypatch.setattr(_compat, "load_cache_artifacts", loaded.append)
    return loaded


def _write(path, header: dict, artifacts: bytes = b"artifacts", records: dict | None = None) -> None:
    """A file as save_cache writes it (signed with this user's key), with ``header`` and ``records``."""
    import hashlib
    import pickle

    from subclass_ca._warm_start import trust

    payload = artifacts + pickle.dumps(records or {})
    header = {"sha256": hashlib.sha256(payload).hexdigest(), "artifact_bytes": len(artifacts), **header}
    path.write_bytes(cache._encode(trust.resolve_key(), header, payload))


def test_a_file_of_another_torch_build_is_refused_naming_both_builds(tmp_path):
    path = tmp_path / "old.cache"
    _write(path, {**cache._header(), "torch": "2.12.0"})
    with pytest.raises(subclass_ca.CacheFileError, match=r"torch '2.12.0'.*this process.*strict=False"):
        subclass_ca.load_cache(path)


def test_a_file_of_another_subclass_ca_build_is_refused(tmp_path):
    path = tmp_path / "old.cache"
    _write(path, {**cache._header(), "subclass_ca": "subclass_ca 0.0.1 deadbeef"})
    with pytest.raises(subclass_ca.CacheFileError, match="subclass_ca 'subclass_ca 0.0.1 deadbeef'"):
        subclass_ca.load_cache(path)


def test_a_damaged_file_is_refused_before_anything_is_loaded(tmp_path, loaded_into_torch):
    loaded = loaded_into_torch
    path = tmp_path / "damaged.cache"
    _write(path, cache._header(), b"artifacts")
    path.write_bytes(path.read_bytes()[:-3] + b"XYZ")  # payload no longer matches its checksum
    with pytest.raises(subclass_ca.CacheFileError, match="damaged"):
        subclass_ca.load_cache(path)
    path.write_bytes(cache._MAGIC + b"{not json\n" + b"artifacts")
    with pytest.raises(subclass_ca.CacheFileError, match="not signed"):
        subclass_ca.load_cache(path)
    assert loaded == []


def test_a_file_that_is_not_ours_is_refused(tmp_path):
    path = tmp_path / "other.bin"
    path.write_bytes(b"\x80\x04some pickle")
    with pytest.raises(subclass_ca.CacheFileError, match="not a subclass_ca cache file"):
        subclass_ca.load_cache(path)


def test_strict_false_skips_a_bad_file_with_a_warning(tmp_path, loaded_into_torch):
    loaded = loaded_into_torch
    path = tmp_path / "other.bin"
    path.write_bytes(b"junk")
    with pytest.warns(RuntimeWarning, match="compiles afresh"):
        assert subclass_ca.load_cache(path, strict=False) is None
    assert loaded == []


def test_a_good_file_reaches_torch_and_reports_what_it_held(tmp_path, loaded_into_torch):
    loaded = loaded_into_torch
    path = tmp_path / "good.cache"
    _write(path, cache._header(), b"artifacts")
    info = subclass_ca.load_cache(path)
    assert loaded == [b"artifacts"]
    assert info.artifact_bytes == len(b"artifacts") and info.torch_version == _compat.TORCH_VERSION
    assert info.traced_graphs == 0


def test_the_kept_traces_of_a_file_are_found_before_the_cache_folder(tmp_path, loaded_into_torch, monkeypatch):
    from subclass_ca._warm_start import traced

    monkeypatch.setattr(traced, "_records", {})
    path = tmp_path / "good.cache"
    _write(path, cache._header(), b"artifacts", records={"graph-key": b"recorded frame"})
    info = subclass_ca.load_cache(path)
    assert info.traced_graphs == 1 and loaded_into_torch == [b"artifacts"]
    assert traced._find("graph-key") == b"recorded frame" and traced._find("other-key") is None


def test_missing_ok_returns_none_for_a_first_run(tmp_path):
    assert subclass_ca.load_cache(tmp_path / "absent.cache", missing_ok=True) is None
    with pytest.raises(FileNotFoundError):
        subclass_ca.load_cache(tmp_path / "absent.cache")


def test_saving_before_anything_compiled_says_when_to_call_it(tmp_path, monkeypatch):
    monkeypatch.setattr(_compat, "save_cache_artifacts", lambda: None)
    with pytest.raises(subclass_ca.CacheFileError, match="after the first steps"):
        subclass_ca.save_cache(tmp_path / "x.cache")
    assert not (tmp_path / "x.cache").exists()


def test_saving_on_a_torch_that_cannot_cache_ca_graphs_says_so(monkeypatch):
    """torch 2.11/2.12 (no cache-key hook for a graph's globals): the save warms forwards only, and says so."""
    monkeypatch.setattr(_compat, "marked_cacheable_supported", lambda: False)
    with pytest.warns(RuntimeWarning, match=r"cannot cache compiled-autograd graphs.*traces and compiles each CA graph again"):
        subclass_ca.save_cache()


@needs_cache_hooks
def test_saving_on_a_torch_that_caches_ca_graphs_does_not_warn():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        subclass_ca.save_cache()

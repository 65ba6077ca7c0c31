"""Warm start through torch's caches (Note [Warm start through torch's caches]): each run is a fresh process.

One cold run fills a cache folder; every other run shares it.  A run like the cold one must
take its CA graph from AOTAutogradCache with gradients bitwise equal to the cold run's; a run
that changes anything the CA graph's behaviour depends on must miss and still match eager.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from subclass_ca import _compat
from subclass_ca._warm_start import fingerprint
from subclass_ca._warm_start import keys as _keys
from tests.cache_worker import assert_matches_eager, copy_cache, run_step, shared_cold_run

pytestmark = [
    pytest.mark.inductor,
    pytest.mark.skipif(not _compat.marked_cacheable_supported(), reason="this torch has no AOTAutogradCache allowlist"),
]

@pytest.fixture
def warm_cache(tmp_path_factory, tmp_path) -> tuple[Path, dict]:
    """The shared cold run's folder (its kept traces left out: these tests are about AOTAutogradCache entries)."""
    folder, cold = shared_cold_run(tmp_path_factory, "pair-tanh", save=None)
    return copy_cache(folder, tmp_path / "cache", traces=False), cold


def test_cold_run_saves_its_ca_graph_instead_of_bypassing_the_cache(warm_cache):
    _, cold = warm_cache
    assert cold["ca"]["aot_bypass"] == 0, cold["ca"]
    assert cold["ca"]["aot_saved"] == 1, cold["ca"]
    assert_matches_eager(cold)
    assert cold["grad_types"] == ["PairTensor", "PairTensor"]


def test_warm_run_takes_the_ca_graph_from_the_cache_bitwise_equal_to_the_cold_run(warm_cache):
    cache_dir, cold = warm_cache
    warm = run_step(cache_dir)
    assert warm["ca"]["aot_hit"] == 1 and warm["ca"]["aot_miss"] == 0, warm["ca"]
    assert warm["grads"] == cold["grads"]
    assert warm["grad_types"] == cold["grad_types"]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param({"handler": "custom"}, id="handler"),
        pytest.param({"dtype": "float64"}, id="dtype"),
        pytest.param({"batch": 5}, id="shape"),
        pytest.param({"torch_version": "2.99.0"}, id="torch-version"),
        pytest.param({"package": "subclass_ca 9.9.9 0123456789ab"}, id="subclass_ca-version"),
    ],
)
def test_a_change_the_ca_graph_depends_on_misses_the_cache_and_still_matches_eager(warm_cache, change):
    cache_dir, _ = warm_cache
    changed = run_step(cache_dir, **change)
    assert changed["ca"]["aot_hit"] == 0 and changed["ca"]["aot_miss"] == 1, changed["ca"]
    assert_matches_eager(changed)


def test_a_changed_flatten_context_misses_and_the_same_one_hits(tmp_path):
    first = run_step(tmp_path, subclass="tagged", tag="a")
    other = run_step(tmp_path, subclass="tagged", tag="b")
    again = run_step(tmp_path, subclass="tagged", tag="a")
    assert other["ca"]["aot_hit"] == 0 and other["ca"]["aot_miss"] == 1, other["ca"]
    assert_matches_eager(other)
    assert other["grad_types"] == ["TaggedTensor", "TaggedTensor"]
    assert again["ca"]["aot_hit"] == 1, again["ca"]
    assert again["grads"] == first["grads"]


def test_an_object_without_a_stable_description_keys_by_this_process_only():
    class Opaque:  # its only text is its address
        pass

    key = _keys._stable("a test object", lambda: _keys.describe(Opaque()))
    assert key.startswith("process-local ") and fingerprint.NONCE in key
    assert "a test object" in fingerprint.uncacheable_reasons()


def test_custom_cpp_functions_are_never_described():
    class Op:  # the shape of compiled autograd's ops: numbered per process when custom
        __module__ = _compat.CA_OPS_MODULE
        __name__ = "CppNodeMyFunction0"
        is_custom_function = True

    assert _compat.ca_op_name(Op()) == ("CppNodeMyFunction0", True)
    assert _keys.key_of(Op()) is None


def test_damaged_entries_in_the_cache_folder_recompile_cleanly(warm_cache):
    cache_dir, _ = warm_cache
    entries = [p for p in cache_dir.rglob("*") if p.is_file() and "aotautograd" in p.parts]
    assert entries, "the cold run wrote no AOTAutogradCache entry"
    for path in entries:
        path.write_bytes(b"\x80\x04damaged" + bytes(range(64)))
    damaged = run_step(cache_dir)
    assert damaged["ca"]["aot_hit"] == 0, damaged["ca"]
    assert_matches_eager(damaged)
    assert damaged["grad_types"] == ["PairTensor", "PairTensor"]

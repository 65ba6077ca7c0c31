"""A compile cache runs only what this user wrote (Note [Trusting a compile cache], issue 52).

Every refusal is shown with a payload that would leave a marker file if anything unpickled it:
the marker's absence proves no code ran, and the opt-in and the controls (this user's own file
and folder) show that the same payload does run, or that a real record still replays, when it
is trusted.  The end-to-end restarts are in fresh processes (tests/cache_worker.py); the
two-rank job is a real ``torchrun``.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import stat
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca._warm_start import files as cache
from subclass_ca._warm_start import traced, trust
from subclass_ca.distributed import free_port
from tests.cache_worker import assert_matches_eager, copy_cache, run_step, shared_cold_run
from tests.warm_start.payloads import OTHER_KEY, Payload, records_file
from tests.warm_start.payloads import payload_file as _payload_file

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def marker(tmp_path: Path) -> Path:
    return tmp_path / "PWNED"


@pytest.fixture
def loaded_into_torch(monkeypatch) -> list[bytes]:
    """What load_cache hands torch's loader (torch's loader itself is not called)."""
    loaded: list[bytes] = []
    monkeypatch.setattr(_compat, "load_cache_artifacts", loaded.append)
    monkeypatch.setattr(traced, "_records", {})
    return loaded


# --- cache files ---------------------------------------------------------------------------


def test_the_crafted_file_of_issue_52_is_refused_in_a_fresh_process_and_runs_no_code(tmp_path, marker):
    """The issue's recipe, run by a victim process as the docs tell users to: refused, no marker; strict=False only warns."""
    path = tmp_path / "compile.cache"
    path.write_bytes(_payload_file(marker, None))
    victim = (
        "import sys, warnings, subclass_ca\n"
        "try:\n"
        f"    subclass_ca.load_cache({str(path)!r})\n"
        "except subclass_ca.CacheFileError as error:\n"
        "    print('REFUSED', error)\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        f"    print('SKIPPED', subclass_ca.load_cache({str(path)!r}, strict=False), [str(w.message) for w in caught])\n"
    )
    done = subprocess.run([sys.executable, "-c", victim], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED" in done.stdout and "not signed" in done.stdout and "trust_unsigned_code=True" in done.stdout, done.stdout
    assert "SKIPPED None" in done.stdout and "compiles afresh" in done.stdout, done.stdout
    assert not marker.exists() and not (tmp_path / "PWNED").exists()


def test_a_crafted_file_with_a_forged_signature_line_is_refused(tmp_path, marker, loaded_into_torch):
    path = tmp_path / "compile.cache"
    forged = _payload_file(marker, b"the attacker's own key, 32 bytes")
    mine = trust.key_id(trust.resolve_key()).encode()
    signer = forged.split(b"\n")[1].split(b" ")[1]
    path.write_bytes(forged.replace(signer, mine, 1))  # claims to be signed with this user's key
    with pytest.raises(subclass_ca.CacheFileError, match="changed after it was written"):
        subclass_ca.load_cache(path)
    assert not marker.exists() and loaded_into_torch == []


def test_a_file_signed_with_another_key_is_refused_and_the_opt_in_loads_it(tmp_path, marker, loaded_into_torch):
    path = tmp_path / "compile.cache"
    path.write_bytes(_payload_file(marker, OTHER_KEY))
    with pytest.raises(subclass_ca.CacheFileError, match=r"signed with another key \(key id \w+; yours is \w+\).*trust_unsigned_code=True"):
        subclass_ca.load_cache(path)
    with pytest.warns(RuntimeWarning, match="another key"):
        assert subclass_ca.load_cache(path, strict=False) is None
    assert not marker.exists() and loaded_into_torch == []
    info = subclass_ca.load_cache(path, trust_unsigned_code=True)  # the opt-in: it loads, and so runs the code
    assert marker.exists() and info is not None and info.traced_graphs == 1 and loaded_into_torch == [b""]


def test_a_file_signed_with_the_jobs_key_loads_with_that_key_from_the_argument_or_the_environment(tmp_path, monkeypatch, loaded_into_torch):
    path = tmp_path / "compile.cache"
    path.write_bytes(records_file(OTHER_KEY, {"graph-key": b"record"}))
    assert subclass_ca.load_cache(path, signing_key=OTHER_KEY).traced_graphs == 1
    monkeypatch.setenv(trust.KEY_ENV, OTHER_KEY.decode())
    assert subclass_ca.load_cache(path).traced_graphs == 1
    assert loaded_into_torch == [b"artifacts", b"artifacts"]
    with pytest.raises(subclass_ca.CacheFileError, match="another key"):
        subclass_ca.load_cache(path, signing_key="yet another key, of 32 characters or more")


def test_one_flipped_byte_anywhere_is_refused_before_anything_is_unpickled(tmp_path, marker, loaded_into_torch):
    """Every byte of a signed file (magic, signature line, header, artifacts, records), flipped alone, is refused."""
    path = tmp_path / "compile.cache"
    good = _payload_file(marker, trust.resolve_key())
    for index in range(len(good)):
        damaged = bytearray(good)
        damaged[index] ^= 0x01
        path.write_bytes(bytes(damaged))
        with pytest.raises(subclass_ca.CacheFileError):
            subclass_ca.load_cache(path)
    assert not marker.exists() and loaded_into_torch == []
    path.write_bytes(good)  # the control: the unflipped file is this user's, and loads (running its payload)
    subclass_ca.load_cache(path)
    assert marker.exists()


def test_a_key_shorter_than_128_bits_is_refused_naming_its_source_and_how_to_make_one(monkeypatch, tmp_path):
    """16 hex characters are 64 bits: refused from the environment (issue 60), as from signing_key=; 32 hex characters or 16 bytes pass."""
    with pytest.raises(subclass_ca.CacheFileError, match="signing_key=: .*at least 128 bits"):
        subclass_ca.load_cache(tmp_path / "x.cache", signing_key="short")
    with pytest.raises(subclass_ca.CacheFileError, match="signing_key=: .*at least 128 bits"):
        trust.resolve_key(b"15 bytes, short")
    assert trust.resolve_key(b"16 bytes exactly") == b"16 bytes exactly"
    monkeypatch.setenv(trust.KEY_ENV, "0123456789abcdef")  # 16 characters: the old minimum
    with pytest.raises(subclass_ca.CacheFileError, match=f"{trust.KEY_ENV}: .*at least 128 bits.*32 hex characters") as refused:
        trust.resolve_key()
    assert 'python -c "import secrets; print(secrets.token_hex(32))"' in str(refused.value)
    monkeypatch.setenv(trust.KEY_ENV, "0123456789abcdef" * 2)
    assert trust.resolve_key() == b"0123456789abcdef" * 2


# --- the key file --------------------------------------------------------------------------


def test_the_default_key_is_made_once_per_user_with_owner_only_permissions(monkeypatch, tmp_path):
    monkeypatch.delenv(trust.KEY_ENV, raising=False)
    monkeypatch.delenv(trust.KEY_FILE_ENV, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    first = trust.resolve_key()
    path = tmp_path / "config" / "subclass_ca" / "cache-key"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert trust.resolve_key() == first and len(first) >= 32
    assert [p.name for p in path.parent.iterdir()] == ["cache-key"]  # no temporary file left behind


def test_a_key_file_others_can_read_or_write_is_refused_like_an_ssh_key(monkeypatch, tmp_path):
    """Refused with the advice to rotate it (a copy may exist), never to chmod it back (issue 60)."""
    path = tmp_path / "cache-key"
    monkeypatch.delenv(trust.KEY_ENV, raising=False)
    monkeypatch.setenv(trust.KEY_FILE_ENV, str(path))
    trust.resolve_key()
    for mode in (0o644, 0o640, 0o620):
        path.chmod(mode)
        with pytest.raises(subclass_ca.CacheFileError, match=f"{path} is (readable|writable) by .*rotate the key with "
                                                             "python -m subclass_ca cache-key --rotate") as refused:
            trust.resolve_key()
        assert "chmod" not in str(refused.value)
    path.chmod(0o600)
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)  # the file now belongs to someone else
    with pytest.raises(subclass_ca.CacheFileError, match="belongs to another user"):
        trust.resolve_key()


# --- the cache folder ----------------------------------------------------------------------


def _plant(folder: Path, name: str, data: bytes, mode: int = 0o600) -> None:
    records = folder / traced._SUBDIR
    records.mkdir(mode=0o700, exist_ok=True)
    (records / name).write_bytes(data)
    (records / name).chmod(mode)


def _find_all(*keys: str) -> tuple[list[bytes | None], list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = [traced._find(key) for key in keys]
    return found, [str(w.message) for w in caught if issubclass(w.category, subclass_ca.UntrustedCacheWarning)]


def test_this_users_own_records_in_this_users_folder_are_read(cache_folder):
    assert traced.write_records({"graph-a": b"record a", "graph-b": b"record b"}) == 2
    assert traced.write_records({"graph-a": b"record a"}) == 0  # already there
    found, warned = _find_all("graph-a", "graph-b", "graph-c")
    assert found == [b"record a", b"record b", None] and warned == []
    records = cache_folder / traced._SUBDIR
    assert stat.S_IMODE(records.stat().st_mode) == 0o700
    assert stat.S_IMODE((records / "graph-a").stat().st_mode) == 0o600


@pytest.mark.parametrize("writable", ["records folder 0777", "records folder 0770", "cache folder 0777", "record 0666"])
def test_a_folder_or_record_others_can_write_is_not_read_and_says_so_once(cache_folder, writable):
    traced.write_records({"graph-a": b"record a", "graph-b": b"record b"})  # signed with this user's key
    what, mode = writable.rsplit(" ", 1)
    target = {"records folder": cache_folder / traced._SUBDIR, "cache folder": cache_folder,
              "record": cache_folder / traced._SUBDIR / "graph-a"}[what]
    target.chmod(int(mode, 8))
    found, warned = _find_all("graph-a", "graph-b", "graph-a")
    if what == "record":
        assert found == [None, b"record b", None], found
        assert len(warned) == 1 and "writable by others" in warned[0] and "delete" in warned[0], warned
    else:
        assert found == [None, None, None], found
        assert len(warned) == 1 and str(cache_folder / traced._SUBDIR) in warned[0], warned
        assert "chmod go-w" in warned[0] and "TORCHINDUCTOR_CACHE_DIR" in warned[0], warned
    assert traced.write_records({"graph-c": b"c"}) == (1 if what == "record" else 0)  # never written where never read


def test_a_folder_of_another_user_is_not_read(cache_folder, monkeypatch):
    traced.write_records({"graph-a": b"record a"})
    monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 4242)
    found, warned = _find_all("graph-a")
    assert found == [None] and len(warned) == 1 and "belongs to another user" in warned[0], warned


def test_a_record_signed_with_another_key_or_under_another_name_is_ignored_with_one_warning(cache_folder, marker):
    payload = pickle.dumps(Payload(marker))
    _plant(cache_folder, "graph-a", traced._sealed(OTHER_KEY, "graph-a", payload))
    _plant(cache_folder, "graph-b", payload)  # unsigned
    mine = trust.resolve_key()
    _plant(cache_folder, "graph-c", traced._sealed(mine, "graph-other", payload))  # this user's record, moved to another name
    found, warned = _find_all("graph-a", "graph-b", "graph-c")
    assert found == [None, None, None] and len(warned) == 1, warned
    assert "not signed with your key" in warned[0] and "SUBCLASS_CA_CACHE_KEY" in warned[0], warned
    assert not marker.exists()


def test_a_record_that_is_a_link_is_not_followed(cache_folder, tmp_path):
    traced.write_records({"graph-a": b"record a"})
    elsewhere = tmp_path / "elsewhere"
    (cache_folder / traced._SUBDIR / "graph-a").rename(elsewhere)
    (cache_folder / traced._SUBDIR / "graph-a").symlink_to(elsewhere)
    found, warned = _find_all("graph-a")
    assert found == [None] and len(warned) == 1 and "plain file" in warned[0], warned


def test_a_records_folder_planted_by_someone_else_is_replaced_by_nothing_we_write(cache_folder):
    """``save_cache()`` never writes its records where they would not be read (here: a 0777 folder someone made)."""
    (cache_folder / traced._SUBDIR).mkdir(mode=0o777)
    (cache_folder / traced._SUBDIR).chmod(0o777)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert traced.write_records({"graph-a": b"record a"}) == 0
    assert [w.category for w in caught] == [subclass_ca.UntrustedCacheWarning]
    assert list((cache_folder / traced._SUBDIR).iterdir()) == []


# --- end to end, in fresh processes ---------------------------------------------------------

needs_cache_hooks = pytest.mark.skipif(not _compat.marked_cacheable_supported(), reason="this torch has no AOTAutogradCache allowlist")
needs_precompile = pytest.mark.skipif(not _compat.precompile_supported(), reason="this torch cannot replay a Dynamo trace")


def _replace_records(folder: Path, data_for) -> int:
    records = sorted((folder / traced._SUBDIR).iterdir())
    for record in records:
        record.write_bytes(data_for(record.name))
    return len(records)


@pytest.mark.inductor
@needs_cache_hooks
@needs_precompile
@pytest.mark.parametrize("planted", ["folder 0777, record of this user's key", "own folder, record of another key"])
def test_a_planted_record_never_runs_in_a_restart(tmp_path_factory, tmp_path, marker, planted):
    """Issue 52's folder attack: run 1's kept traces replaced by code; the restart never runs it, warns once,
    traces afresh and matches eager.  The control, an untouched copy of the same cold run's folder replaying its
    kept trace with no warning, is tests/test_cache.py::test_a_kept_trace_whose_guards_refuse_the_restart_is_traced_again
    (and every form of the never-stale chains' run 3)."""
    folder, _ = shared_cold_run(tmp_path_factory, "pair-tanh", save=None)
    payload = pickle.dumps(Payload(marker))
    attacked = copy_cache(folder, tmp_path / "attacked", traces=True)
    if planted.startswith("own folder"):
        assert _replace_records(attacked, lambda name: traced._sealed(OTHER_KEY, name, payload)) >= 1
    else:
        assert _replace_records(attacked, lambda name: traced._sealed(trust.resolve_key(), name, payload)) >= 1
        (attacked / traced._SUBDIR).chmod(0o777)
    restart = run_step(attacked)
    assert not marker.exists(), "a planted record ran"
    assert restart["traced"]["replayed"] == 0 and restart["ca_traces"] == 1, restart
    assert len(restart["untrusted_warnings"]) == 1, restart["untrusted_warnings"]
    assert_matches_eager(restart)


RANK_SCRIPT = """
import json, os, sys
import subclass_ca
path = sys.argv[1]
loaded = subclass_ca.load_cache(path)
try:
    subclass_ca.load_cache(path, signing_key="not the job's key, 32 characters or more")
    wrong = "loaded"
except subclass_ca.CacheFileError as error:
    wrong = str(error)
print(json.dumps({"rank": int(os.environ["RANK"]), "traced_graphs": loaded.traced_graphs,
                  "artifact_bytes": loaded.artifact_bytes, "wrong_key": wrong}))
"""


@pytest.mark.distributed
@pytest.mark.inductor
@needs_cache_hooks
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_a_two_rank_torchrun_job_sharing_a_key_through_the_environment_loads_one_file_on_both_ranks(tmp_path_factory, tmp_path):
    """The job's key (SUBCLASS_CA_CACHE_KEY, as any secret a launcher passes) signs the file and opens it on every rank;
    each rank's own user key file (empty folders here) plays no part, and another key is refused."""
    _, saved = shared_cold_run(tmp_path_factory, "pair-relu-file", save="compile.cache", activation="relu")
    job_key = "the job's shared secret: 0123456789abcdef"
    source = Path(saved["saved_path"])
    signed, _ = cache._check_signature(str(source), source.read_bytes(), None, False)  # this user's file, re-signed for the job
    header, _, payload = signed.partition(b"\n")
    shared_file = tmp_path / "compile.cache"
    shared_file.write_bytes(cache._encode(job_key.encode(), json.loads(header), payload))
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, trust.KEY_ENV: job_key, trust.KEY_FILE_ENV: str(tmp_path / "no-user-key" / "cache-key"),
           "OMP_NUM_THREADS": "1", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1", str(script), str(shared_file)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    decoder = json.JSONDecoder()  # the ranks share torchrun's stdout: one rank's line may run into the other's
    ranks = sorted((decoder.raw_decode(done.stdout, found.start())[0] for found in re.finditer(r'\{"rank"', done.stdout)),
                   key=lambda r: r["rank"])
    assert [r["rank"] for r in ranks] == [0, 1], done.stdout
    for rank in ranks:
        assert rank["artifact_bytes"] == saved["saved_bytes"] and rank["traced_graphs"] == saved["traced_graphs_saved"], rank
        assert "signed with another key" in rank["wrong_key"], rank
    assert not (tmp_path / "no-user-key").exists()  # the environment's key was used; no user key was made


def test_a_key_file_that_is_a_link_is_refused_and_the_folder_reader_only_warns(cache_folder, monkeypatch, tmp_path):
    target = tmp_path / "real-key"
    target.write_text("a key of at least sixteen characters")
    target.chmod(0o600)
    link = tmp_path / "linked-key"
    link.symlink_to(target)
    monkeypatch.delenv(trust.KEY_ENV, raising=False)
    monkeypatch.setenv(trust.KEY_FILE_ENV, str(link))
    with pytest.raises(trust.KeyUnavailable, match="cannot be opened as a plain file"):
        trust.resolve_key()
    _plant(cache_folder, "graph-a", b"anything")
    found, warned = _find_all("graph-a", "graph-a")  # a compile never fails for it: no record, one warning
    assert found == [None, None] and len(warned) == 1 and "neither read nor written" in warned[0], warned

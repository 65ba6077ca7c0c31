"""A restarted process never runs a stale compiled backward, and an unchanged one still replays (issue 44).

Each chain: run 1 compiles every ``knobs`` type under every program with the "bug" (``scale=2.0``)
into a cache (one run 1, shared); runs 2 and 3 use the "fix" (``scale=1.0``, another installed
version) with that cache, for about half the (program, type) pairs (``cases``), in one of three
forms: torch's cache folder alone; ``save_cache(path)``/``load_cache(path)`` into an empty folder;
``save_cache()``'s kept traces in the folder.  Run 2's gradients must equal run 2's eager (a
stale entry would give run 1's), and run 3, unchanged from run 2, must hit the cache (a fix that
never caches fails here).  Programs: a compiled forward, an eager forward, a compiled train step
that calls ``loss.backward()`` itself (its CA graph is compiled by the step's own compiler, which
torch never caches: there only the forward entries ``save_cache()`` writes can replay), and on the
default lane a stack of blocks compiled one by one (its CA graph runs as regional pieces, each
distinct piece with its own cache entry).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from filelock import FileLock

from subclass_ca import _compat
from tests.warm_start.knobs_package import TYPES, write_package

WORKER = Path(__file__).with_name("stale_worker.py")
# Each of the nine indirections changes the key in process (tests/test_keys.py); these restart chains show
# that every form and program uses that key.  On the default lane: every program, one indirection of each kind
# of reach (another module's function, a closure's hidden object, dispatch, an upgraded package); on the other
# lanes (Note [The lane suite] in tests/conftest.py) three of them in the two programs whose CA graphs
# subclass_ca caches, to stay inside CI's time.
FULL = os.environ.get("SUBCLASS_CA_SUITE", "full") == "full"
PROGRAMS = ("compiled", "eager", "step", "regional") if FULL else ("compiled", "eager")
CHECKED = ("FuncPair", "ClosurePair", "DispatchPair", "UpgradePair") if FULL else ("FuncPair", "DispatchPair", "UpgradePair")
FORMS = ("folder", "file", "traced")
assert set(CHECKED) <= set(TYPES)


def cases(form: str) -> list[tuple[str, str]]:
    """The (program, type) pairs whose runs 2 and 3 one form checks: each program with about half the types.

    Rotated over the forms so that every program meets every type, and every form every program
    and every type, in some chain; run 1 compiles every pair, so each is stale in every form that
    checks it.  (Every pair in every form costs twice the processes' time, for no other reach.)
    """
    per_program = (len(CHECKED) + 1) // 2
    stride = len(CHECKED) // per_program
    shift = FORMS.index(form)
    return [(program, CHECKED[(p + shift + k * stride) % len(CHECKED)])
            for p, program in enumerate(PROGRAMS) for k in range(per_program)]


def test_the_forms_together_check_every_pair_and_each_form_every_program_and_type():
    checked = [cases(form) for form in FORMS]
    assert {pair for form in checked for pair in form} == {(p, t) for p in PROGRAMS for t in CHECKED}
    for form in checked:
        assert {p for p, _ in form} == set(PROGRAMS) and {t for _, t in form} == set(CHECKED), form

pytestmark = [
    pytest.mark.inductor,
    pytest.mark.slow,
    pytest.mark.skipif(not _compat.marked_cacheable_supported(), reason="this torch cannot cache CA graphs at all"),
]


def _run(cache_dir: Path, package: Path, checked: list[tuple[str, str]] | None = None, **settings) -> dict:
    """One worker process over ``checked`` (every program with every type when None)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    request = {"package": str(package), "programs": PROGRAMS, "types": CHECKED, "cases": checked, **settings}
    done = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(request)],
        env=env, capture_output=True, text=True, timeout=600, cwd=Path(__file__).parents[2],
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _assert_eager(result: dict, checked: list[tuple[str, str]], *, run: str) -> None:
    assert sorted(result["types"]) == sorted(f"{program} {name}" for program, name in checked)
    for case, grads in result["types"].items():
        torch.testing.assert_close(
            torch.tensor(grads["grad"]), torch.tensor(grads["eager"]), rtol=1e-5, atol=1e-5,
            msg=lambda m, case=case: f"{run}: {case} differs from this process's eager (a stale compile?): {m}",
        )


def _shared_root(tmp_path_factory) -> Path:
    """One folder for the whole session, shared by pytest-xdist's workers (their temp roots have one parent)."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "never_stale"
    root.mkdir(parents=True, exist_ok=True)
    return root


@pytest.fixture(scope="module")
def packages(tmp_path_factory):
    root = _shared_root(tmp_path_factory) / "knobs"
    with FileLock(str(root) + ".lock"):
        if not (root / "done").exists():
            write_package(root / "bug", scale=2.0, version="1.0"), write_package(root / "fix", scale=1.0, version="2.0")
            (root / "done").touch()
    return root / "bug", root / "fix"


@pytest.fixture(scope="module")
def first_run(tmp_path_factory, packages):
    """Run 1 (the bug): its cache folder with AOT entries and kept traces, and its cache file.

    Made once per session, whichever worker asks first (every test only copies it): run 1 compiles every type."""
    root = _shared_root(tmp_path_factory) / "first"
    with FileLock(str(root) + ".lock"):
        if not (root / "result.json").exists():
            result = _run(root / "cache", packages[0], save=str(root / "bug.bin"))
            (root / "result.json").write_text(json.dumps(result))
    result = json.loads((root / "result.json").read_text())
    wrong = [c for c, g in result["types"].items() if not torch.allclose(torch.tensor(g["grad"]), torch.tensor(g["eager"]))]
    # the bug shows in every type whose knob eager never runs: run 2 can tell a stale hit from a fresh compile
    expected = {f"{program} {name}" for program in PROGRAMS for name in CHECKED if name != "DispatchPair"}
    assert expected <= set(wrong), sorted(expected - set(wrong))
    assert all(hits == replayed == 0 for _, _, hits, replayed in result.get("regional", {}).values()), result["regional"]  # run 1 is cold
    return root


def _folder_for(form: str, first: Path, tmp_path: Path) -> tuple[Path, dict]:
    cache = tmp_path / "cache"
    if form == "folder":  # torch's folder as run 1 left it, without the kept traces save_cache() added
        shutil.copytree(first / "cache", cache, ignore=shutil.ignore_patterns("subclass_ca_traced"))
        return cache, {}
    if form == "traced":
        shutil.copytree(first / "cache", cache)
        return cache, {"save": None}
    return cache, {"load": str(first / "bug.bin"), "save": str(tmp_path / "fix.bin")}


@pytest.mark.parametrize("form", FORMS)
def test_a_changed_program_recompiles_and_an_unchanged_one_replays(form, packages, first_run, tmp_path):
    cache, settings = _folder_for(form, first_run, tmp_path)
    checked = cases(form)
    second = _run(cache, packages[1], checked, **settings)
    _assert_eager(second, checked, run="run 2 (the fix, with run 1's cache)")
    if form == "file":
        shutil.rmtree(cache)  # run 3 starts from run 2's file alone
        settings = {"load": str(tmp_path / "fix.bin")}
    third = _run(cache, packages[1], checked, **settings)
    _assert_eager(third, checked, run="run 3 (unchanged)")
    # the CA graphs of the compiled and the eager forward (the step's are torch's own)
    graphs = sum(program in ("compiled", "eager") for program, _ in checked)
    # a regional graph: the first block (a plain input), the last (the loss's expanded gradient) and the repeated
    # ones between are at most three compiles (Note [Regional CA graphs]); runs 2 and 3 above show none was
    # stale, and run 3, unchanged, takes every distinct piece from its kept trace (save_cache(): the traced and
    # file forms, where torch can replay one) or else from the cache.
    for name, (pieces, compiles, hits, replayed) in third.get("regional", {}).items():
        if name == "DispatchPair":  # its expand materialises one part: the first piece cannot take that gradient as
            assert pieces == 0  # an input, and the graph is compiled whole (Note [Regional CA graphs], first run)
            continue
        assert pieces == 3 + CHECKED.index(name) and compiles <= 3, (name, pieces, compiles)
        if form != "folder" and _compat.precompile_supported():
            assert replayed == compiles and hits == 0, f"run 3 ({form}): {name}'s {compiles} distinct pieces, {replayed} kept traces replayed, {hits} cache hits"
        else:
            assert hits == compiles and replayed == 0, f"run 3 ({form}): {name}'s {compiles} distinct pieces, {hits} cache hits"
    assert sorted(third.get("regional", {})) == sorted(name for program, name in checked if program == "regional")
    # each CA graph either replays its kept trace (save_cache()) or hits its AOTAutogradCache entry
    assert third["replayed"] + third["aot_hits"] >= graphs, {k: v for k, v in third.items() if k != "types"}
    if form != "folder" and _compat.precompile_supported():
        assert third["replayed"] >= graphs, {k: v for k, v in third.items() if k != "types"}

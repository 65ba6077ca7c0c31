"""Shared fixtures: backends and devices are parametrized from here, never by copy-paste."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

# Note [Fresh inductor cache folders in tests]
# -------------------------------------------
# The warm-start tests start processes on empty ``TORCHINDUCTOR_CACHE_DIR`` folders.  In each,
# inductor's first CPU compile first probes which vector ISAs the C++ compiler can build (one
# dry compile per ISA, about 7 s of a fresh process here) and keeps the probe objects in that
# folder.  The probe decides nothing these tests check (the ISA is the CPU's, the same in every
# process), so the suite tells inductor to trust the CPU's report (``TORCHINDUCTOR_VEC_ISA_OK``,
# inherited by every worker process); the AOT, FX-graph and kept-trace entries under test are
# unaffected.  The benchmarks leave it unset: there the probe is part of a real cold start.
os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "1")

# Note [The suite's cache signing key]
# ------------------------------------
# Cache files and kept traces are signed with this user's key (Note [Trusting a compile cache] in
# subclass_ca/_warm_start/trust.py), by default a file in the user's config folder that the first
# use creates.  The suite keeps its own key file out of the home folder, one per user of the
# machine, shared by every xdist worker and every process a test starts (they inherit the
# variable), so one worker's cold run is trusted by the others as one user's would be.
import tempfile

os.environ.setdefault(
    "SUBCLASS_CA_CACHE_KEY_FILE",
    os.path.join(tempfile.gettempdir(), f"subclass_ca-tests-{getattr(os, 'getuid', lambda: 0)()}", "cache-key"),
)

import pytest
import torch

import subclass_ca

BACKENDS = [
    pytest.param("aot_eager", id="aot_eager"),
    pytest.param("inductor", id="inductor", marks=pytest.mark.inductor),
]
DEVICES = [
    pytest.param("cpu", id="cpu"),
    pytest.param(
        "cuda",
        id="cuda",
        marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(autouse=True)
def fresh_compile_state():
    """Every test starts from empty Dynamo / compiled-autograd caches and counters.

    ``gc.collect()`` at the end: a test that makes a compile fail on purpose can leave torch's
    generator-based compile contexts (``torch._guards.compile_context``) to the garbage collector;
    finalized later, in the middle of another test's compile, one resets that thread's compile
    context (seen on torch 2.15 as "AssertionError: compile_context is not set" in an unrelated
    test, depending on xdist's order).  Collecting here finalizes them between tests.

    ``gc.freeze()`` after it: what survives that collection is held by module-level state for the
    rest of the session (torch's and ours, after ``reset()``), about a million objects after a few
    dozen tests.  Frozen, they are left out of every later collection, this fixture's and the
    automatic ones, which otherwise walked them all again: 0.5 s per test, and half of the suite's
    time on some files.  Each collection still finds the garbage of the test before it.
    """
    subclass_ca.reset()
    torch._dynamo.utils.counters.clear()
    yield
    subclass_ca.reset()
    if not os.environ.get(_ISOLATED_CHILD):  # Note [Isolated tests]: the child leaves its garbage uncollected
        gc.collect()
        gc.freeze()


# Note [Isolated tests]
# ---------------------
# A test marked ``@pytest.mark.isolated(reason=...)`` runs in a fresh interpreter: its body is one
# ``python -m pytest <its node id>`` whose exit status decides it.  It is for a test whose *torch*
# crashes the process after the test's own assertions held (torch 2.11's stock compiled autograd
# segfaults collecting the garbage of an optimizer-in-backward run, which took an xdist worker and
# whichever test ran next with it).  The child never collects that garbage: the cyclic garbage collector is off
# in it from the start (a collection can also fall in the middle of the test: CI once saw the crash there, under
# load), and it ends with ``os._exit`` right after pytest reports.  The crash is torch's, the verdict is the test's
# assertions.  It is also for a test whose verdict CI once saw depend on what earlier tests left in its xdist
# worker, where no serial order reproduces it (the reason names what was seen): in a fresh interpreter it checks
# its subject, as ``python -m subclass_ca check`` does, not the worker's history.
_ISOLATED_CHILD = "SUBCLASS_CA_ISOLATED_CHILD"
_ROOT = Path(__file__).resolve().parents[1]


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker("isolated")
    if marker is None or os.environ.get(_ISOLATED_CHILD):
        return None
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", pyfuncitem.nodeid]
    env = {**os.environ, _ISOLATED_CHILD: "1", "SUBCLASS_CA_SUITE": "full"}
    done = subprocess.run(command, cwd=_ROOT, env=env, capture_output=True, text=True, timeout=300)
    if done.returncode != 0 or " passed" not in done.stdout:
        pytest.fail(f"isolated run of {pyfuncitem.nodeid} (exit {done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}")
    return True


def pytest_sessionstart(session: pytest.Session) -> None:
    if os.environ.get(_ISOLATED_CHILD):
        import gc

        gc.disable()  # Note [Isolated tests]: the child's garbage is never collected


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get(_ISOLATED_CHILD):
        terminal = session.config.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:
            terminal.summary_stats()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(exitstatus))


# Note [The lane suite]
# ---------------------
# CI runs the whole suite on the default torch lane (2.13) and, on every other lane (2.14,
# 2.15), the *lane suite*: every test that exercises torch's behaviour, leaving out only what
# does not change with the torch release, or is covered there by the tests it wraps:
# static source rules, the docs' code blocks and the copyable examples (they call the same
# public API the runtime tests check), the tooling (demo, bench, kit CLI, support table), the
# process launcher's own lifecycle tests, and the long randomized / end-to-end multi-process
# runs whose subject (DTensor, FSDP2, TP) has direct tests that stay in.
# ``SUBCLASS_CA_SUITE=lane`` selects it (``make test SUITE=lane``); each deselection below names
# its reason, and ``-rA`` style summaries show "deselected" counts, never skips.  A test under a
# deselected path that does depend on the lane's torch is kept by name in LANE_KEPT on the lane it depends on,
# with its reason (the GPU check's dry run, on 2.11: the lent GPU device's only torch).

LANE_INDEPENDENT: dict[str, str] = {
    "tests/test_import_rules.py": "static source rules",
    "tests/test_docs.py": "the docs' code blocks (the API they use is tested on every lane)",
    "tests/examples/": "copyable examples (scripts run by hand on 2.15; their API is tested on every lane)",
    "tests/tools/": "the repository's tools (demo, benchmarks, support table, GPU check)",
    "tests/testing/test_kit_cli.py": "the kit's command line (the kit itself stays in)",
    "tests/testing/test_fuzz.py": "randomized models (every scenario family has direct tests that stay in)",
    "tests/warm_start/test_trust.py::test_a_planted_record_never_runs_in_a_restart[own":
        "the same refusal as its 0777 twin's restart, which stays; another key's record is refused in process on every lane",
    "tests/testing/test_kit_torchao.py": "torchao's rows of the kit run on the default lane (issue 54); every lane's "
                                         "verdicts are docs/torchao.md (make torchao-matrix)",
    "tests/integrations/": "the trainer adapters against their frameworks, installed on the default lane (the public "
                           "API they call is tested on every lane)",
    "tests/distributed/": "long end-to-end TP/SP runs (DTensor and FSDP2 have direct multi-process tests that stay in)",
    "tests/test_distributed.py::test_w": "the process launcher's lifecycle",
    "tests/test_distributed.py::test_hanging": "the process launcher's lifecycle",
    "tests/test_distributed.py::test_run_workers": "the process launcher's lifecycle",
}
"""Path (or path::name prefix) -> why it is not part of the lane suite (Note [The lane suite])."""

LANE_KEPT: dict[str, tuple[str, str]] = {
    "tests/tools/test_gpu_check.py::test_dry_run_of_the_device_invocation": (
        "2.11.", "the GPU device runs the check on torch 2.11 (its only torch): its dry run must pass on that lane's torch"),
}
"""Path::name prefix under a LANE_INDEPENDENT path -> (the torch release whose lane keeps it, why)."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import os

    suite = os.environ.get("SUBCLASS_CA_SUITE", "full")
    if suite not in ("full", "lane"):
        raise pytest.UsageError(f"SUBCLASS_CA_SUITE={suite!r}: use 'full' (the default) or 'lane'")
    if suite == "full":
        return
    import torch

    kept_here = [prefix for prefix, (release, _) in LANE_KEPT.items() if torch.__version__.startswith(release)]
    kept, dropped = [], []
    for item in items:
        independent = any(item.nodeid.startswith(prefix) for prefix in LANE_INDEPENDENT)
        (dropped if independent and not any(item.nodeid.startswith(prefix) for prefix in kept_here) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept

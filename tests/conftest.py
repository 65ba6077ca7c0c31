"""Shared fixtures: backends and devices are parametrized from here, never by copy-paste."""

from __future__ import annotations

import gc

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
    """
    subclass_ca.reset()
    torch._dynamo.utils.counters.clear()
    yield
    subclass_ca.reset()
    gc.collect()


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
# its reason, and ``-rA`` style summaries show "deselected" counts, never skips.

LANE_INDEPENDENT: dict[str, str] = {
    "tests/test_import_rules.py": "static source rules",
    "tests/test_docs.py": "the docs' code blocks (the API they use is tested on every lane)",
    "tests/examples/": "copyable examples (scripts run by hand on 2.15; their API is tested on every lane)",
    "tests/test_bench.py": "benchmark tooling",
    "tests/tools/": "benchmark and support-table tooling",
    "tests/test_demo.py": "demo tooling",
    "tests/testing/test_kit_cli.py": "the kit's command line (the kit itself stays in)",
    "tests/testing/test_fuzz.py": "randomized models (every scenario family has direct tests that stay in)",
    "tests/distributed/": "long end-to-end TP/SP runs (DTensor and FSDP2 have direct multi-process tests that stay in)",
    "tests/test_distributed.py::test_w": "the process launcher's lifecycle",
    "tests/test_distributed.py::test_hanging": "the process launcher's lifecycle",
    "tests/test_distributed.py::test_run_workers": "the process launcher's lifecycle",
}
"""Path (or path::name prefix) -> why it is not part of the lane suite (Note [The lane suite])."""


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import os

    suite = os.environ.get("SUBCLASS_CA_SUITE", "full")
    if suite not in ("full", "lane"):
        raise pytest.UsageError(f"SUBCLASS_CA_SUITE={suite!r}: use 'full' (the default) or 'lane'")
    if suite == "full":
        return
    kept, dropped = [], []
    for item in items:
        (dropped if any(item.nodeid.startswith(prefix) for prefix in LANE_INDEPENDENT) else kept).append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept

"""torch's logging conventions: TORCH_LOGS=subclass_ca, and TORCH_TRACE artifacts tlparse renders
(Note [subclass_ca in torch's logs] in subclass_ca/_compat/logs.py)."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from subclass_ca import _compat, diagnostics

_STEP = """
import torch, subclass_ca
from subclass_ca.testing.subclasses import make_pair
torch.manual_seed(0)
w = torch.nn.Parameter(make_pair(torch.randn(4, 4)))
step = torch.compile(lambda x: (x @ w).sum(), backend="aot_eager")
with subclass_ca.enable():
    step(torch.randn(2, 4)).backward()
print("grad", type(w.grad).__name__)
"""


def _run_step(**env: str) -> subprocess.CompletedProcess[str]:
    environment = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    environment.pop("SUBCLASS_CA_LOG", None)
    result = subprocess.run([sys.executable, "-c", _STEP], capture_output=True, text=True, env=environment, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "grad PairTensor" in result.stdout
    return result


def test_torch_logs_subclass_ca_prints_each_capture_report():
    stderr = _run_step(TORCH_LOGS="subclass_ca").stderr
    assert "capture #0: 1 AOT backward(s)" in stderr
    assert "1 x make_subclass PairTensor [proxy]" in stderr
    assert "make_subclass node for" not in stderr, "DEBUG lines need +subclass_ca"


def test_torch_logs_plus_subclass_ca_prints_debug_lines():
    stderr = _run_step(TORCH_LOGS="+subclass_ca").stderr
    assert "make_subclass node for PairTensor [proxy]" in stderr
    assert "capture #0" in stderr


def test_subclass_ca_is_a_name_of_torchs_log_registry():
    registry = _compat.lookup("torch._logging._internal:log_registry")
    assert registry.is_log("subclass_ca")
    assert registry.log_alias_to_log_qnames["subclass_ca"] == ["subclass_ca"]


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def trace_records():
    """What a TORCH_TRACE run would write: the records torch's structured-trace log gets."""
    trace_log = _compat.lookup("torch._logging._internal:trace_log")
    handler = _Records()
    trace_log.addHandler(handler)
    try:
        yield handler.records
    finally:
        trace_log.removeHandler(handler)


def _artifacts(records: list[logging.LogRecord]) -> dict[str, str]:
    return {r.metadata["artifact"]["name"]: r.payload for r in records if "artifact" in getattr(r, "metadata", {})}


def test_warm_start_events_and_trust_refusals_are_trace_artifacts(trace_records):
    diagnostics.record_warm_start("hit", "abc123", "kept trace replayed")
    diagnostics.record_trust_refusal("record", "/tmp/somewhere", "not signed with your key")
    artifacts = _artifacts(trace_records)
    assert artifacts["subclass_ca_warm_start"] == "warm start hit: abc123 (kept trace replayed)"
    assert "not signed with your key" in artifacts["subclass_ca_trust_refusal"]


def _tlparse() -> str | None:
    found = shutil.which("tlparse") or str(Path(sys.executable).with_name("tlparse"))
    return found if os.access(found, os.X_OK) else None


def test_a_torch_trace_run_rendered_by_tlparse_shows_the_ca_graph_with_its_subclass_nodes(tmp_path: Path):
    tlparse = _tlparse()
    if tlparse is None:
        pytest.skip("tlparse is not installed (pip install tlparse; it is in the [test] extra)")
    _run_step(TORCH_TRACE=str(tmp_path / "trace"))
    logs = sorted((tmp_path / "trace").glob("*.log"))
    assert logs, "TORCH_TRACE wrote no log"
    out = tmp_path / "tl_out"
    rendered = subprocess.run([tlparse, str(logs[0]), "-o", str(out), "--no-browser", "--overwrite"],
                              capture_output=True, text=True, timeout=300)
    assert rendered.returncode == 0, rendered.stderr[-2000:]
    graphs = sorted(out.rglob("subclass_ca_graph_*.txt"))
    assert len(graphs) == 1, sorted(p.name for p in out.rglob("*.txt"))
    text = graphs[0].read_text()
    assert "1 x make_subclass PairTensor [proxy]" in text and "backend=aot_eager" in text
    assert "subclass_ca_make_PairTensor(" in text
    assert graphs[0].name in (out / "index.html").read_text()
    assert graphs[0].parent.name.startswith("0_"), "filed with compiled autograd's capture 0"

"""``examples/train_tp.py`` under torchrun (2 processes, gloo, 127.0.0.1) == its ``--dense`` run.

The example tensor-parallelizes an MLP stack (ColwiseParallel / RowwiseParallel over a 1-D
DeviceMesh), compiles it, and runs ``loss.backward()`` under ``subclass_ca.enable()``.  Its
per-step losses must equal those of the same model, data and seed trained densely in one
process (plain eager).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from subclass_ca.distributed import free_port
from tests.distributed import _example

pytestmark = [
    pytest.mark.distributed,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available"),
]

STEPS = 5
TIMEOUT_S = 240


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``command`` in its own process group; on timeout the whole group (torchrun and its workers) is stopped."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command,
        cwd=_example.ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = process.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        output = ""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                pass
            try:
                output, _ = process.communicate(timeout=5)
                break
            except subprocess.TimeoutExpired:
                continue
        pytest.fail(f"{' '.join(command)} did not finish within {timeout_s} s; its output:\n{output[-6000:]}")
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def _torchrun(*example_args: str, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    port = free_port()
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--local-addr", "127.0.0.1",
        str(_example.SCRIPT), *example_args,
    ]  # fmt: skip
    return _run(command, timeout_s)


def _losses(path: Path) -> torch.Tensor:
    return torch.tensor(json.loads(path.read_text())["losses"], dtype=torch.float64)


def test_torchrun_tensor_parallel_example_matches_dense(tmp_path: Path):
    out = tmp_path / "tp.json"
    run = _torchrun("--steps", str(STEPS), "--json", str(out))
    assert run.returncode == 0, run.stdout[-6000:]
    dense_out = tmp_path / "dense.json"
    dense = _run([sys.executable, str(_example.SCRIPT), "--dense", "--steps", str(STEPS), "--json", str(dense_out)], 120)
    assert dense.returncode == 0, dense.stdout[-6000:]

    result = json.loads(out.read_text())
    assert result["world_size"] == 2 and result["rank"] == 0
    assert result["rendezvous"]["MASTER_ADDR"] == "127.0.0.1"
    # one "step <i> loss <value>" line per step, from rank 0 only
    lines = [line for line in run.stdout.splitlines() if line.startswith("step ")]
    assert [line.split()[1] for line in lines] == [str(i) for i in range(STEPS)], run.stdout[-3000:]
    assert [line.split()[3] for line in lines] == [f"{v:.6f}" for v in result["losses"]]

    report = result["report"]
    assert report["fullgraph"] and report["graph_breaks"] == [] and report["dtensor_nodes"] > 0, report
    losses, reference = _losses(out), _losses(dense_out)
    assert losses.shape == (STEPS,)
    assert reference[-1] < reference[0]  # it trains
    torch.testing.assert_close(losses, reference, rtol=1e-6, atol=1e-6)

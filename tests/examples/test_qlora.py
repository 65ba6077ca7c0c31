"""``examples/qlora.py``, ``examples/qlora_fsdp2.py`` and ``examples/qlora_ddp.py`` (QLoRA: frozen torchao NF4 base + LoRA) == eager.

Each script's ``--check`` trains the model twice from the same init and data -- compiled
forward with ``loss.backward()`` under ``subclass_ca.enable()``, and plain eager (eager FSDP2
for the torchrun script) -- compares losses and adapters with ``assert_close`` and exits 1 on
a mismatch.  Here both run in subprocesses on ``aot_eager`` (cheap), and the single-process
script once more on its default ``inductor`` backend (``@pytest.mark.inductor``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from tests.distributed_utils import free_port

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    pytest.importorskip("torchao.quantization.quantize_.workflows.nf4.nf4_tensor")

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
STEPS = 3


def _run(command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
    """Run ``command`` in its own process group; on timeout the whole group is stopped and the test fails."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
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


def _step_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step ")]


def test_qlora_example_matches_eager():
    run = _run([sys.executable, str(EXAMPLES / "qlora.py"), "--backend", "aot_eager", "--steps", str(STEPS), "--check"], 180)
    assert run.returncode == 0, run.stdout[-6000:]
    assert "check passed" in run.stdout, run.stdout[-3000:]
    assert "NF4 nodes in the backward graph: 0" in run.stdout
    assert "fullgraph=True" in run.stdout
    # the compiled run and the eager run each print one line per step, with equal losses
    lines = _step_lines(run.stdout)
    assert len(lines) == 2 * STEPS, run.stdout[-3000:]
    assert lines[:STEPS] == lines[STEPS:]


@pytest.mark.inductor
def test_qlora_example_matches_eager_on_inductor():
    """The script's default backend (about 35 s of CPU time, most of it inductor compiling)."""
    run = _run([sys.executable, str(EXAMPLES / "qlora.py"), "--backend", "inductor", "--steps", "2", "--check"], 300)
    assert run.returncode == 0, run.stdout[-6000:]
    assert "check passed: 2 losses and 28 adapters match eager (inductor)" in run.stdout, run.stdout[-3000:]


def test_qlora_example_rejects_a_bad_step_count(capsys):
    qlora = _load_example()
    with pytest.raises(SystemExit) as exit_info:
        qlora.parse_args(["--steps", "0"])
    assert exit_info.value.code == 2 and "--steps must be at least 1" in capsys.readouterr().err


@pytest.mark.distributed
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_qlora_fsdp2_example_matches_eager_fsdp2():
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(EXAMPLES / "qlora_fsdp2.py"), "--backend", "aot_eager", "--steps", str(STEPS), "--check",
    ]  # fmt: skip
    run = _run(command, 300)
    assert run.returncode == 0, run.stdout[-6000:]
    assert "check passed" in run.stdout, run.stdout[-3000:]
    assert "sharded as DTensor[NF4Tensor]" in run.stdout and "adapter grads ['DTensor[Tensor]']" in run.stdout
    assert "NF4 nodes in the backward graph: 0" in run.stdout
    lines = _step_lines(run.stdout)  # rank 0 only: the compiled run, then the eager FSDP2 run
    assert len(lines) == 2 * STEPS, run.stdout[-3000:]
    assert lines[:STEPS] == lines[STEPS:]


README_DDP_COMMAND = "torchrun --standalone --nproc-per-node 2 examples/qlora_ddp.py --backend aot_eager --steps 3 --check"


@pytest.mark.distributed
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not available")
def test_qlora_ddp_example_the_readme_command_matches_eager_ddp():
    """The README's torchrun command for DDP (issue 46), with a free port on 127.0.0.1 instead of ``--standalone``."""
    assert README_DDP_COMMAND in (ROOT / "README.md").read_text()
    script_args = README_DDP_COMMAND.split("examples/qlora_ddp.py ", 1)[1].split()
    command = [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "0",
        "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
        str(EXAMPLES / "qlora_ddp.py"), *script_args,
    ]  # fmt: skip
    run = _run(command, 300)
    assert run.returncode == 0, run.stdout[-6000:]
    assert "check passed" in run.stdout and "match eager DDP" in run.stdout, run.stdout[-3000:]
    assert "adapter grads ['Tensor']" in run.stdout
    lines = _step_lines(run.stdout)  # rank 0 only: the compiled run, then the eager DDP run
    assert len(lines) == 2 * STEPS and lines[:STEPS] == lines[STEPS:], run.stdout[-3000:]


def _load_example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("subclass_ca_example_qlora", EXAMPLES / "qlora.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_qlora_check_reports_every_mismatch():
    """What makes ``--check`` exit 1: other losses or adapters, an NF4 gradient, an NF4 node, a subclass adapter grad."""
    qlora = _load_example()
    args = qlora.parse_args(["--backend", "aot_eager", "--steps", "1"])
    model, other = qlora.build_model(0, "cpu"), qlora.build_model(1, "cpu")
    good = {"losses": torch.ones(1), "grad_types": {"Tensor"}, "nf4_grads": [], "nf4_nodes": 0}
    assert qlora.compare(good, dict(good), model, qlora.build_model(0, "cpu"), args) == []
    bad = {"losses": torch.full((1,), 2.0), "grad_types": {"TwoTensor"}, "nf4_grads": ["blocks.0.q.weight"], "nf4_nodes": 1}
    problems = "\n".join(qlora.compare(bad, good, model, other, args))
    for expected in ("losses differ", "lora_a differs", "adapter gradients should be", "frozen NF4 weights got a gradient", "NF4Tensor node"):
        assert expected in problems, problems

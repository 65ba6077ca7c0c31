"""run_workers: results by rank, fail-fast on a raising/dying/hanging worker, no orphans; 2-process DTensor training."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from subclass_ca.distributed import LaunchConfig, WorkerError, WorkerTimeoutError, free_port, run_workers
from tools.demo import main as _demo

# --- worker functions (module level: the spawned workers import them by name) ---------


def _write_pid(pid_dir: str, rank: int) -> None:
    Path(pid_dir, f"rank{rank}.pid").write_text(str(os.getpid()))


def sum_ranks(rank: int, world_size: int, scale: float) -> dict:
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    return {"rank": rank, "world_size": world_size, "sum": value * scale, "backend": dist.get_backend()}


def raise_on_rank_one(rank: int, world_size: int, pid_dir: str) -> None:
    _write_pid(pid_dir, rank)
    if rank == 1:
        raise ValueError("rank one exploded on purpose")
    value = torch.ones(1)
    dist.all_reduce(value)  # rank 0 blocks here: its peer never arrives
    time.sleep(60)


def exit_on_rank_one(rank: int, world_size: int, pid_dir: str) -> None:
    _write_pid(pid_dir, rank)
    if rank == 1:
        os._exit(3)
    time.sleep(60)


def sleep_forever(rank: int, world_size: int, pid_dir: str) -> None:
    _write_pid(pid_dir, rank)
    time.sleep(60)


def _assert_no_worker_left(error: WorkerError, pid_dir: Path, nproc: int) -> None:
    assert multiprocessing.active_children() == []
    assert len(error.pids) == nproc
    started = [int(Path(pid_dir, f"rank{r}.pid").read_text()) for r in range(nproc) if Path(pid_dir, f"rank{r}.pid").exists()]
    assert set(started) <= set(error.pids)  # the pids the workers wrote themselves are the ones we track
    for pid in error.pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped and gone, not a zombie or an orphan


# --- the launcher ---------------------------------------------------------------------


@pytest.mark.distributed
def test_run_workers_returns_each_ranks_result_in_rank_order():
    results = run_workers(sum_ranks, 2, timeout_s=60, args=(2.0,))
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["world_size"] == 2 and r["backend"] == "gloo" for r in results)
    for r in results:
        torch.testing.assert_close(r["sum"], torch.tensor([6.0]), atol=0, rtol=0)  # (1 + 2) * 2
    assert multiprocessing.active_children() == []


@pytest.mark.distributed
def test_worker_error_on_rank_one_reaches_parent_fast_with_no_orphans(tmp_path: Path):
    start = time.monotonic()
    with pytest.raises(WorkerError) as caught:
        run_workers(raise_on_rank_one, 2, timeout_s=60, args=(str(tmp_path),))
    elapsed = time.monotonic() - start
    error = caught.value
    assert not isinstance(error, WorkerTimeoutError)
    assert error.rank == 1
    assert "rank 1 of 2 failed" in str(error)
    assert "ValueError: rank one exploded on purpose" in str(error)
    assert "raise_on_rank_one" in str(error) and "raise_on_rank_one" in error.worker_traceback
    assert elapsed < 30, f"took {elapsed:.1f} s: the parent waited for the blocked rank instead of failing fast"
    _assert_no_worker_left(caught.value, tmp_path, 2)


@pytest.mark.distributed
def test_worker_that_dies_fails_the_run_with_its_exit_code(tmp_path: Path):
    start = time.monotonic()
    with pytest.raises(WorkerError, match=r"rank 1 of 2 .*exited with code 3 without a result") as caught:
        run_workers(exit_on_rank_one, 2, timeout_s=60, args=(str(tmp_path),))
    assert caught.value.rank == 1
    assert time.monotonic() - start < 30
    _assert_no_worker_left(caught.value, tmp_path, 2)


@pytest.mark.distributed
def test_hanging_workers_are_killed_at_the_timeout(tmp_path: Path):
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError, match=r"did not finish within 8 s .*every worker was killed.*timeout_s") as caught:
        run_workers(sleep_forever, 2, timeout_s=8, args=(str(tmp_path),))
    elapsed = time.monotonic() - start
    assert 8 <= elapsed < 8 + 10
    _assert_no_worker_left(caught.value, tmp_path, 2)


@pytest.mark.parametrize(
    ("options", "field"),
    [({"nproc": 0}, "nproc"), ({"timeout_s": 0}, "timeout_s"), ({"device": "tpu"}, "device")],
)
def test_launch_config_rejects_bad_values_naming_the_field(options: dict, field: str):
    settings = {"nproc": 2, "port": free_port(), "timeout_s": 10.0, **options}
    with pytest.raises(ValueError, match=f"LaunchConfig.{field}"):
        LaunchConfig(**settings)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown when CUDA is missing")
def test_cuda_launch_without_cuda_says_to_use_cpu():
    with pytest.raises(WorkerError, match=r"no CUDA device here; use device='cpu'"):
        run_workers(sum_ranks, 2, timeout_s=10, args=(1.0,), device="cuda")


# --- 2-process DTensor training ----------------------------------------------------------


@pytest.mark.distributed
def test_two_process_dtensor_training_matches_single_process_dense_run(tmp_path: Path, capsys):
    code = _demo.main(["--dtensor", "--nproc", "2", "--steps", "3", "--out", str(tmp_path), "--timeout", "120"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "max difference vs single-process dense run" in printed and "-> OK" in printed
    result = json.loads((tmp_path / "dtensor_results.json").read_text())
    assert result["ok"] and result["nproc"] == 2
    assert result["max_diff"] <= result["tolerance"] == 1e-5
    assert [r["rank"] for r in result["per_rank"]] == [0, 1]
    for rank in result["per_rank"]:
        assert rank["local_w1_shape"] == [8, 8]  # w1 [16, 8] sharded on dim 0 over 2 ranks
        assert rank["placements"] == ["(Shard(dim=0),)", "(Replicate(),)"]
        assert rank["max_param_diff"] <= 1e-5 and rank["max_loss_diff"] <= 1e-5
    # subclass_ca really captured the DTensor gradients (one node per DTensor parameter).
    assert result["cache"]["captures"] >= 1 and result["cache"]["runs"] == 3
    first = result["reports"][0]
    assert first["make_subclass_nodes"] == [{"type": "DTensor", "mode": "proxy", "count": 2}]


def test_dtensor_demo_exits_nonzero_beyond_tolerance(monkeypatch, tmp_path: Path, capsys):
    def fake_run(**kwargs):
        return {"per_rank": [], "max_diff": 0.5, "ok": False, "elapsed_s": 0.0, "reports": [],
                "cache": {"captures": 1, "runs": 1, "cache_hits": 0}}

    monkeypatch.setattr(_demo, "run_dtensor_demo", fake_run)
    assert _demo.main(["--dtensor", "--out", str(tmp_path)]) == 1
    assert "5.000e-01 (tolerance 1e-05) -> FAILED" in capsys.readouterr().out


def test_dtensor_demo_reports_a_worker_failure_instead_of_hanging(monkeypatch, tmp_path: Path, capsys):
    def failing_run(**kwargs):
        raise WorkerError("rank 1 of 2 failed in x: ValueError: boom", rank=1)

    monkeypatch.setattr(_demo, "run_dtensor_demo", failing_run)
    assert _demo.main(["--dtensor", "--out", str(tmp_path)]) == 1
    assert "DTensor run FAILED: rank 1 of 2 failed in x: ValueError: boom" in capsys.readouterr().err


_PARENT_SCRIPT = """
import sys
from subclass_ca.distributed import run_workers
from tests.test_distributed import sleep_forever
if __name__ == "__main__":
    run_workers(sleep_forever, 2, timeout_s=120, args=(sys.argv[1],))
"""


@pytest.mark.distributed
def test_workers_exit_when_their_parent_is_killed(tmp_path: Path):
    """The watchdog: even a SIGKILLed parent (no cleanup runs) leaves no orphan workers behind."""
    import signal
    import subprocess
    import sys

    script = tmp_path / "parent.py"
    script.write_text(_PARENT_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    parent = subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env)
    try:
        deadline = time.monotonic() + 60
        pid_files = [tmp_path / f"rank{r}.pid" for r in range(2)]
        while not all(p.exists() and p.read_text() for p in pid_files):
            assert time.monotonic() < deadline, "the workers never started"
            assert parent.poll() is None, f"the parent exited early with {parent.returncode}"
            time.sleep(0.2)
        pids = [int(p.read_text()) for p in pid_files]
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 15
        alive = pids
        while alive and time.monotonic() < deadline:
            time.sleep(0.2)
            alive = [pid for pid in pids if _alive(pid)]
        assert alive == [], f"workers {alive} outlived their killed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _alive(pid: int) -> bool:
    """True while ``pid`` runs (orphans are reparented and reaped by init; a zombie counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_the_launcher_is_subclass_ca_distributed_itself_and_not_imported_by_subclass_ca():
    import subprocess
    import sys

    import subclass_ca.distributed as public

    for name in ("run_workers", "WorkerError", "WorkerTimeoutError", "free_port", "LaunchConfig"):
        assert getattr(public, name).__module__ == "subclass_ca.distributed", name  # its own code, not a front
    assert set(public.__all__) == {"run_workers", "WorkerError", "WorkerTimeoutError", "free_port"}
    code = "import sys, subclass_ca; assert 'subclass_ca.distributed' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[1])

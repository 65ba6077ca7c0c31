"""Run a function on N local processes over torch.distributed: bounded, fail-fast, orphan-free.

``run_workers(fn, nproc, timeout_s=..., args=...)`` starts ``nproc`` fresh processes on
127.0.0.1 (gloo on CPU, NCCL with ``device="cuda"``), calls ``fn(rank, world_size, *args)``
in each with the default process group initialised, and returns the results by rank.  A
worker that raises makes it raise :class:`WorkerError` at once with that rank's traceback,
one that dies is reported with its exit code, and past ``timeout_s`` every worker is killed
(:class:`WorkerTimeoutError`).  No worker outlives the call.  See docs/distributed.md.

This is for multi-process tests and checks, not part of the capture: nothing in the runtime
imports it, and ``import subclass_ca`` does not import it.  ``torchrun`` scripts need none of
it (see ``examples/train_tp.py``).

Note [Why our own launcher]
---------------------------
Tests and the DTensor demo need real multi-process runs (one rank per process) that
*always* end: a rank that raises, dies or hangs must fail the whole run quickly, with
the rank's own error text, and leave no process behind.  ``torch.multiprocessing.spawn``
joins without a deadline and ``torchrun`` is a separate CLI, so :func:`run_workers` does
the small part we need itself:

* one free TCP port on 127.0.0.1 (``MASTER_ADDR``/``MASTER_PORT`` plus a ``tcp://`` init
  method), ranks started with the ``spawn`` start method (safe with threads and CUDA);
* every worker initialises the process group (gloo on CPU, NCCL on CUDA) with the run's
  timeout, so a collective waiting on a dead peer fails instead of blocking forever;
* results and errors come back through one queue as ``torch.save`` bytes / traceback
  text (no shared-memory handles that would tie the result's lifetime to the worker);
* the parent polls with a deadline: the first error, an unexpected exit or the timeout
  terminates every worker (SIGTERM, then SIGKILL after a grace period) and joins them
  before raising :class:`WorkerError` / :class:`WorkerTimeoutError`;
* each worker runs a watchdog thread that exits the worker if its parent disappears
  (so even a SIGKILLed parent leaves no orphans behind for long).

Usage::

    from subclass_ca.distributed import run_workers

    def train(rank: int, world_size: int, steps: int) -> dict:   # module level: picklable
        ...                                    # torch.distributed is initialised here
        return {"loss": 0.5}                   # anything torch.save can write

    results = run_workers(train, 2, timeout_s=90, args=(10,))   # [rank0_result, rank1_result]
"""

from __future__ import annotations

import io
import multiprocessing
import os
import queue
import socket
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, cast

from .errors import SubclassCAError

__all__ = ["run_workers", "WorkerError", "WorkerTimeoutError", "free_port"]
"""The public launcher (:class:`LaunchConfig` is what each worker is started with; importable, not part of the API)."""

_GRACE_S = 3.0
"""How long a terminated worker gets before it is killed."""
_ERROR_WINDOW_S = 0.5
"""After a first worker error, how long to collect others before choosing the earliest as the cause."""


class WorkerError(SubclassCAError):
    """A worker of :func:`run_workers` raised or died; ``rank`` and the worker's traceback are kept.

    ``pids`` lists the run's worker process ids (all stopped and reaped when this is raised).
    """

    def __init__(self, message: str, *, rank: int | None = None, worker_traceback: str = "") -> None:
        super().__init__(message)
        self.rank = rank
        self.worker_traceback = worker_traceback
        self.pids: list[int] = []


class WorkerTimeoutError(WorkerError):
    """The run did not finish within ``timeout_s``; every worker was killed."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """What every worker of one :func:`run_workers` call is started with."""

    nproc: int
    """Number of ranks (processes)."""
    port: int
    """TCP port of the rendezvous on 127.0.0.1."""
    timeout_s: float
    """Wall-clock bound of the whole run; also the process group's collective timeout."""
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (NCCL; rank r uses GPU r % device_count)."""
    init_process_group: bool = True
    """Initialise (and destroy) the default process group around ``fn``."""
    threads_per_worker: int | None = 1
    """``torch.set_num_threads`` in each worker (None: torch's default)."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment variables for the workers."""

    def __post_init__(self) -> None:
        if not isinstance(self.nproc, int) or self.nproc < 1:
            raise ValueError(f"LaunchConfig.nproc must be a positive int, got {self.nproc!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"LaunchConfig.timeout_s must be > 0 seconds, got {self.timeout_s!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"LaunchConfig.device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def backend(self) -> str:
        return "nccl" if self.device == "cuda" else "gloo"


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:
            os._exit(70)


def _dump(value: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _worker_main(
    rank: int, config: LaunchConfig, fn: Callable[..., Any], args: tuple[Any, ...], results: Any, parent_pid: int
) -> None:
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True, name="subclass_ca-parent-watch").start()
    os.environ.update(config.env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(config.port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(config.nproc),
        LOCAL_WORLD_SIZE=str(config.nproc),
    )
    try:
        import torch
        import torch.distributed as dist

        if config.threads_per_worker is not None:
            torch.set_num_threads(config.threads_per_worker)
        if config.device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if config.init_process_group:
            dist.init_process_group(
                config.backend,
                init_method=f"tcp://127.0.0.1:{config.port}",
                rank=rank,
                world_size=config.nproc,
                timeout=timedelta(seconds=config.timeout_s),
            )
        value = fn(rank, config.nproc, *args)
        payload = _dump(value)
    except BaseException as error:  # noqa: BLE001 - everything goes back to the parent
        # Report before tearing the group down: peers then fail with secondary errors that
        # the parent ranks after this one (by the time stamp).
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        try:
            results.put(("error", rank, (time.time(), f"{type(error).__name__}: {error}\n{text}")))
        finally:
            results.close()
            results.join_thread()
        os._exit(1)
    results.put(("ok", rank, payload))
    results.close()
    results.join_thread()
    if config.init_process_group and dist.is_initialized():
        dist.destroy_process_group()


def _stop_all(processes: Sequence[Any], *, finished: bool = False) -> None:
    """Terminate, then kill, then join every process: nothing is left running.

    ``finished``: every rank returned its result; give them a moment to exit on their own first.
    """
    if finished:
        deadline = time.monotonic() + _GRACE_S
        for process in processes:
            process.join(max(deadline - time.monotonic(), 0.0))
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + _GRACE_S
    for process in processes:
        process.join(max(deadline - time.monotonic(), 0.0))
    for process in processes:
        if process.is_alive():
            process.kill()
    for process in processes:
        process.join()
        process.close()


def _name(fn: Callable[..., Any]) -> str:
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"


def _first_error(fn: Callable[..., Any], nproc: int, errors: dict[int, Any], results: Any) -> WorkerError:
    """The earliest worker error (by the worker's clock); the others are named as consequences."""
    window_end = time.monotonic() + _ERROR_WINDOW_S
    while time.monotonic() < window_end:
        try:
            status, rank, payload = results.get(timeout=0.05)
        except queue.Empty:
            continue
        if status == "error":
            errors[rank] = payload
    rank = min(errors, key=lambda r: errors[r][0])
    text = errors[rank][1]
    first_line = text.splitlines()[0] if text else "?"
    others = sorted(set(errors) - {rank})
    also = f" (ranks {others} failed after it, most likely because of it)" if others else ""
    return WorkerError(
        f"rank {rank} of {nproc} failed in {_name(fn)}: {first_line}{also}; every worker was stopped.\n"
        f"--- worker traceback (rank {rank}) ---\n{text}",
        rank=rank,
        worker_traceback=text,
    )


def run_workers(
    fn: Callable[..., Any],
    nproc: int,
    *,
    timeout_s: float,
    args: Sequence[Any] = (),
    device: str = "cpu",
    init_process_group: bool = True,
    threads_per_worker: int | None = 1,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``nproc`` fresh processes; return the results by rank.

    ``fn`` and ``args`` must be picklable (``fn`` defined at module level); each worker
    starts with the default process group initialised (gloo on CPU, NCCL with
    ``device="cuda"``) on 127.0.0.1 and a free port.  Results travel as ``torch.save``
    bytes and are loaded on CPU.  The first worker error, a worker that exits without a
    result, or ``timeout_s`` seconds of wall clock stop every worker and raise
    :class:`WorkerError` (:class:`WorkerTimeoutError`) carrying the rank and its traceback.
    No worker process outlives this call.
    """
    import torch

    config = LaunchConfig(
        nproc=nproc,
        port=free_port(),
        timeout_s=float(timeout_s),
        device=device,
        init_process_group=init_process_group,
        threads_per_worker=threads_per_worker,
        env=dict(env or {}),
    )
    if device == "cuda" and not torch.cuda.is_available():
        raise WorkerError(f"run_workers(device='cuda') for {_name(fn)}: no CUDA device here; use device='cpu' (gloo)")
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    processes = []
    started = time.monotonic()
    deadline = started + config.timeout_s
    values: dict[int, Any] = {}
    pids: list[int] = []
    try:
        for rank in range(nproc):
            process = context.Process(
                target=_worker_main,
                args=(rank, config, fn, tuple(args), results, os.getpid()),
                name=f"subclass_ca-worker-{rank}",
                daemon=True,
            )
            process.start()
            processes.append(process)
            pids.append(cast(int, process.pid))  # set by start()
        exited_without_result: dict[int, float] = {}
        while len(values) < nproc:
            try:
                status, rank, payload = results.get(timeout=0.05)
            except queue.Empty:
                pass
            else:
                if status == "error":
                    raise _first_error(fn, nproc, {rank: payload}, results)
                values[rank] = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=False)
                continue
            now = time.monotonic()
            for rank, process in enumerate(processes):
                if rank in values or process.exitcode is None:
                    continue
                # Let a result still in the pipe arrive before calling the exit a failure.
                if now - exited_without_result.setdefault(rank, now) > 1.0:
                    raise WorkerError(
                        f"rank {rank} of {nproc} ({_name(fn)}) exited with code {process.exitcode} without a result "
                        "(killed, crashed or called os._exit); the other ranks were stopped. Look above for its output.",
                        rank=rank,
                    )
            if now > deadline:
                missing = sorted(set(range(nproc)) - set(values))
                raise WorkerTimeoutError(
                    f"{_name(fn)} on {nproc} processes did not finish within {config.timeout_s:g} s "
                    f"(ranks {missing} still running); every worker was killed. Raise timeout_s or look for a "
                    "collective that one rank never reaches.",
                )
    except WorkerError as error:
        error.pids = pids
        raise
    finally:
        _stop_all(processes, finished=len(values) == nproc)
        results.close()
        results.join_thread()
        # Drop the queue now: a raised error's traceback keeps this frame (and the queue's
        # semaphores) alive, which the resource tracker reports as leaked at exit.
        del results, processes
    return [values[rank] for rank in range(nproc)]

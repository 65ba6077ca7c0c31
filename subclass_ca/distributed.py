"""Run a function on N local processes over torch.distributed: the public launcher.

``run_workers(fn, nproc, timeout_s=..., args=...)`` starts ``nproc`` fresh processes on
127.0.0.1 (gloo on CPU, NCCL with ``device="cuda"``), calls ``fn(rank, world_size, *args)``
in each with the default process group initialised, and returns the results by rank.  It
is bounded and fail-fast: a worker that raises makes it raise :class:`WorkerError` at once
with that rank's traceback, one that dies is reported with its exit code, and past
``timeout_s`` every worker is killed (:class:`WorkerTimeoutError`).  No worker outlives the
call.  See Note [Why our own launcher] in ``subclass_ca/_tools/launcher.py`` and
docs/distributed.md.

This is tooling for tests, demos and checks, not part of the capture: nothing in the
runtime imports it, and ``import subclass_ca`` does not import it.  ``torchrun`` scripts need
none of it (see ``examples/train_tp.py``).
"""

from __future__ import annotations

from ._tools.launcher import WorkerError, WorkerTimeoutError, free_port, run_workers

__all__ = ["run_workers", "WorkerError", "WorkerTimeoutError", "free_port"]

"""One training step in a fresh process, for the warm-start tests (``python tests/cache_worker.py '<json settings>'``).

Prints one JSON line: the cache counters of the backward alone (the CA graph's compile), how
many graphs Dynamo traced in it (``ca_traces``) and the kept-trace counters (``traced``), the
gradients as exact float lists, and eager's gradients computed in the same process.
``TORCHINDUCTOR_CACHE_DIR`` is set by the caller.  Settings (all optional):
``dtype``, ``batch``, ``subclass`` ("pair" | "tagged"), ``tag``, ``handler`` ("default" | "custom"),
``activation`` ("tanh" | "relu": relu's backward holds a call without tensor inputs, ``full([], 0.0)``),
``forward_outside`` (the forward runs outside the block, only ``loss.backward()`` inside it), ``threads`` (torch's intra-op threads, 1 by default; ``untrusted_warnings`` lists the UntrustedCacheWarnings of the run), ``strict``, ``torch_version`` / ``package`` (pretend another torch / subclass_ca build), ``load`` / ``save``
(a subclass_ca cache file read before the step / written after it; ``save: null`` completes the
cache folder only).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import torch
from filelock import FileLock

import subclass_ca
from subclass_ca import _compat
from subclass_ca._warm_start import files as cache
from subclass_ca._warm_start import keys, traced
from subclass_ca.testing.subclasses import PairTensor, TaggedTensor


def _inner(t: torch.Tensor) -> list[float]:
    if isinstance(t, PairTensor):
        return _inner(t.a) + _inner(t.b)
    if isinstance(t, TaggedTensor):
        return _inner(t.elem)
    return t.detach().double().flatten().tolist()


def _custom_rebuild(inner, ctx, outer_size, outer_stride):
    return PairTensor(inner["a"], inner["b"])  # the same tensor as the protocol rebuild, by other code


def main(settings: dict) -> dict:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", subclass_ca.UntrustedCacheWarning)
        result = _step(settings)
    result["untrusted_warnings"] = [str(w.message) for w in caught if issubclass(w.category, subclass_ca.UntrustedCacheWarning)]
    return result


def _step(settings: dict) -> dict:
    if settings.get("torch_version"):
        torch.__version__ = settings["torch_version"]  # type: ignore[misc]
    if settings.get("package"):
        for module in (keys, cache):  # every reader of our build's digest
            module.package_digest = lambda: settings["package"]  # type: ignore[attr-defined]
    if settings.get("handler") == "custom":
        subclass_ca.register_handler(PairTensor, rebuild=_custom_rebuild)
    loaded = subclass_ca.load_cache(settings["load"]) if settings.get("load") else None
    torch.set_num_threads(int(settings.get("threads", 1)))
    torch.manual_seed(0)
    dtype = getattr(torch, settings.get("dtype", "float32"))
    batch = int(settings.get("batch", 8))
    dense = [torch.randn(16, 16, dtype=dtype) for _ in range(2)]
    x = torch.randn(batch, 16, dtype=dtype)
    if settings.get("subclass", "pair") == "pair":
        wrap = lambda t: PairTensor(t.clone(), t * 2.0)  # noqa: E731
    else:
        wrap = lambda t: TaggedTensor(t.clone(), settings.get("tag", "a"))  # noqa: E731

    activation = getattr(torch, settings.get("activation", "tanh"))

    def forward(params, inputs):
        h = inputs
        for w in params:
            h = activation(h @ w)
        return h.sum()

    eager = [torch.nn.Parameter(wrap(t)) for t in dense]
    forward(eager, wrap(x)).backward()
    params = [torch.nn.Parameter(wrap(t)) for t in dense]
    step = torch.compile(forward, backend="inductor")
    start = _compat.cache_counters()
    block = subclass_ca.enable(backend="inductor", strict=bool(settings.get("strict")))
    if settings.get("forward_outside"):  # Note [Forwards compiled outside a block]
        loss = step(params, wrap(x))
        before, traces_before = _compat.cache_counters(), _compat.unique_graph_count()
        with block:
            loss.backward()
    else:  # compiled inside the block: its AOT key describes its subclass inputs' code (Note [Keys by behaviour])
        with block:
            loss = step(params, wrap(x))
            before, traces_before = _compat.cache_counters(), _compat.unique_graph_count()
            loss.backward()
    after, ca_traces = _compat.cache_counters(), _compat.unique_graph_count() - traces_before
    saved = subclass_ca.save_cache(settings["save"]) if "save" in settings else None
    return {
        "forward": {k: before[k] - start[k] for k in before},
        "ca": {k: after[k] - before[k] for k in after},
        "grads": [_inner(p.grad) for p in params],
        "grad_types": [type(p.grad).__name__ for p in params],
        "eager": [_inner(p.grad) for p in eager],
        "loaded": loaded is not None,
        "saved_bytes": saved and saved.artifact_bytes,
        "saved_path": saved and saved.path,
        "forward_entries_written": saved and saved.forward_entries_written,
        "traced_graphs_saved": saved and saved.traced_graphs,
        "traced": dict(traced.stats),
        "ca_traces": ca_traces,
    }


# --- the caller's side -------------------------------------------------------------------

WORKER = Path(__file__)


def assert_matches_eager(result: dict) -> None:
    """Inductor is not bitwise equal to eager: close within float tolerance, per parameter."""
    for got, expected in zip(result["grads"], result["eager"], strict=True):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-5, atol=1e-5)


def shared_cold_run(tmp_path_factory, name: str, **settings) -> tuple[Path, dict]:
    """One cold run per test session, whichever pytest-xdist worker asks first: its cache folder and result.

    Tests copy the folder (:func:`copy_cache`) before writing to it; ``save``, a file name, saves
    the cold run's cache file beside that folder (``result["saved_path"]``). A cold run is the costly part of a
    warm-start test (every graph compiles), and several tests start from the same one."""
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "cold-runs" / name
    root.parent.mkdir(parents=True, exist_ok=True)
    if settings.get("save"):  # a file name: the cold run's file, beside its folder
        settings = {**settings, "save": str(root / settings["save"])}
    with FileLock(str(root) + ".lock"):
        if not (root / "result.json").exists():
            result = run_step(root / "cache", **settings)
            (root / "result.json").write_text(json.dumps(result))
    return root / "cache", json.loads((root / "result.json").read_text())


def copy_cache(folder: Path, to: Path, *, traces: bool) -> Path:
    """A copy of a cache folder, with or without the kept traces ``save_cache()`` added to it."""
    shutil.copytree(folder, to, ignore=None if traces else shutil.ignore_patterns("subclass_ca_traced"))  # traced.py keeps them there
    return to


def run_step(cache_dir: Path, **settings) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache_dir), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(WORKER), json.dumps(settings)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])



if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))))

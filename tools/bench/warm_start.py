"""Warm start: the first training step of a fresh process, cold (empty caches) and warm (caches of an earlier run).

Every sample is its own process (``python -m tools.bench.warm_start --worker``), as a
restarted job is.  Each (model, mode) gets its own cache folder, so compile-only's saved forward
never warms the CA modes.  Per sample it reports the import, the first forward (Dynamo + AOT +
inductor of the forward), the first backward (CA capture + CA-graph compile + run), split by
torch's own compile timers, the cache counters of the backward, and a digest of the gradients
(warm must equal cold bitwise: the cached artifacts are the cold run's).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from tools import checkout_env
from tools.common.report import as_json as to_json
from tools.common.report import command_of, verdict_lines

__all__ = ["WarmStartBench", "MODES", "MODELS", "TARGETS", "bench", "markdown_section", "format_summary", "to_json",
           "build_parser", "settings_from_args", "main"]

MODES = ("compile", "stock_ca", "subclass_ca", "subclass_ca_saved")
"""``subclass_ca_saved``: subclass_ca whose every process calls ``subclass_ca.save_cache()`` after its steps (timed apart)."""
MODELS = {
    "pair": "TwoTensor MLP (micro, small)",
    "block_nf4": "NF4-LoRA transformer block (small)",
    "stack_two_tensor_lora": "regional stack: 8 TwoTensor-LoRA blocks (the depth sweep's), each `block.compile()`d",
    "fsdp2_two_tensor": "FSDP2 (fully_shard) TwoTensor MLP on 2 gloo processes (first step incl. the optimizer; rank 0)",
}
STACK_DEPTH = 8
"""Blocks of the regional stack row: its CA graph runs as regional pieces (Note [Regional CA graphs])."""
FSDP2_NPROC = 2
TARGETS = {
    "pair_1s": "warm first step <= 1.0 s on the TwoTensor MLP (subclass_ca with save_cache, later restarts)",
    "vs_compile": "warm first step <= 1.5x compile-only's on every row (subclass_ca with save_cache, later restarts)",
    "vs_stock": "warm first step below stock CA's on every row (subclass_ca with save_cache, later restarts)",
    "first_restart": "first restart after save_cache(): 0 CA-graph compiles, every backward graph from AOTAutogradCache "
                     "(subclass_ca with save_cache, every row)",
    "no_retrace": "warm restart after save_cache(): Dynamo traces no CA graph (each replayed from its kept trace; "
                  "subclass_ca with save_cache, rows without FSDP2 splits)",
    "cold": "cold first step no worse than stock CA's on every row (subclass_ca)",
    "bitwise": "warm gradients bitwise equal to the cold run's (every mode)",
}
# Where a first step goes beyond torch's compile timers: wall time spent in each of these calls, summed per phase
# (forward, backward) of the worker; a probe that no longer exists in this torch or subclass_ca is reported missing.
_PROBES = {
    "key": ("subclass_ca._warm_start.keys", "behaviour_key"),  # a key by behaviour (Note [Keys by behaviour])
    "capture_begin": ("torch._dynamo.compiled_autograd", "AutogradCompilerInstance.begin_capture"),  # fake inputs
    "capture_paste": ("torch._dynamo.compiled_autograd", "AutogradCompilerInstance.proxy_call_aot_backward"),
    "capture_end": ("torch._dynamo.compiled_autograd", "AutogradCompilerInstance.end_capture"),
    "ca_first_call": ("subclass_ca._graph", "CompiledCAGraph._first_call"),  # key, compile or replay, first run
}
# compile timers (torch._dynamo.utils.compilation_time_metrics) that split a first step
_TIMERS = {
    "dynamo": "_compile.compile_inner",
    "aot_trace": "create_aot_dispatcher_function",
    "inductor": "compile_fx_inner",
    "cache_load": "AOTAutogradCache.inductor_load",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class WarmStartBench:
    """What to time: models, modes, warm samples per (model, mode), the backend."""

    models: tuple[str, ...] = tuple(MODELS)
    modes: tuple[str, ...] = MODES
    warm_reps: int = 3
    backend: str = "inductor"
    device: str = "cpu"
    timeout_s: float = 600.0
    forward_outside: bool = False
    """subclass_ca's modes compile the forward outside the block (``loss = model(x)``, then ``with enable():
    loss.backward()``), a pattern users write; by default the block holds forward and backward, as the README shows."""

    def __post_init__(self) -> None:
        for name, values, allowed in (("models", self.models, MODELS), ("modes", self.modes, MODES)):
            bad = [v for v in values if v not in allowed]
            if bad or not values:
                raise ValueError(f"WarmStartBench.{name}: got {list(values)}, allowed values are {list(allowed)}")
        if self.warm_reps < 1:
            raise ValueError(f"WarmStartBench.warm_reps must be >= 1, got {self.warm_reps}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"WarmStartBench.device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.forward_outside and any(m.startswith("fsdp2") for m in self.models):
            raise ValueError("WarmStartBench: the FSDP2 row times a whole train step; leave it out with --forward-outside")
        if self.device == "cuda" and any(m.startswith("fsdp2") for m in self.models):
            raise ValueError("WarmStartBench: the FSDP2 row runs on gloo (CPU) only; leave it out with --device cuda")


# --- one fresh process -------------------------------------------------------------------


def _timers() -> dict[str, float]:
    from subclass_ca import _compat

    metrics = _compat.compile_time_metrics()
    return {name: sum(metrics.get(key, [])) for name, key in _TIMERS.items()}


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: round(after[k] - before[k], 4) for k in after}


class _Probes:
    """Wall time inside each :data:`_PROBES` call (outermost calls only), by name."""

    def __init__(self) -> None:
        import importlib

        self.seconds: dict[str, float] = dict.fromkeys(_PROBES, 0.0)
        self.missing: list[str] = []
        self._depth: dict[str, int] = dict.fromkeys(_PROBES, 0)
        for name, (module_name, path) in _PROBES.items():
            owner: Any = importlib.import_module(module_name)
            *outer, attr = path.split(".")
            try:
                for part in outer:
                    owner = getattr(owner, part)
                setattr(owner, attr, self._timed(name, getattr(owner, attr)))
            except AttributeError:
                self.missing.append(f"{module_name}:{path}")

    def _timed(self, name: str, function: Any) -> Any:
        import functools

        @functools.wraps(function)
        def timed(*args: Any, **kwargs: Any) -> Any:
            self._depth[name] += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self._depth[name] -= 1
                if not self._depth[name]:
                    self.seconds[name] += time.perf_counter() - start

        return timed

    def take(self) -> dict[str, float]:
        """The seconds since the last take, rounded, and zeroed."""
        taken = {name: round(value, 4) for name, value in self.seconds.items()}
        self.seconds = dict.fromkeys(_PROBES, 0.0)
        return taken


def _inner(t: Any) -> list[Any]:
    if t is None:
        return []
    if not hasattr(t, "__tensor_flatten__") or type(t).__name__ in ("Tensor", "Parameter"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for name in names for x in _inner(getattr(t, name))]


def _stack(model: str, backend: str, device: str) -> Any:
    """The regional stack row's workload: STACK_DEPTH depth-sweep blocks, each compiled on its own."""
    import torch

    from tools.bench import models as bench_models
    from tools.bench.depth import block_class

    torch.manual_seed(0)
    block = block_class(model.removeprefix("stack_"), 64)
    blocks = torch.nn.Sequential(*(block() for _ in range(STACK_DEPTH))).to(device)
    for each in blocks:
        each.compile(backend=backend)

    def forward(params: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        return blocks(x).sin().sum()

    params = [p for p in blocks.parameters() if p.requires_grad]
    return bench_models.Workload(model=model, size="small", params=params, inputs=(torch.randn(8, 64, device=device),),
                                 forward=forward)


def worker(model: str, mode: str, backend: str, launched_at: float, device: str = "cpu",
           forward_outside: bool = False) -> dict[str, Any]:
    """Time the first step of this fresh process (and a few steady steps) in ``mode``; ``launched_at``: ``time.time()`` at launch."""
    import torch

    import subclass_ca
    from subclass_ca import _compat
    from tools.bench import models as bench_models

    import_s = time.time() - launched_at  # interpreter start and `import torch, subclass_ca`
    probes = _Probes()
    imported = time.perf_counter()
    torch.set_num_threads(1)
    work = _stack(model, backend, device) if model.startswith("stack_") else bench_models.build(model, "small", device, tag="warm_start")

    def now() -> float:  # a CUDA step's time is its kernels' too
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    step = work.forward if model.startswith("stack_") else torch.compile(work.forward, backend=backend)  # each block compiled

    def backward(loss: torch.Tensor) -> None:
        if mode == "compile":
            loss.backward()
        elif mode == "stock_ca":
            with _compat.enable_compiled_autograd(_compat.stock_ca_compiler(backend)):
                loss.backward()
        else:  # subclass_ca, subclass_ca_saved
            with subclass_ca.enable(backend=backend):
                loss.backward()

    # subclass_ca's modes run the step inside one block, forward included, as the README shows: a forward with
    # subclass inputs compiled there gets a key by behaviour, so save_cache() writes its entry (Note [Keys by behaviour])
    inside = mode.startswith("subclass_ca") and not forward_outside
    block = subclass_ca.enable(backend=backend) if inside else contextlib.nullcontext()
    built = now()
    with block:
        loss = step(work.params, *work.inputs)
    forwarded = now()
    parts_fwd = probes.take()
    timers_fwd, counters_fwd = _timers(), _compat.cache_counters()
    traces_fwd = _compat.unique_graph_count()
    backward(loss)
    backwarded = now()
    parts_bwd = probes.take()
    timers_bwd, counters_bwd = _timers(), _compat.cache_counters()
    from subclass_ca._warm_start import traced

    backward_traces, replayed = _compat.unique_graph_count() - traces_fwd, traced.stats["replayed"]
    hasher = hashlib.sha256()
    for p in work.params:
        for t in _inner(p.grad):
            hasher.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    steady = []
    for _ in range(5):
        work.zero_grad()
        start = now()
        backward(step(work.params, *work.inputs))
        steady.append(now() - start)
    save_s = None
    if mode == "subclass_ca_saved":
        start = time.perf_counter()
        subclass_ca.save_cache()
        save_s = round(time.perf_counter() - start, 4)
    return {
        "save_s": save_s,
        "model": model, "mode": mode,
        "import_s": round(import_s, 4),
        "build_s": round(built - imported, 4),
        "forward_s": round(forwarded - built, 4),
        "backward_s": round(backwarded - forwarded, 4),
        "first_step_s": round(backwarded - built, 4),
        "steady_step_s": round(statistics.median(steady), 5),
        "forward_timers": _delta(timers_fwd, {k: 0.0 for k in timers_fwd}),
        "backward_timers": _delta(timers_bwd, timers_fwd),
        "forward_parts": parts_fwd, "backward_parts": parts_bwd, "probes_missing": probes.missing,
        "forward_counters": counters_fwd,
        "backward_counters": {k: counters_bwd[k] - counters_fwd[k] for k in counters_bwd},
        "backward_dynamo_traces": backward_traces,
        "backward_replayed": replayed,
        "grad_digest": hasher.hexdigest()[:16],
        "torch": str(torch.__version__), "device": device,
    }


def fsdp2_worker(rank: int, world_size: int, mode: str, backend: str) -> dict[str, Any]:
    """One rank of an FSDP2 sample: ``fsdp2_parity.train_fsdp2``'s first step and its steady ones."""
    import torch

    import subclass_ca
    from subclass_ca import _compat
    from tools.fsdp2 import parity as fsdp2_parity

    run = fsdp2_parity.FSDP2Run(steps=4, backend=backend, params="two_tensor")
    before = _compat.cache_counters()
    result = fsdp2_parity.train_fsdp2(rank, world_size, mode="subclass_ca" if mode == "subclass_ca_saved" else mode, run=run)
    counters = _compat.cache_counters()
    save_s = None
    if mode == "subclass_ca_saved":
        start = time.perf_counter()
        subclass_ca.save_cache()
        save_s = round(time.perf_counter() - start, 4)
    hasher = hashlib.sha256()
    for step in result["grads"]:
        for name in sorted(step):
            hasher.update(repr(step[name]).encode())
    times = result["step_times"]
    return {
        "model": "fsdp2_two_tensor", "mode": mode, "save_s": save_s, "import_s": 0.0,
        "forward_s": 0.0, "backward_s": round(times[0], 4), "first_step_s": round(times[0], 4),
        "steady_step_s": round(statistics.median(times[1:]), 5),
        "forward_timers": {k: 0.0 for k in _TIMERS}, "backward_timers": {k: 0.0 for k in _TIMERS},
        "forward_counters": {}, "backward_counters": {k: counters[k] - before[k] for k in counters},
        "grad_digest": hasher.hexdigest()[:16], "torch": str(torch.__version__),
    }


# --- the driver --------------------------------------------------------------------------


def _sample(model: str, mode: str, backend: str, cache_dir: str, timeout_s: float, device: str = "cpu",
            forward_outside: bool = False) -> dict[str, Any]:
    if model.startswith("fsdp2"):
        from subclass_ca.distributed import WorkerError, run_workers

        try:
            ranks = run_workers(fsdp2_worker, FSDP2_NPROC, timeout_s=timeout_s, args=(mode, backend),
                                env={"TORCHINDUCTOR_CACHE_DIR": cache_dir})
        except WorkerError as error:
            return {"model": model, "mode": mode, "error": [str(error).splitlines()[0]]}
        return ranks[0]
    env = checkout_env({**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir, "OMP_NUM_THREADS": "1"})
    args = [sys.executable, "-m", "tools.bench.warm_start", "--worker",
            json.dumps([model, mode, backend, time.time(), device, forward_outside])]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        return {"model": model, "mode": mode, "error": done.stderr.strip().splitlines()[-1:] or [f"exit {done.returncode}"]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def bench(settings: WarmStartBench, *, progress: Any = None) -> dict[str, Any]:
    """Cold and warm samples of every (model, mode); warm samples interleaved across modes."""
    from . import models as bench_models

    models = [m for m in settings.models if not bench_models.unavailable(m)]
    skipped = {m: bench_models.unavailable(m) for m in settings.models if m not in models}
    samples: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="subclass_ca-warm-") as root:
        folders = {(m, mode): os.path.join(root, f"{m}-{mode}") for m in models for mode in settings.modes}
        for (model, mode), folder in folders.items():
            samples[f"{model}/{mode}"] = {"cold": _sample(model, mode, settings.backend, folder, settings.timeout_s,
                                                          settings.device, settings.forward_outside), "warm": []}
            if progress:
                progress(f"{model}/{mode} cold")
        for rep in range(settings.warm_reps):
            for (model, mode), folder in folders.items():
                samples[f"{model}/{mode}"]["warm"].append(_sample(model, mode, settings.backend, folder, settings.timeout_s,
                                                                  settings.device, settings.forward_outside))
                if progress:
                    progress(f"{model}/{mode} warm {rep + 1}")
    rows = [_row(key, entry) for key, entry in samples.items()]
    results = {"settings": dataclasses.asdict(settings), "rows": rows, "skipped": skipped, "samples": samples}
    results["verdicts"] = _verdicts(rows)
    return results


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _row(key: str, entry: dict[str, Any]) -> dict[str, Any]:
    model, mode = key.split("/")
    cold, all_warm = entry["cold"], [s for s in entry["warm"] if "error" not in s]
    errors = [s["error"] for s in [cold, *entry["warm"]] if "error" in s]
    # the first restart is reported apart: it is the one that once compiled the CA graphs again
    # (Note [One CA graph for fresh and cached forwards]); the steady warm state is the later ones
    warm = all_warm[1:] or all_warm
    firsts = [s["first_step_s"] for s in warm]
    row: dict[str, Any] = {
        "model": model, "mode": mode, "errors": errors,
        "cold_first_step_s": cold.get("first_step_s"),
        "first_restart_s": all_warm[0]["first_step_s"] if all_warm else None,
        "first_restart_backward_counters": all_warm[0]["backward_counters"] if all_warm else {},
        "first_restart_replayed": all_warm[0].get("backward_replayed") if all_warm else None,
        "save_s": cold.get("save_s"),
        "warm_first_step_s": _median(firsts),
        "warm_spread_s": [round(min(firsts), 3), round(max(firsts), 3)] if firsts else None,
        "bitwise": bool(all_warm) and "grad_digest" in cold and all(s["grad_digest"] == cold["grad_digest"] for s in all_warm),
    }
    for part in ("import_s", "forward_s", "backward_s", "steady_step_s"):
        row[f"warm_{part}"] = _median([s[part] for s in warm])
    for phase in ("forward_timers", "backward_timers"):
        row[f"warm_{phase}"] = {k: _median([s[phase][k] for s in warm]) for k in _TIMERS} if warm else {}
    for phase in ("forward_parts", "backward_parts"):
        row[f"warm_{phase}"] = {k: _median([s[phase][k] for s in warm if phase in s]) for k in _PROBES} if warm else {}
    row["warm_backward_counters"] = warm[-1]["backward_counters"] if warm else {}
    row["warm_backward_dynamo_traces"] = warm[-1].get("backward_dynamo_traces") if warm else None
    row["warm_backward_replayed"] = warm[-1].get("backward_replayed") if warm else None
    row["warm_forward_counters"] = warm[-1].get("forward_counters", {}) if warm else {}
    row["cold_backward_counters"] = cold.get("backward_counters", {})
    row["cold_forward_counters"] = cold.get("forward_counters", {})
    if warm:  # what the first backward spends outside its CA-graph compile: capture and running
        row["warm_ca_capture_s"] = _median([s["backward_s"] - s["backward_timers"]["dynamo"] - s["steady_step_s"] for s in warm])
    return row


def _verdicts(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by = {(r["model"], r["mode"]): r for r in rows}
    ours = [r for r in rows if r["mode"] == "subclass_ca_saved" and r["warm_first_step_s"] is not None]

    def verdict(met: bool | None, detail: str) -> dict[str, Any]:
        return {"met": met, "detail": detail}

    out = {}
    pair = by.get(("pair", "subclass_ca_saved"))
    out["pair_1s"] = verdict(None, "no TwoTensor MLP row") if not pair or pair["warm_first_step_s"] is None else verdict(
        pair["warm_first_step_s"] <= 1.0, f"{pair['warm_first_step_s']:.2f} s")

    def against(mode: str, field: str, test: Any, fmt: str) -> dict[str, Any]:
        candidates = [(r, by.get((r["model"], mode))) for r in ours]
        pairs = [(r, o) for r, o in candidates if o and o.get(field) is not None and r.get(field) is not None]
        # a compile-only row that compiled nothing (Dynamo runs FSDP2-managed modules eagerly) is no reference
        skipped = [r["model"] for r, o in pairs if mode == "compile" and not _compiled_anything(o)]
        pairs = [(r, o) for r, o in pairs if r["model"] not in skipped]
        if not pairs:
            return verdict(None, f"no {mode} rows")
        met = all(test(r[field], o[field]) for r, o in pairs)
        detail = "; ".join(fmt.format(model=r["model"], ours=r[field], other=o[field], ratio=r[field] / o[field]) for r, o in pairs)
        if skipped:
            detail += f"; not compared: {', '.join(skipped)} (its compile-only run compiled no graph)"
        return verdict(met, detail)

    out["vs_compile"] = against("compile", "warm_first_step_s", lambda a, b: a <= 1.5 * b,
                                "{model}: {ours:.2f} s vs {other:.2f} s ({ratio:.2f}x)")
    out["vs_stock"] = against("stock_ca", "warm_first_step_s", lambda a, b: a < b, "{model}: {ours:.2f} s vs {other:.2f} s")
    saved = [r for r in rows if r["mode"] == "subclass_ca_saved" and r.get("first_restart_backward_counters")]
    compiled = {r["model"]: r["first_restart_backward_counters"] for r in saved
                if r["first_restart_backward_counters"].get("aot_miss") or r["first_restart_backward_counters"].get("aot_bypass")}
    out["first_restart"] = verdict(None, "no subclass_ca_saved rows") if not saved else verdict(
        not compiled, "; ".join(f"{m}: {c.get('aot_miss')} miss, {c.get('aot_bypass')} bypass" for m, c in compiled.items())
        or "; ".join(f"{r['model']}: {r['first_restart_backward_counters'].get('aot_hit')} hit, 0 miss"
                     f"{', replayed untraced' if r.get('first_restart_replayed') else ''}" for r in saved))
    unsplit = [r for r in rows if r["mode"] == "subclass_ca_saved" and r.get("warm_backward_dynamo_traces") is not None
               and not r["model"].startswith("fsdp2")]
    out["no_retrace"] = verdict(None, "no subclass_ca_saved rows") if not unsplit else verdict(
        all(r["warm_backward_dynamo_traces"] == 0 for r in unsplit),
        "; ".join(f"{r['model']}: {r['warm_backward_dynamo_traces']} traced, {r['warm_backward_replayed']} replayed" for r in unsplit))
    ours = [r for r in rows if r["mode"] == "subclass_ca" and r["cold_first_step_s"] is not None]
    out["cold"] = against("stock_ca", "cold_first_step_s", lambda a, b: a <= b, "{model}: {ours:.2f} s vs {other:.2f} s")
    out["bitwise"] = verdict(all(r["bitwise"] for r in rows), ", ".join(f"{r['model']}/{r['mode']}" for r in rows if not r["bitwise"])
                             or "every row")
    return out


def _compiled_anything(row: dict[str, Any]) -> bool:
    counters = [row.get("cold_backward_counters") or {}, row.get("cold_forward_counters") or {}]
    return any(c.get(k) for c in counters for k in ("aot_hit", "aot_miss", "aot_bypass"))


def format_summary(results: dict[str, Any]) -> str:
    lines = ["warm start (fresh process per sample, first step = first forward + first backward):",
             f"  {'model/mode':24s} {'cold':>8s} {'restart1':>8s} {'later':>8s} {'spread':>13s}  later fwd / bwd   CA graph cache (later)"]
    for r in results["rows"]:
        if r["errors"]:
            lines.append(f"  {r['model'] + '/' + r['mode']:24s} FAILED: {r['errors'][0]}")
            continue
        c = r["warm_backward_counters"]
        spread = f"{r['warm_spread_s'][0]:.2f}-{r['warm_spread_s'][1]:.2f}"
        lines.append(f"  {r['model'] + '/' + r['mode']:24s} {r['cold_first_step_s']:7.2f}s {r['first_restart_s']:7.2f}s "
                     f"{r['warm_first_step_s']:7.2f}s {spread:>13s}  "
                     f"{r['warm_forward_s']:.2f} / {r['warm_backward_s']:.2f} s   hit={c.get('aot_hit')} miss={c.get('aot_miss')} "
                     f"bypass={c.get('aot_bypass')}")
    _refresh(results)
    return "\n".join(lines + verdict_lines(TARGETS, results["verdicts"], indent="  "))


def _torch_of(results: dict[str, Any]) -> str:
    colds = [entry["cold"].get("torch") for entry in results.get("samples", {}).values()]
    return next((t for t in colds if t), "unknown")


def _refresh(results: dict[str, Any]) -> None:
    """Rows and verdicts from the raw samples (a results.json re-rendered by a newer version of this module)."""
    if results.get("samples"):
        results["rows"] = [_row(key, entry) for key, entry in results["samples"].items()]
    results["verdicts"] = _verdicts(results["rows"])


def markdown_section(results: dict[str, Any], *, command: str | None = None) -> str:
    """The RESULTS.md section: rows, the warm breakdown, the targets, the command."""
    _refresh(results)
    out = ["", "## Warm start: the first step of a restarted process", "",
           f"Command: `{command_of(results, command, 'python -m tools bench --warm-start')}` (torch {_torch_of(results)}).", "",
           "Each sample is a fresh process; cold = empty cache folder, then restarts on the folder the earlier processes of "
           f"the same (model, mode) filled ({results['settings']['warm_reps']} restarts: the first one apart, the later ones as "
           "median and min-max spread; the breakdown is of the later ones). First step = first forward + first backward, "
           "after `import torch, subclass_ca` and building the model. `subclass_ca_saved` calls `subclass_ca.save_cache()` "
           "after its steps in every process (its time is the last column), which writes the forward graphs' entries "
           "compiled autograd leaves unwritten (docs/warm_start.md)."
           + (" **Forward outside the block**: subclass_ca's modes compile the forward outside `enable()` and run only "
              "`loss.backward()` inside it." if results["settings"].get("forward_outside") else ""), "",
           "| model | mode | cold first step | first restart | later restarts (spread) | forward | backward | "
           "of which CA-graph Dynamo+AOT+inductor | AOT trace | cache loads | forward / CA graph in AOTAutogradCache | "
           "warm = cold bitwise | save_cache |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in results["rows"]:
        if r["errors"]:
            out.append(f"| {r['model']} | {r['mode']} | FAILED: {r['errors'][0]} |||||||||")
            continue
        bt, c, f = r["warm_backward_timers"], r["warm_backward_counters"], r["warm_forward_counters"]
        fwd_state = "hit" if f.get("aot_hit") else "miss"
        ca_state = "eager backward" if r["mode"] == "compile" else (
            "hit" if c.get("aot_hit") else "bypass" if c.get("aot_bypass") else "miss")
        save = f"{r['save_s']:.2f} s" if r.get("save_s") is not None else ""
        out.append(
            f"| {r['model']} | {r['mode']} | {r['cold_first_step_s']:.2f} s | {r['first_restart_s']:.2f} s | "
            f"{r['warm_first_step_s']:.2f} s ({r['warm_spread_s'][0]:.2f}-{r['warm_spread_s'][1]:.2f}) | {r['warm_forward_s']:.2f} s | "
            f"{r['warm_backward_s']:.2f} s | {bt.get('dynamo') or 0:.2f} s | {bt.get('aot_trace') or 0:.2f} s | {bt.get('cache_load') or 0:.2f} s | "
            f"{fwd_state} / {ca_state} | {'yes' if r['bitwise'] else 'NO'} | {save} |")
        if r["model"].startswith("fsdp2"):  # a whole training step on each rank: no split by phase
            hits = f"{c.get('aot_hit')} hit, {c.get('aot_miss')} miss, {c.get('aot_bypass')} bypass (every graph of the step)"
            out[-1] = (f"| {r['model']} | {r['mode']} | {r['cold_first_step_s']:.2f} s | {r['first_restart_s']:.2f} s | "
                       f"{r['warm_first_step_s']:.2f} s ({r['warm_spread_s'][0]:.2f}-{r['warm_spread_s'][1]:.2f}) | — | — | — | — | — | "
                       f"{hits} | {'yes' if r['bitwise'] else 'NO'} | {save} |")
    out += _parts_table(results["rows"])
    out += ["", "The FSDP2 row times rank 0's whole first step (forward, backward, reduce-scatters, optimizer) on "
            f"{FSDP2_NPROC} gloo processes; its stock_ca row is timed but trains wrong (stock compiled autograd leaves "
            "FSDP2 unsharded, docs/distributed.md).", "", "Targets (issue 34):", ""]
    for key, text in TARGETS.items():
        v = results["verdicts"][key]
        out.append(f"- {({True: 'met', False: '**missed**', None: 'n/a'})[v['met']]}: {text} — {v['detail']}")
    if results.get("skipped"):
        out.append("")
        out += [f"- not run: {m} ({why})" for m, why in results["skipped"].items()]
    return "\n".join(out) + "\n"


def _parts_table(rows: list[dict[str, Any]]) -> list[str]:
    """Where the later restarts' first step goes, by phase (medians of the probes, :data:`_PROBES`)."""
    if not any(any(v is not None for v in (r.get("warm_backward_parts") or {}).values()) for r in rows):
        return []
    out = ["", "Where the later restarts' first step goes (medians, seconds). *Forward key*: keys by behaviour of "
           "forwards with wrapper-subclass inputs compiled in the block. *CA capture*: compiled autograd walking the "
           "autograd graph and tracing it into the CA graph (fake inputs, pasting each AOT backward, the rest) — the "
           "backward up to subclass_ca's first call of the captured graph. *CA graph key*: its key by behaviour (the "
           "kept-trace lookup needs it). *Replay + run*: finding and installing the kept trace (or compiling), and the "
           "first run.", "",
           "| model | mode | first step | forward | of which forward key | backward | CA capture | of which fake inputs "
           "/ paste / end | CA graph key | replay + run |",
           "|---|---|---:|---:|---:|---:|---:|---|---:|---:|"]
    for r in rows:
        fwd, bwd = r.get("warm_forward_parts") or {}, r.get("warm_backward_parts") or {}
        if r["errors"] or r["model"].startswith("fsdp2") or r["warm_backward_s"] is None or all(v is None for v in bwd.values()):
            continue  # no phases (an FSDP2 row times a whole step; results from before the probes have none)
        first_call = bwd.get("ca_first_call") or 0.0
        capture = r["warm_backward_s"] - first_call if first_call else None
        inside = " / ".join(f"{bwd.get(k) or 0:.3f}" for k in ("capture_begin", "capture_paste", "capture_end"))
        key = bwd.get("key") or 0.0
        out.append(
            f"| {r['model']} | {r['mode']} | {r['warm_first_step_s']:.3f} | {r['warm_forward_s']:.3f} | {fwd.get('key') or 0:.3f} | "
            f"{r['warm_backward_s']:.3f} | {'—' if capture is None else f'{capture:.3f}'} | "
            f"{inside if r['mode'] != 'compile' else '—'} | {key:.3f} | {f'{first_call - key:.3f}' if first_call else '—'} |")
    return out


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools warm-start`` (also each sample's ``--worker`` process, run as ``python -m tools.bench.warm_start``)."""
    parser = argparse.ArgumentParser(prog="python -m tools warm-start", description=__doc__.splitlines()[0])
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--warm-reps", type=int, default=3)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--forward-outside", action="store_true",
                        help="subclass_ca's modes compile the forward outside the block, only the backward inside")
    parser.add_argument("--json", help="write the results here")
    return parser


def settings_from_args(argv: list[str]) -> WarmStartBench:
    """The settings ``argv`` asks for, validated (the GPU check's dry run parses its step with this)."""
    return _settings(build_parser().parse_args(argv))


def _settings(args: argparse.Namespace) -> WarmStartBench:
    return WarmStartBench(models=tuple(args.models), modes=tuple(args.modes), warm_reps=args.warm_reps, device=args.device,
                          forward_outside=args.forward_outside)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.worker:
        model, mode, backend, launched_at, device, forward_outside = json.loads(args.worker)
        print(json.dumps(worker(model, mode, backend, launched_at, device, forward_outside)))
        return 0
    results = bench(_settings(args), progress=lambda what: print(f"  done: {what}", file=sys.stderr))
    print(format_summary(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

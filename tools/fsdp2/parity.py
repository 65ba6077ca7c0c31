"""FSDP2 (``fully_shard``) training under subclass_ca, verified against eager FSDP2 and a dense reference.

``python -m tools fsdp2 --nproc 2`` trains one small MLP (per-layer and root
``fully_shard``, gloo on 127.0.0.1, or NCCL with ``--device cuda``; different data per rank) in several modes and checks
that every mode ends with the same sharded DTensor parameters and gradients as eager
FSDP2 and as a single-process dense model trained on the rank-averaged gradient:

* ``eager``       -- eager forward and backward (FSDP2's reference behaviour);
* ``compile``     -- ``torch.compile(model)`` forward, eager backward;
* ``subclass_ca`` -- ``torch.compile(model)`` forward, ``with subclass_ca.enable(): loss.backward()``;
* ``stock_ca``    -- the same with torch's stock compiled autograd (``fullgraph=False``, as a
  new user writes it): on torch 2.13 this one is wrong (see Note [FSDP2 under compiled
  autograd] in ``subclass_ca/_fsdp2.py``) and is reported, not hidden.

The functions are building blocks for the demo and the benchmark: :func:`train_fsdp2`
runs inside an initialised process group, :func:`launch` starts ``world_size`` processes
with a bounded timeout, :func:`dense_reference` and :func:`verify_against_dense` do the
checking.  See ``docs/distributed.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from subclass_ca import _compat
from tools.common import report
from tools.common.report import as_json as to_json

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = [
    "MODES",
    "FSDP2Run",
    "build_model",
    "shard",
    "backward_context",
    "plain_tensor",
    "rank_batch",
    "train_fsdp2",
    "dense_reference",
    "verify_against_dense",
    "compare_runs",
    "launch",
    "run_modes",
    "run_cases",
    "run_many",
    "summarize",
    "format_summary",
    "run_and_summarize",
    "BlockShape",
    "DEVICES",
    "markdown_section",
    "to_json",
    "TARGETS",
    "add_arguments",
    "run_config",
    "run_from_args",
    "build_parser",
    "demo_main",
    "main",
]

MODES: tuple[str, ...] = ("eager", "compile", "subclass_ca", "stock_ca")
TARGETS: dict[str, str] = {}
"""None: every mode is checked (``ok``) against eager FSDP2 and the dense run, not judged against a target."""
PARAM_DTYPES: tuple[str | None, ...] = (None, "bfloat16", "float16")
PARAM_KINDS: tuple[str, ...] = ("plain", "two_tensor", "nf4_lora")
DEVICES: tuple[str, ...] = ("cpu", "cuda")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockShape:
    """A stack of transformer blocks (RMSNorm -> causal SDPA attention -> SwiGLU), one ``fully_shard`` each."""

    blocks: int = 2
    seq: int = 16
    dim: int = 64
    heads: int = 4
    hidden: int = 128
    """SwiGLU width (``w1``/``w3``: dim -> hidden, ``w2``: hidden -> dim)."""

    def __post_init__(self) -> None:
        for name in ("blocks", "seq", "dim", "heads", "hidden"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"BlockShape.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.dim % self.heads:
            raise ValueError(f"BlockShape: dim ({self.dim}) must be a multiple of heads ({self.heads})")


@dataclasses.dataclass(frozen=True, kw_only=True)
class FSDP2Run:
    """One FSDP2 training run: the model, data and optimizer settings every mode shares."""

    steps: int = 3
    """SGD steps (each: zero_grad, forward, backward, step)."""
    batch: int = 8
    """Rows per rank and step (every rank gets different rows)."""
    dims: tuple[int, ...] = (16, 32, 32, 8)
    """MLP widths: Linear(dims[i], dims[i+1]) with ReLU between."""
    lr: float = 0.1
    """SGD learning rate."""
    seed: int = 0
    """Seed of the model initialisation (the data seed is derived from it, the step and the rank)."""
    backend: str = "aot_eager"
    """Backend of the compiled forward and of the CA graph."""
    reshard_after_forward: bool = True
    """``fully_shard(..., reshard_after_forward=...)`` of the per-layer modules."""
    compile_forward: bool = True
    """``torch.compile(model)`` the forward in the CA modes (False: eager forward, compiled backward)."""
    param_dtype: str | None = None
    """``MixedPrecisionPolicy(param_dtype=getattr(torch, param_dtype), reduce_dtype=torch.float32)`` on every
    ``fully_shard`` (None: no policy).  The dense reference stays float32, so it only matches within bf16 error."""
    params: str = "plain"
    """Parameter kind: "plain" tensors, "two_tensor" (every weight and bias a torch TwoTensor), or
    "nf4_lora" (frozen torchao NF4 base weights + trainable LoRA factors; needs torchao)."""
    accumulate: int = 1
    """Micro-batches per step: all but the last run with ``set_requires_gradient_sync(False)``
    (gradient accumulation without reduce-scatter), the last one syncs."""
    block: BlockShape | None = None
    """A stack of transformer blocks instead of the MLP of ``dims`` (``params`` applies to their projections)."""
    device: str = "cpu"
    """"cpu" (gloo) or "cuda" (NCCL, one GPU per rank): where the model, the data and the collectives run."""

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise ValueError(f"FSDP2Run.steps must be a positive int, got {self.steps!r}")
        if not isinstance(self.batch, int) or self.batch < 1:
            raise ValueError(f"FSDP2Run.batch must be a positive int, got {self.batch!r}")
        if len(self.dims) < 2 or any(not isinstance(d, int) or d < 1 for d in self.dims):
            raise ValueError(f"FSDP2Run.dims must be at least two positive ints, got {self.dims!r}")
        if self.params not in PARAM_KINDS:
            raise ValueError(f"FSDP2Run.params: got {self.params!r}, allowed values are {PARAM_KINDS}")
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"FSDP2Run.accumulate must be a positive int, got {self.accumulate!r}")
        for name in ("reshard_after_forward", "compile_forward"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"FSDP2Run.{name} must be True or False, got {getattr(self, name)!r}")
        if self.param_dtype not in PARAM_DTYPES:
            raise ValueError(f"FSDP2Run.param_dtype: got {self.param_dtype!r}, allowed values are {PARAM_DTYPES}")
        if self.block is not None and not isinstance(self.block, BlockShape):
            raise ValueError(f"FSDP2Run.block must be a BlockShape or None, got {self.block!r}")
        if self.device not in DEVICES:
            raise ValueError(f"FSDP2Run.device: got {self.device!r}, allowed values are {DEVICES}")

    @property
    def label(self) -> str:
        """A short name of the model: ``mlp``/``block`` and its parameter kind."""
        return f"{'mlp' if self.block is None else f'{self.block.blocks}x block'} {self.params}"


class _NF4LoRALinear(nn.Module):
    """A frozen torchao NF4 base weight plus trainable LoRA factors (QLoRA's linear layer)."""

    def __init__(self, linear: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        from tools.common.models import import_nf4

        to_nf4 = import_nf4()
        self.weight = nn.Parameter(to_nf4(linear.weight.detach().clone(), 8, 8), requires_grad=False)
        self.lora_a = nn.Parameter(torch.randn(rank, linear.in_features) * 0.1)
        self.lora_b = nn.Parameter(torch.randn(linear.out_features, rank) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        linear_nf4 = sys.modules[type(self.weight.to_local() if hasattr(self.weight, "to_local") else self.weight).__module__].linear_nf4
        return linear_nf4(x, self.weight) + (x @ self.lora_a.t()) @ self.lora_b.t()


def _block_model(run: FSDP2Run) -> nn.Sequential:
    from tools.common.models import Block

    shape = run.block
    assert shape is not None
    blocks = [Block(shape.dim, shape.heads, shape.hidden) for _ in range(shape.blocks)]
    model = nn.Sequential(*blocks)
    for block in blocks:
        if run.params == "two_tensor":
            # past the first projection the activations are TwoTensors, so the RMSNorm weights are TwoTensors too
            # (a plain weight would get a TwoTensor .grad)
            two_tensor = _compat.two_tensor_type()
            assert two_tensor is not None, "this torch has no TwoTensor"
            for module in block.modules():
                for name, param in list(module.named_parameters(recurse=False)):
                    setattr(module, name, nn.Parameter(two_tensor(param.detach().clone(), param.detach() * 0.5)))
        elif run.params == "nf4_lora":
            for parent in (block.attn, block.mlp):
                for name, child in list(parent.named_children()):
                    setattr(parent, name, _NF4LoRALinear(cast(nn.Linear, child)))  # Attention's and SwiGLU's children are Linears
    return model


def build_model(run: FSDP2Run) -> nn.Sequential:
    """The dense model, identically initialised in every process (seeded); ``run.params`` sets its parameter kind.

    The MLP of ``run.dims`` (one ``fully_shard`` per linear), or with ``run.block`` a stack of
    transformer blocks (one ``fully_shard`` per block), on ``run.device``.
    """
    torch.manual_seed(run.seed)
    if run.block is not None:
        return _block_model(run).to(_device(run))
    layers: list[nn.Module] = []
    for i, (d_in, d_out) in enumerate(zip(run.dims, run.dims[1:])):
        if i:
            layers.append(nn.ReLU())
        linear = nn.Linear(d_in, d_out)
        layer: nn.Module = linear
        if run.params == "two_tensor":
            two_tensor = _compat.two_tensor_type()
            assert two_tensor is not None, "this torch has no TwoTensor"
            for name, param in list(layer.named_parameters()):
                setattr(layer, name, nn.Parameter(two_tensor(param.detach().clone(), param.detach() * 0.5)))
        elif run.params == "nf4_lora":
            layer = _NF4LoRALinear(linear)
        layers.append(layer)
    return nn.Sequential(*layers).to(_device(run))


def _device(run: FSDP2Run) -> torch.device:
    if run.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def rank_batch(run: FSDP2Run, rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s (input, target) rows at ``step``: different on every rank and step."""
    generator = torch.Generator().manual_seed(10_000 * (run.seed + 1) + 100 * step + rank)
    if run.block is not None:
        shape = (run.batch, run.block.seq, run.block.dim)
        x, y = torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)
    else:
        x = torch.randn(run.batch, run.dims[0], generator=generator)
        y = torch.randn(run.batch, run.dims[-1], generator=generator)
    return x.to(_device(run)), y.to(_device(run))


def _loss(model: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y)


def micro_batch_rows(run: FSDP2Run) -> list[slice]:
    """The rows of a rank's batch each micro-batch takes (one micro-batch: all of them)."""
    return [slice(micro, None, run.accumulate) for micro in range(run.accumulate)]


def shard(model: nn.Sequential, run: FSDP2Run) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy: dict[str, Any] = {}
    if run.param_dtype is not None:
        policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=getattr(torch, run.param_dtype), reduce_dtype=torch.float32)
    from tools.common.models import Block

    for layer in model:
        if isinstance(layer, (nn.Linear, _NF4LoRALinear, Block)):
            fully_shard(layer, reshard_after_forward=run.reshard_after_forward, **policy)
    fully_shard(model, **policy)


def backward_context(mode: str, run: FSDP2Run) -> Any:
    if mode == "subclass_ca":
        from subclass_ca.api import enable

        return enable(backend=run.backend)
    if mode == "stock_ca":
        backend = run.backend
        return _compat.enable_compiled_autograd(lambda gm: torch.compile(gm, backend=backend), dynamic=True)
    return contextlib.nullcontext()


def _snapshot(tensors: dict[str, torch.Tensor | None]) -> dict[str, Any]:
    """Full (gathered) values, types, placements and local shard shapes of DTensors or plain tensors."""
    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, Any] = {}
    for name, t in tensors.items():
        if t is None:
            out[name] = {"type": None}
        elif isinstance(t, DTensor):
            out[name] = {
                "type": "DTensor",
                "placements": tuple(str(p) for p in t.placements),
                "sharded": any(isinstance(p, Shard) for p in t.placements),
                "local_shape": tuple(t.to_local().shape),
                "full": _gathered(t.detach()),
            }
        else:
            out[name] = {"type": type(t).__name__, "placements": None, "sharded": False, "local_shape": tuple(t.shape), "full": t.detach().clone()}
    return out


def _gathered(t: Any) -> torch.Tensor:
    """The full value of a DTensor; for a wrapper-subclass local shard (TwoTensor), its own inner tensors.

    ``full_tensor()`` of a DTensor over TwoTensor shards was seen to differ between two runs whose
    local shards are bitwise equal (half the elements: one inner tensor), so those are compared per rank.
    """
    local: torch.Tensor = t.to_local()
    if type(local) is torch.Tensor or not _compat.is_traceable_wrapper_subclass(local):
        return t.full_tensor().clone()
    return plain_tensor(local)


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """A plain copy of ``t``: a wrapper subclass (TwoTensor, NF4) as its inner tensors stacked, for exact comparison."""
    if type(t) is torch.Tensor or isinstance(t, nn.Parameter) or not _compat.is_traceable_wrapper_subclass(t):
        return t.clone()
    names, _ = t.__tensor_flatten__()
    return torch.cat([plain_tensor(getattr(t, n)).reshape(-1).float() for n in names])


def train_fsdp2(rank: int, world_size: int, *, mode: str = "subclass_ca", run: FSDP2Run | None = None) -> dict[str, Any]:
    """Train the FSDP2 MLP for ``run.steps`` SGD steps in ``mode``; call in every rank of a process group.

    Returns (identically on every rank, except ``local_shapes``) the parameters after the
    last step, the gradients of every step, their types/placements, the losses and the
    per-step wall times (``step_times``; the first includes compilation).
    """
    import torch.distributed as dist

    run = run or FSDP2Run()
    if mode not in MODES:
        raise ValueError(f"train_fsdp2(mode=...): got {mode!r}, allowed values are {MODES}")
    if not dist.is_initialized() or dist.get_world_size() != world_size or dist.get_rank() != rank:
        raise RuntimeError(f"train_fsdp2 needs an initialised process group of size {world_size} (rank {rank})")
    model = build_model(run)
    shard(model, run)
    forward: Callable[..., torch.Tensor] = model
    if mode in ("compile", "stock_ca") or (mode == "subclass_ca" and run.compile_forward):
        forward = torch.compile(model, backend=run.backend)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=run.lr)
    losses, step_times, grads = [], [], []
    backward_graphs: list[int] = []
    graph_breaks: list[int] = []
    for step in range(run.steps):
        x, y = rank_batch(run, rank, step)
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        graphs = breaks = 0
        for micro, rows in enumerate(micro_batch_rows(run)):
            last = micro == run.accumulate - 1
            if run.accumulate > 1:
                cast("FSDPModule", model).set_requires_gradient_sync(last)  # accumulate locally, reduce-scatter on the last one
            loss = _loss(forward, x[rows], y[rows])
            graphs_before, breaks_before = _compat.unique_graph_count(), sum(_compat.graph_break_counts().values())
            with backward_context(mode, run):
                loss.backward()
            graphs += _compat.unique_graph_count() - graphs_before
            breaks += sum(_compat.graph_break_counts().values()) - breaks_before
        backward_graphs.append(graphs)
        graph_breaks.append(breaks)
        grads.append(_snapshot({n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
        optimizer.step()
        step_times.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    params = _snapshot({n: p for n, p in model.named_parameters() if p.requires_grad})
    from subclass_ca.diagnostics import last_report

    report = last_report() if mode == "subclass_ca" else None
    return {
        "ca_captures": int(_compat.ca_counters().get("captures", 0)),
        "report_fallbacks": list(report.fallbacks) if report is not None else [],
        "report_fullgraph": report.fullgraph if report is not None else None,
        "report_split_pieces": report.split_pieces if report is not None else None,
        "report_split_hooks": report.split_hooks if report is not None else None,
        "mode": mode,
        "rank": rank,
        "world_size": world_size,
        "run": dataclasses.asdict(run),
        "params": params,
        "grads": grads,
        "losses": losses,
        "step_times": step_times,
        "backward_graphs": backward_graphs,
        "graph_breaks": graph_breaks,
    }


def dense_reference(run: FSDP2Run, world_size: int) -> dict[str, Any]:
    """Single-process dense training on the rank-averaged gradient (what FSDP2 must reproduce).

    With gradient accumulation each rank's gradient is the sum over its micro-batches' losses,
    which FSDP2 then averages over the ranks.  Trains on ``run.device``; returns CPU tensors.
    """
    model = build_model(run)
    optimizer = torch.optim.SGD(model.parameters(), lr=run.lr)
    grads = []
    for step in range(run.steps):
        optimizer.zero_grad(set_to_none=True)
        batches = [rank_batch(run, rank, step) for rank in range(world_size)]
        total = cast(torch.Tensor, sum(_loss(model, x[rows], y[rows]) for x, y in batches for rows in micro_batch_rows(run)))
        (total / world_size).backward()
        # only for run.params == "plain": every parameter is trainable and has a gradient
        grads.append({n: _host(cast(torch.Tensor, p.grad)) for n, p in model.named_parameters()})
        optimizer.step()
    return {"params": {n: _host(p) for n, p in model.named_parameters()}, "grads": grads}


def _host(t: torch.Tensor) -> torch.Tensor:
    """A CPU copy: the ranks' results arrive on CPU (``run_workers`` loads them there), so the reference lives there too."""
    return t.detach().to("cpu", copy=True)


def _full_problems(label: str, got: dict[str, Any], want: dict[str, torch.Tensor], tolerance: dict[str, Any]) -> list[str]:
    problems = []
    for name, expected in want.items():
        entry = got.get(name, {"type": None})
        if entry["type"] != "DTensor":
            problems.append(f"{label} {name}: expected a sharded DTensor, got {entry['type']}")
            continue
        if not entry["sharded"]:
            problems.append(f"{label} {name}: expected a Shard placement, got {entry['placements']}")
        try:
            torch.testing.assert_close(entry["full"], expected, **tolerance)
        except AssertionError as error:
            first = str(error).strip().splitlines()
            problems.append(f"{label} {name}: value differs ({'; '.join(first[:3])})")
    return problems


def verify_against_dense(
    result: dict[str, Any], reference: dict[str, Any], *, atol: float | None = None, rtol: float | None = None
) -> list[str]:
    """Problems (empty: none) between one rank's FSDP2 result and the dense reference.

    Every parameter and every step's gradient must be a sharded DTensor whose full value
    matches the reference (default float tolerances: reduce-scatter sums in another order).
    """
    tolerance = {} if atol is None and rtol is None else {"atol": atol or 0.0, "rtol": rtol or 0.0}
    problems = _full_problems(f"[{result['mode']}] param", result["params"], reference["params"], tolerance)
    for step, (got, want) in enumerate(zip(result["grads"], reference["grads"])):
        problems += _full_problems(f"[{result['mode']}] step {step} grad", got, want, tolerance)
    return problems


def compare_runs(result: dict[str, Any], baseline: dict[str, Any], *, atol: float = 0.0, rtol: float = 0.0) -> list[str]:
    """Problems between two FSDP2 runs (e.g. subclass_ca vs eager FSDP2): types, placements, values."""
    tolerance = {"atol": atol, "rtol": rtol}
    label = f"[{result['mode']} vs {baseline['mode']}]"
    want = {n: e["full"] for n, e in baseline["params"].items() if e["type"] is not None}
    problems = _full_problems(f"{label} param", result["params"], want, tolerance)
    for step, (got, base) in enumerate(zip(result["grads"], baseline["grads"])):
        want = {n: e["full"] for n, e in base.items() if e["type"] is not None}
        problems += _full_problems(f"{label} step {step} grad", got, want, tolerance)
        for name, entry in base.items():
            if entry["type"] is not None and got[name].get("local_shape") != entry["local_shape"]:
                problems.append(f"{label} step {step} grad {name}: local shard {got[name].get('local_shape')} != {entry['local_shape']}")
    return problems


# --- multi-process launch ----------------------------------------------------------


def launch(
    fn: Callable[..., Any], world_size: int = 2, *, timeout_s: float = 120.0, args: Sequence[Any] = (), device: str = "cpu"
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on ``world_size`` fresh processes (gloo, 127.0.0.1; NCCL with ``device="cuda"``); results by rank.

    A thin front for :func:`subclass_ca.distributed.run_workers` (bounded, fail-fast, no orphans):
    a rank that raises, dies or outlives ``timeout_s`` raises ``WorkerError`` with its traceback.
    """
    from subclass_ca.distributed import run_workers

    return run_workers(fn, world_size, timeout_s=timeout_s, args=tuple(args), device=device)


def run_modes(
    modes: Sequence[str] = MODES, *, world_size: int = 2, run: FSDP2Run | None = None, timeout_s: float = 120.0
) -> dict[str, list[dict[str, Any]]]:
    """All ``modes`` in one launch (one process group, modes run one after another)."""
    run = run or FSDP2Run()
    results = launch(_train_modes, world_size, timeout_s=timeout_s, args=(tuple(modes), run), device=run.device)
    return {mode: [result[mode] for result in results] for mode in modes}


def run_cases(
    cases: Sequence[tuple[Sequence[str], FSDP2Run]], *, world_size: int = 2, timeout_s: float = 120.0
) -> list[dict[str, list[dict[str, Any]]]]:
    """Several ``(modes, run)`` cases in one launch (one process group, paying process start once); by case."""
    cases = [(tuple(modes), run) for modes, run in cases]
    devices = sorted({run.device for _, run in cases})
    if len(devices) > 1:
        raise ValueError(f"run_cases: one launch runs on one device, got cases on {devices}; launch each device separately")
    results = launch(_train_cases, world_size, timeout_s=timeout_s, args=(cases,), device=devices[0] if devices else "cpu")
    return [{mode: [result[index][mode] for result in results] for mode in modes} for index, (modes, _) in enumerate(cases)]


def _train_cases(rank: int, world_size: int, cases: Sequence[tuple[Sequence[str], FSDP2Run]]) -> list[dict[str, Any]]:
    return [_train_modes(rank, world_size, modes, run) for modes, run in cases]


def run_many(
    runs: Sequence[FSDP2Run], modes: Sequence[str] = ("eager", "subclass_ca"), *, world_size: int = 2, timeout_s: float = 120.0
) -> list[dict[str, list[dict[str, Any]]]]:
    """Several runs, each in all ``modes``, in one launch (one process group): results per run, then per mode and rank."""
    return run_cases([(modes, run) for run in runs], world_size=world_size, timeout_s=timeout_s)


def _train_modes(rank: int, world_size: int, modes: Sequence[str], run: FSDP2Run) -> dict[str, Any]:
    from subclass_ca.api import reset

    out: dict[str, Any] = {}
    for mode in modes:
        reset()
        _compat.dynamo_counters().clear()
        try:
            out[mode] = train_fsdp2(rank, world_size, mode=mode, run=run)
        except Exception as error:  # noqa: BLE001 - one mode's failure is a result, not a crash
            out[mode] = {"mode": mode, "error_type": type(error).__name__, "message": str(error)}
    return out


# --- summaries for the CLI, the demo and the benchmark ------------------------------


def _median_step(result: dict[str, Any]) -> float:
    """Median step time in seconds, without the first step (it compiles)."""
    times = result["step_times"][1:] or result["step_times"]
    return statistics.median(times)


def summarize(by_mode: dict[str, list[dict[str, Any]]], run: FSDP2Run, world_size: int) -> dict[str, Any]:
    """A JSON-able verdict per mode: correct vs dense / vs eager FSDP2, median step time, ratio to eager.

    The dense reference is plain float tensors: for subclass parameters (TwoTensor, NF4-LoRA)
    a mode is judged against eager FSDP2 only (``matches_dense`` None).
    """
    reference = dense_reference(run, world_size) if run.params == "plain" else None
    eager = by_mode.get("eager", [None])[0]
    eager_ok = eager is not None and "error_type" not in eager
    modes: dict[str, Any] = {}
    for mode, per_rank in by_mode.items():
        if any("error_type" in r for r in per_rank):
            failed = next(r for r in per_rank if "error_type" in r)
            modes[mode] = {"ok": False, "error": f"{failed['error_type']}: {failed['message'].splitlines()[0] if failed['message'] else ''}"}
            continue
        # a low-precision param_dtype computes in bf16/fp16: the float32 dense run is matched within that error only
        tolerance = {"atol": 2e-2, "rtol": 2e-2} if run.param_dtype else {}
        dense_problems = [p for r in per_rank for p in verify_against_dense(r, reference, **tolerance)] if reference else []
        eager_problems = [p for r, e in zip(per_rank, by_mode["eager"]) for p in compare_runs(r, e)] if eager_ok else None
        step_s = max(_median_step(r) for r in per_rank)  # the slowest rank sets the pace
        modes[mode] = {
            "ok": not dense_problems if reference else bool(eager_problems is not None and not eager_problems),
            "matches_dense": not dense_problems if reference else None,
            "bitwise_equal_to_eager": None if eager_problems is None else not eager_problems,
            "median_step_ms": 1e3 * step_s,
            "problems": dense_problems[:5],
        }
    if eager_ok and "eager" in modes:
        for entry in modes.values():
            if "median_step_ms" in entry:
                entry["ratio_vs_eager"] = entry["median_step_ms"] / modes["eager"]["median_step_ms"]
    return {
        "world_size": world_size,
        "run": dataclasses.asdict(run),
        "torch": torch.__version__,
        "modes": modes,
        "ok": all(entry["ok"] for mode, entry in modes.items() if mode != "stock_ca"),
    }


def _setup_words(run: dict[str, Any]) -> str:
    """The non-default training setup of a summary's run, as words after its step count."""
    words = []
    if run.get("param_dtype"):
        words.append(f"param_dtype {run['param_dtype']}")
    if run.get("accumulate", 1) > 1:
        words.append(f"{run['accumulate']} micro-batches per step")
    if not run.get("reshard_after_forward", True):
        words.append("reshard_after_forward=False")
    return "".join(f", {word}" for word in words)


def _device_words(run: dict[str, Any]) -> str:
    return "cuda (NCCL)" if run.get("device") == "cuda" else "cpu (gloo)"


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a plain-text table."""
    run = summary["run"]
    lines = [
        f"FSDP2 {'MLP ' + str(tuple(run['dims'])) if run.get('block') is None else str(run['block']['blocks']) + 'x transformer block'} "
        f"{run['params']}, world_size {summary['world_size']}, {run['steps']} SGD steps{_setup_words(run)}, "
        f"backend {run['backend']}, {_device_words(run)}, torch {summary['torch']}",
        f"{'mode':12s} {'median step ms':>15s} {'x eager':>8s}  {'vs dense':10s} {'vs eager FSDP2':15s}",
    ]
    for mode, entry in summary["modes"].items():
        if "error" in entry:
            lines.append(f"{mode:12s} {'-':>15s} {'-':>8s}  error: {entry['error']}")
            continue
        ratio = entry.get("ratio_vs_eager")
        equal = entry["bitwise_equal_to_eager"]
        lines.append(
            f"{mode:12s} {entry['median_step_ms']:15.2f} {'-' if ratio is None else f'{ratio:.2f}':>8s}  "
            f"{ {True: 'ok', False: 'WRONG', None: 'n/a'}[entry['matches_dense']]:10s} {'-' if equal is None else ('bitwise' if equal else 'differs'):15s}"
        )
        lines += [f"    {problem}" for problem in entry["problems"][:3]]
    if "stock_ca" in summary["modes"]:
        lines.append("stock_ca = torch's own compiled autograd (fullgraph=False), shown for comparison; see docs/distributed.md")
    return "\n".join(lines)


def run_and_summarize(
    modes: Sequence[str] = MODES, *, world_size: int = 2, run: FSDP2Run | None = None, timeout_s: float = 300.0
) -> dict[str, Any]:
    """Launch, train every mode and summarise: the one call the demo and the benchmark need."""
    run = run or FSDP2Run()
    return summarize(run_modes(modes, world_size=world_size, run=run, timeout_s=timeout_s), run, world_size)


def markdown_section(summary: dict[str, Any], *, command: str | None = None) -> str:
    """A markdown section for :func:`run_and_summarize`'s summary (``python -m tools fsdp2 --markdown``)."""
    run = summary["run"]
    lines = [
        "",
        "## FSDP2 (fully_shard) training, 2 processes",
        "",
        f"MLP {tuple(run['dims'])}, per-layer + root `fully_shard`, world_size {summary['world_size']} ({_device_words(run)}, "
        f"127.0.0.1, different data per rank), {run['params']} parameters, SGD, {run['steps']} steps{_setup_words(run)}; "
        "median step time (forward + backward + "
        f"step, slowest rank) excluding the first (compiling) step; backend `{run['backend']}`, torch {summary['torch']}. "
        "Correctness: sharded DTensor parameters and every step's gradients against a single-process dense model "
        "on the rank-averaged gradient, and bitwise against eager FSDP2.",
        "",
        "| mode | median step (ms) | x eager FSDP2 | matches dense | bitwise = eager FSDP2 |",
        "|---|---:|---:|---|---|",
    ]
    for mode, entry in summary["modes"].items():
        if "error" in entry:
            lines.append(f"| {mode} | - | - | error: {entry['error']} | - |")
            continue
        ratio = entry.get("ratio_vs_eager")
        equal = entry["bitwise_equal_to_eager"]
        lines.append(
            f"| {mode} | {entry['median_step_ms']:.2f} | {'-' if ratio is None else f'{ratio:.2f}'} | "
            f"{ {True: 'yes', False: 'NO', None: 'n/a'}[entry['matches_dense']]} | {'-' if equal is None else ('yes' if equal else 'no')} |"
        )
    lines += [
        "",
        f"Command: `{report.command_of(summary, command, 'python -m tools fsdp2')}`.  Stock compiled autograd is not timed: "
        "on torch 2.13 it leaves FSDP2's first layer unsharded with an un-reduced gradient (see docs/distributed.md).",
        "",
    ]
    return "\n".join(lines)


def demo_main(args: argparse.Namespace) -> int:
    """``python -m tools demo --fsdp2 --nproc N``: the four modes, a table and ``fsdp2_results.json``."""
    import json
    from pathlib import Path

    from subclass_ca.distributed import WorkerError

    steps = getattr(args, "steps", None) or 3
    backend = getattr(args, "backend", None) or "aot_eager"
    print(f"FSDP2 (fully_shard) training on {args.nproc} processes (gloo, 127.0.0.1), {steps} SGD steps, "
          f"modes {', '.join(MODES)}")
    try:
        summary = run_and_summarize(MODES, world_size=args.nproc, run=FSDP2Run(steps=steps, backend=backend),
                                    timeout_s=getattr(args, "timeout", 300.0))
    except WorkerError as error:
        print(f"FSDP2 run FAILED: {error}", file=sys.stderr)
        return 1
    print(format_summary(summary))
    out = Path(getattr(args, "out", "demo-out"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "fsdp2_results.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out / 'fsdp2_results.json'}")
    return 0 if summary["ok"] else 1


# --- CLI ---------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser, *, steps: int = 3) -> None:
    """The FSDP2 options (shared with ``python -m tools demo --fsdp2``)."""
    parser.add_argument("--fsdp2-modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--fsdp2-steps", type=int, default=steps, help=f"SGD steps per mode (default {steps})")
    parser.add_argument("--no-reshard-after-forward", action="store_true", help="fully_shard(reshard_after_forward=False)")
    parser.add_argument("--param-dtype", choices=[d for d in PARAM_DTYPES if d], default=None,
                        help="MixedPrecisionPolicy(param_dtype=..., reduce_dtype=float32) on every fully_shard")
    parser.add_argument("--accumulate", type=int, default=1, metavar="N",
                        help="micro-batches per step, all but the last under set_requires_gradient_sync(False) (default 1)")
    parser.add_argument("--params", choices=PARAM_KINDS, default="plain",
                        help="parameter kind: plain, two_tensor (TwoTensor weights) or nf4_lora (QLoRA; needs torchao)")


def run_config(args: argparse.Namespace, *, backend: str | None = None) -> tuple[list[str], FSDP2Run]:
    """The modes and the run the shared options name, validated, nothing launched (raises ValueError on bad values)."""
    modes = [m.strip() for m in args.fsdp2_modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        raise ValueError(f"--fsdp2-modes: unknown {unknown}; allowed values are {list(MODES)}")
    run = FSDP2Run(steps=args.fsdp2_steps, backend=backend or "aot_eager",
                   reshard_after_forward=not args.no_reshard_after_forward,
                   param_dtype=getattr(args, "param_dtype", None),
                   accumulate=getattr(args, "accumulate", 1), params=getattr(args, "params", "plain"),
                   device=getattr(args, "device", None) or "cpu")
    return modes, run


def run_from_args(args: argparse.Namespace, *, backend: str | None = None) -> dict[str, Any]:
    """Parse the shared options, run, summarise (raises ValueError on unknown modes)."""
    modes, run = run_config(args, backend=backend)
    return run_and_summarize(modes, world_size=args.nproc, run=run, timeout_s=args.timeout)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools fsdp2``."""
    parser = argparse.ArgumentParser(prog="python -m tools fsdp2", description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2, help="world size (processes on 127.0.0.1)")
    parser.add_argument("--device", choices=DEVICES, default="cpu", help="gloo on CPU or NCCL on CUDA (one GPU per rank)")
    parser.add_argument("--backend", default="aot_eager")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before the ranks are terminated")
    parser.add_argument("--json", metavar="PATH", help="also write the summary as JSON")
    parser.add_argument("--markdown", metavar="PATH", help="also write the summary as a markdown section")
    add_arguments(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(argv) if argv is not None else sys.argv[1:]
    args = parser.parse_args(argv)
    try:
        summary = run_from_args(args, backend=args.backend)
    except ValueError as error:
        parser.error(str(error))
    summary.setdefault("command", " ".join(["python -m tools fsdp2", *argv]))
    print(format_summary(summary))
    report.write(sys.modules[__name__], summary, json_path=args.json, markdown_path=args.markdown)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

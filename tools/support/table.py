"""``python -m tools versions``: the support table, from real runs, one JSON per torch lane.

``versions run --json FILE`` runs every row on the installed torch twice, under stock
compiled autograd and under ``subclass_ca.enable()``, and records pass / fail (with the error)
/ skip (with the reason).  Progress goes to stderr from the start (a tqdm bar when tqdm is
installed, else one line per row as it starts; ``--no-progress`` turns it off), each row's
result to stdout when it ends.  ``versions render FILE... --out docs/versions.md`` merges the
lanes into one markdown table.  ``make versions`` does both for every lane.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import platform
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import subclass_ca
from subclass_ca import _compat
from subclass_ca._compat.version import parse_torch_version
from subclass_ca.testing.scenarios import scenario_names
from subclass_ca.testing.specs import ZOO_SPECS, builtin_specs
from subclass_ca.testing.suite import run_scenario
from tools import ROOT, checkout_env
from tools.common.progress import Progress

MODES = ("stock", "subclass_ca")
KIT_SUBCLASSES = ("two_tensor", "int8", "nested_pair", "tagged")
BACKEND = "aot_eager"


def _stock(backend: str, **_: Any) -> Any:
    return _compat.enable_compiled_autograd(_compat.stock_ca_compiler(backend))


def _stock_captures() -> int:
    return int(_compat.ca_counters().get("captures", 0))


def _context(mode: str, backend: str = BACKEND, **kwargs: Any) -> Any:
    return _stock(backend) if mode == "stock" else subclass_ca.enable(backend, **kwargs)


def _outcome(fn: Callable[[], None]) -> dict[str, str]:
    subclass_ca.reset()
    try:
        fn()
    except _Skip as skip:
        return {"status": "skip", "detail": str(skip)}
    except Exception as error:  # noqa: BLE001 - the outcome being recorded
        first = (str(error).strip().splitlines() or [""])[0][:160]
        return {"status": "fail", "detail": f"{type(error).__name__}: {first}"}
    finally:
        subclass_ca.reset()
    return {"status": "pass", "detail": ""}


class _Skip(Exception):
    pass


def _close(want: Any, got: Any) -> None:
    if type(want) is not type(got):
        raise AssertionError(f"type {type(got).__name__} != eager {type(want).__name__}")
    parts = (want.__tensor_flatten__()[0] if hasattr(want, "__tensor_flatten__") else [None])
    for name in parts:
        a, b = (want, got) if name is None else (getattr(want, name), getattr(got, name))
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


# --- training-style rows ---------------------------------------------------------------


def _two_tensor() -> type:
    cls = _compat.two_tensor_type()
    if cls is None:
        raise _Skip("torch.testing._internal.two_tensor is missing")
    return cls


def _linear_with_two_tensor_weight() -> torch.nn.Linear:
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4)
    dense = linear.weight.detach()
    linear.weight = torch.nn.Parameter(_two_tensor()(dense.clone(), dense * 2))
    return linear


def _compiled_train_step(mode: str | None, flag: bool) -> list[Any]:
    linear = _linear_with_two_tensor_weight()
    optimizer = torch.optim.SGD(linear.parameters(), lr=0.1)

    def train_step(x: torch.Tensor) -> torch.Tensor:
        loss = linear(x).sin().sum()
        loss.backward()
        return loss.detach()

    patch = _compat.compiled_autograd_flag() if flag and mode else contextlib.nullcontext()
    with patch, (_context(mode) if mode else contextlib.nullcontext()):
        step = torch.compile(train_step, backend=BACKEND) if mode else train_step
        for index in range(3):
            step(torch.randn(2, 4, generator=torch.Generator().manual_seed(index)))
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach() for p in linear.parameters()]


def _row_compiled_train_step(flag: bool) -> Callable[[str], None]:
    def run(mode: str) -> None:
        for want, got in zip(_compiled_train_step(None, flag), _compiled_train_step(mode, flag)):
            _close(want, got)

    return run


def _optimizer_in_backward(mode: str | None) -> list[Any]:
    linear = _linear_with_two_tensor_weight()
    optimizers: dict[torch.Tensor, torch.optim.SGD] = {p: torch.optim.SGD([p], lr=0.1) for p in linear.parameters()}

    def hook(param: torch.Tensor) -> None:
        optimizers[param].step()
        optimizers[param].zero_grad()

    for p in linear.parameters():
        p.register_post_accumulate_grad_hook(hook)
    forward = torch.compile(lambda x: linear(x).sin().sum(), backend=BACKEND) if mode else (lambda x: linear(x).sin().sum())
    if mode == "stock":
        context = _compat.enable_compiled_autograd(lambda gm: torch.compile(gm, backend=BACKEND, fullgraph=False))
    elif mode:
        context = subclass_ca.enable(BACKEND, fullgraph=False)
    else:
        context = contextlib.nullcontext()
    with context:
        for index in range(3):
            forward(torch.randn(2, 4, generator=torch.Generator().manual_seed(index))).backward()
    return [p.detach() for p in linear.parameters()]


def _row_optimizer_in_backward(mode: str) -> None:
    for want, got in zip(_optimizer_in_backward(None), _optimizer_in_backward(mode)):
        _close(want, got)


def _row_compiled_adamw_plain_params_subclass_grads(mode: str) -> None:
    """A compiled AdamW step inside the block: == eager, or torch's own error (never different values)."""

    def train(compiled: str | None) -> list[torch.Tensor]:
        torch.manual_seed(0)
        dense = torch.randn(4, 4)
        weight = torch.nn.Parameter(_two_tensor()(dense.clone(), dense * 2))
        linear = torch.nn.Linear(4, 3)
        params = [weight, *linear.parameters()]
        optimizer = torch.optim.AdamW(params, lr=0.1)
        step = torch.compile(optimizer.step, backend=BACKEND) if compiled else optimizer.step
        loss_fn = lambda x: linear(x @ weight).sin().sum()  # noqa: E731
        with _context(compiled) if compiled else contextlib.nullcontext():
            forward = torch.compile(loss_fn, backend=BACKEND) if compiled else loss_fn
            for index in range(3):
                forward(torch.randn(3, 4, generator=torch.Generator().manual_seed(index))).backward()
                step()
                optimizer.zero_grad()
        return [p.detach() for p in params]

    for want, got in zip(train(None), train(mode)):
        _close(want, got)


def _row_retry_after_refused_capture(mode: str) -> None:
    """Double backward through a compiled region is refused; the retry must give the same refusal."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(_two_tensor()(torch.randn(4, 4), torch.randn(4, 4)))
    step = torch.compile(lambda x: (x @ weight).sin().sum(), backend=BACKEND)
    context = _context(mode, report=True) if mode == "subclass_ca" else _stock(BACKEND)
    with context:
        for _ in range(2):
            try:
                step(torch.randn(3, 4)).backward(create_graph=True)
            except RuntimeError as error:
                if "higher order gradients" not in str(error):
                    raise
            else:
                raise AssertionError("double backward was not refused")


def _row_nested_jagged(mode: str) -> None:
    """A nested jagged tensor (variable-length batch) through a compiled forward."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    rows = [torch.randn(n, 4) for n in (2, 3, 5)]

    def loss_fn(nested: torch.Tensor) -> torch.Tensor:
        return (nested @ weight).sin().values().sum()

    nested = torch.nested.nested_tensor(rows, layout=torch.jagged)
    loss_fn(nested).backward()
    want, weight.grad = weight.grad, None
    with _context(mode):
        torch.compile(loss_fn, backend=BACKEND)(torch.nested.nested_tensor(rows, layout=torch.jagged)).backward()
    _close(want, weight.grad)


EXTRA_ROWS: dict[str, Callable[[str], None]] = {
    "compiled train step, backward inside (graph break)": _row_compiled_train_step(flag=False),
    "compiled train step, backward inside (compiled_autograd flag)": _row_compiled_train_step(flag=True),
    "optimizer-in-backward hooks (fullgraph=False)": _row_optimizer_in_backward,
    "compiled AdamW over plain params with subclass grads": _row_compiled_adamw_plain_params_subclass_grads,
    "retry after a refused capture, cache-miss reasons on": _row_retry_after_refused_capture,
    "nested jagged tensor through a compiled forward": _row_nested_jagged,
}


def _kit_rows() -> dict[str, Callable[[str], dict[str, str]]]:
    specs = {**ZOO_SPECS, **{k: v for k, v in builtin_specs().items() if k == "two_tensor"}}
    rows: dict[str, Callable[[str], dict[str, str]]] = {}
    for subclass in KIT_SUBCLASSES:
        spec = specs.get(subclass)
        if spec is None:
            continue
        for scenario in scenario_names():

            def run(mode: str, scenario: str = scenario, subclass: str = subclass, spec: Any = spec) -> dict[str, str]:
                result = run_scenario(
                    scenario, spec, subclass=subclass, backend=BACKEND,
                    backward_context=_stock if mode == "stock" else None,
                    capture_count=_stock_captures if mode == "stock" else None,
                )
                detail = (result.reason or "").strip().splitlines()
                return {"status": result.status, "detail": (detail[0] if detail else "")[:160]}

            rows[f"{subclass}: {scenario}"] = run
    return rows


def _torchao_status() -> str:
    try:
        import torchao
    except Exception as error:  # noqa: BLE001
        return f"not importable ({type(error).__name__})"
    return str(getattr(torchao, "__version__", "?"))


def _row_outcomes(name: str) -> dict[str, dict[str, str]]:
    row = EXTRA_ROWS[name]
    return {mode: _outcome(functools.partial(row, mode)) for mode in MODES}


def _isolated_row(name: str, *, timeout_s: float = 300.0) -> dict[str, dict[str, str]]:
    """One training-style row in a fresh interpreter (``versions row NAME``), its outcomes from its last line.

    Each row is a whole training style whose torch state (compiled caches, hooks, the garbage of its
    stock run) must not reach the next: torch 2.11's stock compiled autograd crashes collecting the
    garbage of an optimizer-in-backward run, which took the next row down with it.  A row whose
    process dies after it reported keeps its outcomes; one that dies before fails in every mode.
    """
    command = [sys.executable, "-m", "tools", "versions", "row", name]
    try:
        done = subprocess.run(command, cwd=ROOT, env=checkout_env(), capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {mode: {"status": "fail", "detail": f"row did not finish in {timeout_s:.0f} s"} for mode in MODES}
    for line in reversed(done.stdout.strip().splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    last = (done.stderr.strip().splitlines() or [""])[-1][:120]
    return {mode: {"status": "fail", "detail": f"row process exited {done.returncode} before reporting: {last}"} for mode in MODES}


def _every_mode(run: Callable[[str], dict[str, str]]) -> dict[str, dict[str, str]]:
    return {mode: run(mode) for mode in MODES}


def lane_rows(*, quick: bool = False) -> dict[str, Callable[[], dict[str, dict[str, str]]]]:
    """Every row of one lane: name -> a function returning ``{mode: outcome}``."""
    rows: dict[str, Callable[[], dict[str, dict[str, str]]]] = {}
    for name in EXTRA_ROWS:
        rows[name] = functools.partial(_isolated_row, name)
    if not quick:
        for name, run in _kit_rows().items():
            rows[name] = functools.partial(_every_mode, run)
    return rows


def run_lane(
    out: Path,
    *,
    quick: bool = False,
    progress: bool = True,
    rows: dict[str, Callable[[], dict[str, dict[str, str]]]] | None = None,
    stream: Any = None,
) -> dict[str, Any]:
    """Run every row (``rows``: default :func:`lane_rows`), print one result line per row, write ``out``."""
    rows = lane_rows(quick=quick) if rows is None else rows
    if progress:
        print(f"versions run: {len(rows)} rows x {len(MODES)} modes ({', '.join(MODES)}) on torch {torch.__version__}, "
              f"{BACKEND}", file=sys.stderr if stream is None else stream, flush=True)
    results: dict[str, dict[str, dict[str, str]]] = {}
    with Progress(len(rows), enabled=progress, unit="row", stream=stream) as bar:
        for name, run in rows.items():
            bar.start(name)
            results[name] = run()
            bar.update()
            print(f"{name}: " + ", ".join(f"{m}={results[name][m]['status']}" for m in MODES), flush=True)
    lane = {"torch": torch.__version__, "torchao": _torchao_status(), "python": platform.python_version(), "rows": results}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(lane, indent=1))
    return lane


_SYMBOL = {"pass": "pass", "fail": "**fail**", "skip": "skip"}

KNOWN_LIMITS_TEXT = (
    "Known limits of torch 2.11 and 2.12 beyond this table (each pinned by a test on those lanes; the",
    "runtime detects the torch shapes involved by feature, never by version):",
    "",
    "- a leaf whose `grad_dtype` differs from its dtype (a bf16 parameter with float32 `grad_dtype`) cannot be",
    "  captured: torch's AccumulateGrad assigns `.grad` inside the CA graph there, which Dynamo refuses (stock",
    "  too); subclass_ca raises `UnsupportedTorchError` naming the tensor (`tests/test_accumulate.py`);",
    "- eager FSDP2 itself fails bf16 `MixedPrecisionPolicy` on CPU on 2.11 (subclass_ca then refuses too), and",
    "  stock compiled autograd refuses FSDP2's final callback there instead of leaving it unsharded",
    "  (`tests/test_fsdp2.py`);",
    "- torch 2.11's compiled autograd (stock too) corrupts memory when an optimizer steps inside a",
    "  post-accumulate-grad hook of a backward with graph breaks (`enable(fullgraph=False)`): values are right,",
    "  but a later garbage collection can crash the process; fixed in 2.12 (tests of it run isolated);",
    "- FSDP2 on 2.11 records at its first forward whether compiled autograd is on and then skips a tensor",
    "  subclass's all-gather extension in the hooks subclass_ca runs eagerly (NF4 shards reached",
    "  `fsdp.all_gather_copy_in`); inside a block subclass_ca makes that first forward record \"off\", as",
    "  2.12+ FSDP2 behaves. FSDP2 over NF4 QLoRA then equals eager FSDP2 bitwise on 2.11 and 2.12 in every",
    "  style tested: forward inside or outside the block, activation checkpointing with in-place clipping, DCP",
    "  save and resume, the flag-style compiled step; stock compiled autograd fails all five on 2.11",
    "  (`tests/parity/test_fsdp2_nf4.py`);",
    "- two parameters handed one gradient (`W0 + dW`): 2.11/2.12 AccumulateGrad assigns `.grad` in the graph;",
    "  subclass_ca steals only the last use of a rebuilt gradient there as on 2.13+ (`tests/regressions/test_shared_gradient.py`);",
    "- a DTensor parameter's `.grad` placement after a placement change is Replicate under stock compiled",
    "  autograd where eager gives Partial(sum) (values equal); subclass_ca steals the gradient like eager",
    "  since issue 39 and gives Partial(sum) (`tests/testing/test_kit_dtensor.py` passes the whole battery);",
    "  two threads training at once meet Dynamo's nested-FX-trace check when the threads interleave so (a",
    "  non-strict xfail for the race, `tests/test_runtime_threads.py`);",
    "- CA graphs bypass AOTAutogradCache (torch has no cache-key hook for graph globals there): a restart",
    "  traces them again, as under stock compiled autograd (`docs/warm_start.md`).",
)
"""Hand-kept facts the table's rows cannot show, printed under its preamble."""


def _release_of(lane: dict[str, Any]) -> str:
    """``"2.11.0+cu130"`` -> ``"2.11.0"``: the lane's torch as the table shows it."""
    return ".".join(map(str, parse_torch_version(lane["torch"])))


def render(lanes: Sequence[dict[str, Any]]) -> str:
    """The support table (docs/versions.md) of the lanes' JSON files, oldest torch first."""
    lanes = sorted(lanes, key=lambda lane: parse_torch_version(lane["torch"]))
    header = ["feature / scenario"] + [f"{_release_of(lane)} {mode}" for lane in lanes for mode in MODES]
    lines = [
        "# Support table: torch versions x stock compiled autograd / subclass_ca",
        "",
        "Generated by `make versions` (per lane: `python -m tools versions run --json`; merged by",
        "`python -m tools versions render`). Every cell is a real run on CPU with `aot_eager`: values and",
        "gradient types compared with eager. Failures list their first error line below the table.",
        "",
        "Reading the failures: *compiled AdamW over plain params with subclass grads* is a torch limitation in",
        "every mode: torch 2.11-2.13 refuse to compile that optimizer step (their own error, also inside",
        "`enable()`: the workaround is scoped to subclass_ca's CA graph), and torch 2.14/2.15 compile it to wrong",
        "values with or without compiled autograd, which subclass_ca refuses inside `enable()`",
        "(`CompiledOptimizerStepError`; keep that step eager). *Nested jagged tensors*: torch's C++",
        "compiled autograd refuses NJT before anything runs; subclass_ca turns that into an",
        "`UnsupportedSubclassError` naming NJT (run that backward outside `enable()`). `metadata_change` skips",
        "subclasses without constant metadata (see the `tagged` rows).",
        "",
        *KNOWN_LIMITS_TEXT,
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    names = list(dict.fromkeys(name for lane in lanes for name in lane["rows"]))
    notes: list[str] = []
    for name in names:
        cells = []
        for lane in lanes:
            for mode in MODES:
                cell = lane["rows"].get(name, {}).get(mode)
                if cell is None:
                    cells.append("—")
                    continue
                text = _SYMBOL.get(cell["status"], cell["status"])
                if cell["status"] != "pass" and cell["detail"]:
                    notes.append(f"{len(notes) + 1}. {name} — torch {_release_of(lane)}, {mode}: {cell['detail']}")
                    text += f" [{len(notes)}]"
                cells.append(text)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "torchao per lane: " + "; ".join(f"torch {_release_of(lane)}: {lane['torchao']}" for lane in lanes), ""]
    if notes:
        lines += ["## Notes", "", *notes, ""]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m tools versions`` (``run`` and ``render``)."""
    parser = argparse.ArgumentParser(prog="python -m tools versions", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run every row on this torch, write one lane's JSON")
    run_p.add_argument("--json", type=Path, required=True)
    run_p.add_argument("--quick", action="store_true", help="training-style rows only (no kit battery)")
    run_p.add_argument("--no-progress", action="store_true", help="no progress on stderr (tqdm bar, else a line per row)")
    row_p = sub.add_parser("row", help="run one training-style row in this process, print its outcomes as JSON")
    row_p.add_argument("name", choices=list(EXTRA_ROWS))
    render_p = sub.add_parser("render", help="merge lane JSON files into a markdown table")
    render_p.add_argument("lanes", nargs="+", type=Path)
    render_p.add_argument("--out", type=Path, required=True)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "run":
        run_lane(args.json, quick=args.quick, progress=not args.no_progress)
        return 0
    if args.command == "row":
        print(json.dumps(_row_outcomes(args.name)), flush=True)
        return 0
    args.out.write_text(render([json.loads(p.read_text()) for p in args.lanes]))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

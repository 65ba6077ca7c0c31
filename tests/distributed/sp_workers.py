"""Worker for the 2-process sequence-parallel tests (module level: picklable for spawn).

One process group runs every mode in turn, each on a fresh model from the same seed (and
fresh compile caches): eager sequence parallel (the reference), subclass_ca with the default
``fullgraph=True`` (expected to raise GraphBreakError), subclass_ca with ``fullgraph=False``,
subclass_ca with the loss compiled together with the model (default settings), and stock
compiled autograd with ``fullgraph=True`` (expected to raise Dynamo's Unsupported).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from tests.distributed import _example


def _state(run: Any) -> dict[str, Any]:
    """Full (gathered) parameters and the last step's gradient types and placements."""
    from torch.distributed.tensor import DTensor

    params, grads, grad_placements = {}, {}, {}
    for name, param in run.model.named_parameters():
        params[name] = (param.full_tensor() if isinstance(param, DTensor) else param).detach().clone()
        grad = param.grad
        if grad is None:
            grads[name] = None
            continue
        grads[name] = (grad.full_tensor() if isinstance(grad, DTensor) else grad).detach().clone()
        grad_placements[name] = (type(grad).__name__, [str(p) for p in getattr(grad, "placements", ())])
    return {"params": params, "grads": grads, "grad_placements": grad_placements}


def _error(error: BaseException) -> dict[str, Any]:
    cause = error.__cause__
    return {
        "type": type(error).__name__,
        "message": str(error),
        "cause_type": None if cause is None else f"{type(cause).__module__}.{type(cause).__name__}",
        "cause_message": "" if cause is None else str(cause),
    }


def sequence_parallel_modes(rank: int, world_size: int, steps: int, backend: str) -> dict[str, Any]:
    import subclass_ca

    example = _example.load()
    common = ["--sp-eager-loss", "--steps", str(steps), "--backend", backend]
    out: dict[str, Any] = {"seconds": {}}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        out["seconds"][name] = round(now - clock, 2)
        clock = now

    args = example.parse_args([*common, "--backward", "eager", "--no-compile"])
    run = example.setup(args)
    out["eager"] = {**example.train(args, run), **_state(run)}
    lap("eager")

    # the default (fullgraph=True): the eager loss's DTensor backward cannot be traced
    subclass_ca.reset()
    args = example.parse_args(common)
    run = example.setup(args)
    before = {name: p.full_tensor().clone() for name, p in run.model.named_parameters()}
    try:
        example.train(args, run)
        out["default"] = {"error": None}
    except Exception as error:  # noqa: BLE001 - the test inspects it
        after = {name: p.full_tensor() for name, p in run.model.named_parameters()}
        out["default"] = {
            "error": _error(error),
            "grads_none": all(p.grad is None for p in run.model.parameters()),
            "params_untouched": all(torch.equal(before[name], after[name]) for name in before),
        }
    lap("default")

    subclass_ca.reset()
    args = example.parse_args([*common, "--no-fullgraph"])
    run = example.setup(args)
    out["no_fullgraph"] = {**example.train(args, run), **_state(run)}
    lap("no_fullgraph")

    # the model and the DTensor loss compiled together: nothing DTensor-specific runs eagerly
    subclass_ca.reset()
    args = example.parse_args([*common, "--compiled-loss"])
    run = example.setup(args)
    out["compiled_loss"] = {**example.train(args, run), **_state(run)}
    lap("compiled_loss")

    # stock compiled autograd with torch's documented compiler_fn (fullgraph=True)
    subclass_ca.reset()
    args = example.parse_args([*common, "--backward", "stock_ca"])
    run = example.setup(args)
    try:
        example.train(args, run)
        out["stock_fullgraph"] = {"error": None}
    except Exception as error:  # noqa: BLE001
        out["stock_fullgraph"] = {"error": _error(error)}
    lap("stock_fullgraph")
    return out

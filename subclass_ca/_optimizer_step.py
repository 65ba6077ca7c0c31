"""Refuse a compiled optimizer step that torch would compute wrong (plain parameters, subclass gradients).

Note [Compiled optimizer steps over subclass gradients]
-------------------------------------------------------
A ``torch.compile``-d optimizer step (``torch.compile(optimizer.step)``, e.g. AdamW) over *plain*
parameters whose ``.grad`` is a wrapper subclass (a TwoTensor gradient flowing into a plain
Linear) is computed wrong by torch 2.14/2.15 without any error, with or without compiled
autograd; torch 2.13 refuses it itself (``Expected SubclassSymbolicContext``).  A user training
inside ``enable()`` must never get a wrong model from it, so while a block is open, every frame
Dynamo is about to compile (cache misses only: ``_compat.frame_compile_swap``) is looked at
first: an optimizer among its locals (``self`` of ``step``, or ``args`` of the bound step's
wrapper) holding a plain parameter with a traceable-wrapper-subclass ``.grad`` raises
:class:`CompiledOptimizerStepError` before Dynamo traces anything, so no parameter is updated.
Measured on torch 2.15 (TwoTensor grads on plain parameters, 3 steps, aot_eager): Adam, AdamW
(foreach or not) and RMSprop differ from eager by 0.1-2.7; SGD, with and without momentum, is
bitwise equal.  So every optimizer is refused except those in :data:`CORRECT_WHEN_COMPILED`
(exact types: a subclass may override ``step``) -- an unmeasured optimizer gets the error, never
a silent wrong update.  SGD steps compiled by Dynamo at a CA graph's graph breaks (an optimizer
in a post-accumulate-grad hook, ``enable(fullgraph=False)``) are such steps.

What does not raise: a compiled forward (its locals hold modules and inputs, never an
optimizer, so recompiles with subclass gradients in place are untouched), a compiled step whose
parameters are subclasses themselves (torch computes that one right), an eager step, and
everything on a torch where ``_compat.compiled_step_on_subclass_grads_is_wrong()`` is False
(the swap is not installed there).  Not covered: an optimizer a compiled function reaches only
through globals, or a compiled function that reads ``.grad`` of plain parameters without an
optimizer.
"""

from __future__ import annotations

from typing import Any

import torch

from . import _compat
from .errors import CompiledOptimizerStepError

__all__ = ["CORRECT_WHEN_COMPILED", "check_frame_locals", "frame_swaps"]

CORRECT_WHEN_COMPILED: frozenset[type] = frozenset({torch.optim.SGD})
"""Optimizer types torch 2.14/2.15 compile correctly over plain parameters with subclass grads (measured)."""


def _optimizers(value: Any) -> list[torch.optim.Optimizer]:
    if isinstance(value, torch.optim.Optimizer):
        return [value]
    if isinstance(value, (tuple, list)):
        return [item for item in value if isinstance(item, torch.optim.Optimizer)]
    return []


def _offending(optimizer: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if type(optimizer) in CORRECT_WHEN_COMPILED:
        return []
    found: list[tuple[torch.Tensor, torch.Tensor]] = []
    param: torch.Tensor
    for group in optimizer.param_groups:
        for param in group["params"]:
            grad = param.grad
            if grad is not None and _compat.is_traceable_wrapper_subclass(grad) and not _compat.is_traceable_wrapper_subclass(param):
                found.append((param, grad))
    return found


def check_frame_locals(f_locals: dict[str, Any]) -> None:
    """Raise :class:`CompiledOptimizerStepError` if a frame about to be compiled steps such an optimizer."""
    for value in f_locals.values():
        for optimizer in _optimizers(value):
            offending = _offending(optimizer)
            if not offending:
                continue
            grad_types = sorted({type(grad).__name__ for _, grad in offending})
            shapes = ", ".join(str(tuple(param.shape)) for param, _ in offending[:3])
            raise CompiledOptimizerStepError(
                f"torch.compile is compiling a step of {type(optimizer).__name__} inside subclass_ca.enable() whose "
                f"parameters include {len(offending)} plain tensor(s) with a wrapper-subclass .grad "
                f"({'/'.join(grad_types)}; shapes {shapes}). torch {_compat.TORCH_VERSION} compiles such a step without "
                "an error but computes wrong parameter updates (a torch bug, with or without compiled autograd). "
                "Nothing was updated. Fix: run this optimizer step eagerly (call optimizer.step() without "
                "torch.compile), or give these parameters plain gradients (or make them subclass parameters too). "
                "See docs/training_styles.md."
            )


def frame_swaps() -> list[Any]:
    """The Dynamo frame hook, on the torch releases that need it (Note [Compiled optimizer steps over subclass gradients])."""
    if not _compat.compiled_step_on_subclass_grads_is_wrong():
        return []
    try:
        _compat.lookup(_compat.FRAME_COMPILER + ".__call__")
    except (ImportError, AttributeError):  # optional: without it such a step is not refused
        return []
    return [_compat.frame_compile_swap(check_frame_locals)]

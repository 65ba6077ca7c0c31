"""Our errors for torch's refusals: what failed, whose code it was, and what to do.

Every refusal of torch that escapes a capture or a CA graph's compile is turned here into one
:class:`SubclassCAError` that names the cause and the fix (Note [Only real graph breaks become
GraphBreakError], Note [Known torch refusals]).  The text of torch's messages is read only through
``_compat`` (``_compat/messages.py``); this module decides what to tell the user.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from . import _compat, errors
from .errors import BackwardCompileError, GraphBreakError, SubclassCAError, UnsupportedSubclassError, UnsupportedTorchError

__all__ = ["compile_error", "grad_dtype_refusal", "translated"]


# Note [Only real graph breaks become GraphBreakError]
# ----------------------------------------------------
# Dynamo reports every refusal as ``Unsupported``, but some are not code it could run eagerly
# between compiled pieces, so ``fullgraph=False`` would not fix them:
# * "Observed exception": the backward code itself raised while Dynamo traced it (e.g. torch's
#   AOT prologue when a compiled function returned several outputs needing grad and backward
#   ran on some only); run eagerly it raises too.  We say what raised, where, and whether the
#   raising code is torch's or one of our rebuild nodes;
# * "Failed to convert args/kwargs to proxy": a wrapper subclass without the flatten protocol
#   reached the graph; we name the class and the missing methods (the check registration does).
# * one of our own checks raised while Dynamo traced our code (e.g. HookOnSubclassError from a
#   hook's result): that error itself is raised, chained to Dynamo's.
# Everything else is a real graph break and becomes GraphBreakError (``fullgraph=False`` helps).

_NOT_GRAPH_BREAKS = ("Observed exception", "Failed to convert args/kwargs to proxy")


def compile_error(error: BaseException, args: Any) -> SubclassCAError:
    """Our error for Dynamo's refusal to trace the CA graph (Note [Only real graph breaks become GraphBreakError])."""
    _compat.release_tracer(error)  # the user holds this error: not the failed trace's tensors too
    ours = _own_error_in_chain(error)
    if ours is not None:  # one of our checks refused while Dynamo traced it: that is the cause
        return type(ours)(str(ours))
    refusal = _compat.read_refusal(error)
    if refusal.kind.startswith("Failed to convert args/kwargs to proxy"):
        unflattenable = _wrappers_without_protocol(args)
        if unflattenable:
            return UnsupportedSubclassError(
                f"{', '.join(unflattenable)} reached the compiled-autograd graph but cannot be traced there: "
                f"{_missing_protocol_text(unflattenable)}. No gradient was produced. Define __tensor_flatten__ "
                "(inner tensor attribute names and a constant context) and __tensor_unflatten__(inner, ctx, "
                "outer_size, outer_stride) on the class, or run this backward outside subclass_ca.enable()."
            )
    if refusal.kind.startswith(_NOT_GRAPH_BREAKS):
        return _backward_raised_error(error, refusal)
    return _graph_break_error(error, refusal)


def _own_error_in_chain(error: BaseException) -> SubclassCAError | None:
    """Our error inside Dynamo's: chained, or raised by traced code (Dynamo records only its text)."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, SubclassCAError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    raised = _compat.raised_exception(error)
    if raised is None:
        return None
    cls = getattr(errors, raised[0], None)
    if isinstance(cls, type) and issubclass(cls, SubclassCAError):
        return cls(*raised[1])
    return None


def grad_dtype_refusal(args: Any) -> UnsupportedTorchError | None:
    """Where torch's AccumulateGrad assigns ``.grad`` inside the CA graph (up to torch 2.12), a leaf whose
    ``grad_dtype`` differs from its dtype makes Dynamo refuse the whole graph ("Attempt to trace generator",
    stock compiled autograd alike); say that instead of calling it a graph break (Note [Two shapes of
    AccumulateGrad under compiled autograd] in ``_compat/accumulate.py``)."""
    if _compat.accumulate_grad_is_functional():
        return None
    leaves = [
        value for value in _leaves(args)
        if isinstance(value, torch.Tensor) and value.is_leaf and value.requires_grad
        and _compat.grad_dtype_of(value) not in (None, value.dtype)
    ]
    if not leaves:
        return None
    shown = ", ".join(f"{tuple(t.shape)} {t.dtype} with grad_dtype {_compat.grad_dtype_of(t)}" for t in leaves[:3])
    return UnsupportedTorchError(
        f"torch {_compat.TORCH_VERSION}'s compiled autograd cannot capture gradients into a tensor whose grad_dtype "
        f"differs from its dtype ({shown}): its AccumulateGrad assigns .grad inside the graph, which Dynamo refuses "
        "for such a tensor (stock compiled autograd too; torch 2.13 made AccumulateGrad functional). No gradient "
        "was produced. Run this backward outside subclass_ca.enable(), leave grad_dtype at the tensor's dtype, "
        "or use torch >= 2.13."
    )


def _wrappers_without_protocol(args: Any) -> list[str]:
    names: set[str] = set()
    for value in _leaves(args):
        cls = type(value)
        if (
            isinstance(value, torch.Tensor)
            and cls not in (torch.Tensor, torch.nn.Parameter)
            and not _compat.is_traceable_wrapper_subclass(value)
            and getattr(cls, "__torch_dispatch__", None) is not getattr(torch.Tensor, "__torch_dispatch__", None)
        ):
            names.add(f"{cls.__module__}.{cls.__qualname__}")
    return sorted(names)


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, (list, tuple)):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    else:
        yield value


def _missing_protocol_text(names: list[str]) -> str:
    plural = "they are wrapper subclasses" if len(names) > 1 else "it is a wrapper subclass"
    return f"{plural} (own __torch_dispatch__) without __tensor_flatten__/__tensor_unflatten__"


def _backward_raised_error(error: BaseException, refusal: _compat.Refusal) -> BackwardCompileError:
    what = refusal.raised or (repr(error.__cause__) if error.__cause__ else refusal.kind)
    user_code, frames = refusal.user_code, refusal.frames
    lines = [line.strip() for line in user_code.strip().splitlines() if line.strip()]
    where, whose = "", "torch's own backward code (compiled autograd's graph of torch's autograd nodes), not subclass_ca's"
    if len(lines) >= 2:
        where = f" at `{lines[1]}`"
    if "subclass_ca_" in user_code or any("/subclass_ca/" in path for path, _, _ in frames):
        whose = "subclass_ca's own code (a rebuild node or a handler's rebuild): please report it with this message"
    elif any("/torch/" not in path and not path.startswith("<") for path, _, _ in frames):
        path, line, name = next(f for f in frames if "/torch/" not in f[0] and not f[0].startswith("<"))
        whose = f"your code ({name} in {path.rsplit('/', 1)[-1]}:{line}), which Dynamo traced in the backward"
    return BackwardCompileError(
        f"compiling the compiled-autograd graph failed: the backward code raised {what}{where} while Dynamo "
        f"traced it. This is not a graph break: enable(fullgraph=False) would not fix it. It was raised by {whose}. "
        "No gradient was produced. Run the same step without subclass_ca.enable() (torch.compile alone) to see "
        "torch's own error for it: e.g. a compiled function that returns several outputs needing gradients, with "
        "backward() on only some of them, fails there too (call .detach() on the outputs you do not backward through)."
    )


def _graph_break_error(error: BaseException, refusal: _compat.Refusal) -> GraphBreakError:
    text = str(error).strip()
    reason = text.splitlines()[0] if text else type(error).__name__
    if refusal.explanation:
        reason = f"{reason} ({refusal.explanation.split('. ')[0].rstrip('.')})"
    user_code, frames = refusal.user_code, refusal.frames
    own = [(path, line, name) for path, line, name in frames if "/torch/" not in path and not path.startswith("<")]
    where = ""
    if own:
        path, line, name = own[0]
        kind = f"{refusal.hook_type} " if refusal.hook_type else ""
        where = f" It is needed by the {kind}{name} ({path.rsplit('/', 1)[-1]}:{line})."
    elif "call_backward" in user_code and frames:
        path, line, name = frames[-1]
        where = (
            f" It is in the backward of a torch.autograd.Function the backward graph calls "
            f"(torch/{path.split('/torch/', 1)[-1]}:{line}, in {name}); DTensor's to_local/full_tensor, from_local "
            "and redistribute put theirs there when they run outside the compiled forward (e.g. a loss written on "
            "DTensors after the compiled model): compiling that code with the model avoids the break."
        )
    return GraphBreakError(
        f"the backward graph needs a graph break, which fullgraph=True (the default) refuses: {reason}.{where} "
        "No gradient was produced. This is typical of hooks that run Python Dynamo cannot trace (e.g. an "
        "optimizer outside torch.optim stepped in a post-accumulate-grad hook). Pass enable(fullgraph=False) to "
        "run that code eagerly between compiled pieces, in eager autograd's order (the capture report lists the "
        "breaks), or make the hook traceable."
    )


def translated(error: BaseException | None) -> SubclassCAError | None:
    """Our clear error for a torch refusal that escapes a block, or None (Note [Known torch refusals])."""
    if _compat.is_nested_jagged_refusal(error):
        return UnsupportedSubclassError(
            "nested jagged tensors (NJT, torch.nested with layout=torch.jagged) cannot be captured by compiled "
            "autograd in this torch: its C++ graph walk refuses nested tensors before anything runs, so no "
            "gradient was produced (stock compiled autograd refuses the same way). Run this backward outside "
            "subclass_ca.enable() (a torch.compile-d forward with an eager backward trains NJT correctly)."
        )
    lifted_type = _compat.fake_lift_refused_type(error)
    if lifted_type is not None and error is not None and error.__cause__ is not None:
        cause = error.__cause__
        cause_text = (str(cause).strip().splitlines() or [""])[0]
        return BackwardCompileError(
            f"compiled autograd could not lift an input of this backward (a parameter, its .grad, a saved tensor or "
            f"an incoming gradient) of type {lifted_type} to a fake tensor. Torch reports this as 'not supported by "
            f"FakeTensorMode', which points at the type; the cause is {type(cause).__name__}: {cause_text} "
            "No gradient was produced (the capture failed before the backward ran). Run this backward outside "
            "subclass_ca.enable() (a torch.compile-d forward with an eager backward) and report the cause, with the "
            "tensor's type, dtype and .grad, to subclass_ca."
        )
    return None


# Note [Known torch refusals]
# ---------------------------
# Some backwards are refused by torch's own compiled autograd with an error that does not say
# what to do (e.g. nested jagged tensors: ``NotImplementedError: NestedTensor support not
# implemented`` from the C++ graph walk, before any node runs), or with one that points away from
# the cause: compiled autograd turns *any* failure to fakeify a backward input into "Found tensor of
# type X, which is not supported by FakeTensorMode" and chains the real error as its cause (a
# .grad of another dtype was one, Note [A .grad of another dtype than its leaf]).  When such an
# error leaves an ``enable()`` block, the block re-raises it as the matching SubclassCAError, which
# names the cause and is chained to torch's.

"""The epilogue proxy: every make_subclass call of an AOT backward becomes one named node.

Note [How we hook the backward epilogue]
----------------------------------------
Compiled autograd (CA) captures an AOTAutograd backward in three pieces: the
*prologue* (one allow_in_graph node), the AOT backward graph (pasted node by node)
and the *epilogue*, which re-wraps plain inner gradients into tensor subclasses by
calling ``SubclassCreationMeta.creation_fn`` once per subclass-typed gradient.  Stock
torch passes a ``make_subclass_override`` that emits a fresh anonymous closure per call,
feeds it *every* flat backward output, and binds a ``zeros([0, 123456789])`` dummy as
its traced value.

We wrap ``AutogradCompilerInstance.proxy_call_aot_backward`` (``_compat.aot_backward_swap``)
and, for the duration of that one trace, swap the AOT function's ``_bw_epilogue_fn`` for
one that passes *our* override.  For each subclass-typed gradient the override:

1. turns the AOT creation metadata into a :class:`Recipe` relative to the subclass's own
   flat slice (so the node takes only its own inner tensors and symints);
2. looks the subclass up in the handler registry (MRO; protocol default otherwise) and
   interns the recipe under a small integer id, deduplicated by the handler's metadata
   key — a new key is a new recipe, so a metadata change can never reuse a stale node;
3. emits one node whose target is a stable callable per (subclass type, mode) —
   ``subclass_ca_make_<Type>`` (proxy, allow_in_graph), ``subclass_ca_inline_<Type>``
   (Dynamo traces it) or ``subclass_ca_opaque_<Type>`` (dynamo.disable: runs eagerly);
4. runs the rebuild once on the AOT graph's recorded fake outputs, which both validates
   the handler (type, outer size/stride, dtype, device) at capture time and gives the
   traced dummy the subclass's *real* outer size, stride, dtype and device.

The callables are created once per process and reused by every capture; the stock
prologue closure is also reused per AOT function (``_compat.STABLE_PROLOGUES``),
so recaptures add nothing to Dynamo's allow_in_graph set.

Two cases the epilogue alone does not reach use the same recipes and named nodes (see the
Notes below and docs/design.md): a rebuilt subclass gradient is stolen into a ``None``
``.grad`` the way eager does (Note [Subclass gradients and AccumulateGrad]), and a tensor
hook on a subclass intermediate is desugared to its inner tensors for Dynamo's
``trace_wrapped`` HOP (Note [Hooks on subclass intermediates]).

Note [Settings travel with the capture]
---------------------------------------
The patch on ``proxy_call_aot_backward`` is process-wide while any ``enable()`` block is
active, but the settings it applies are not: compiled autograd hands every capture the
``compiler_fn`` it will compile the graph with, and ours carries its :class:`Config`
(``subclass_ca_config``).  A capture whose compiler is not ours runs torch's stock code.
So two blocks with different settings never see each other's, whatever thread they run in.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from . import _compat, diagnostics
from ._handler import Mode, default_handler
from ._nodes import graph_callable
from ._recipe import (
    Recipe,
    check_against,
    check_same_rebuild,
    intern,
    outer_metadata,
    rebuild,
    recipe_by_id,
    recipe_from_meta,
)
from ._warm_start import cacheable as _cacheable
from .config import Config
from .errors import RebuildError, UnsupportedSubclassError

__all__ = ["proxy_call_aot_backward", "capture_config", "warn_fallback_once"]

_warned_fallbacks: set[str] = set()


def warn_fallback_once(subclass_name: str, reason: str) -> None:
    """One warning per subclass per process when it falls back to opaque mode."""
    if subclass_name not in _warned_fallbacks:
        _warned_fallbacks.add(subclass_name)
        warnings.warn(f"subclass_ca: {reason}. Register a handler to silence this.", stacklevel=3)


def _example_outputs(examples: list[Any] | None, start: int, count: int) -> list[Any] | None:
    if examples is None or len(examples) < start + count:
        return None
    return examples[start : start + count]


def _example_rebuild(recipe: Recipe, examples: list[Any]) -> torch.Tensor:
    with _compat.outside_tracing():
        fake_mode = _compat.fake_mode_of([e for e in examples if isinstance(e, torch.Tensor)])
        if fake_mode is None:
            return rebuild(recipe, examples)
        with fake_mode:
            return rebuild(recipe, examples)


def _fallback_metadata(recipe: Recipe, examples: list[Any] | None) -> dict[str, Any]:
    tensors = [e for e in examples or () if isinstance(e, torch.Tensor)]
    floating = [t for t in tensors if t.is_floating_point()]
    reference = floating[0] if floating else (tensors[0] if tensors else None)
    return {
        "type": recipe.subclass_type,
        "size": tuple(-1 if s is None else s for s in recipe.outer_size),
        "stride": tuple(-1 if s is None else s for s in recipe.outer_stride),
        "dtype": reference.dtype if reference is not None else torch.get_default_dtype(),
        "device": reference.device if reference is not None else torch.device("cpu"),
    }


def _with_mode(recipe: Recipe, mode: Mode) -> Recipe:
    handler = dataclasses.replace(recipe.handler, mode=mode)
    return dataclasses.replace(recipe, handler=handler, key=(recipe.key, mode))


def _static_expectation(recipe: Recipe, dtype: torch.dtype | None, device: torch.device | None) -> dict[str, Any]:
    """What every rebuild of ``recipe`` must produce (symbolic dims, and a None dtype or device, are not checked)."""
    return {
        "type": recipe.subclass_type,
        "size": tuple(s if isinstance(s, int) else None for s in recipe.outer_size),
        "stride": tuple(s if isinstance(s, int) else None for s in recipe.outer_stride),
        "dtype": dtype,
        "device": device,
    }


def _capture_metadata(recipe: Recipe, examples: list[Any] | None, settings: Config) -> tuple[Recipe, dict[str, Any]]:
    """Validate the handler on fake outputs; return the (maybe fallen-back) recipe and outer metadata."""
    if examples is None:
        return recipe, _fallback_metadata(recipe, examples)
    try:
        example = _example_rebuild(recipe, examples)
    except RebuildError as error:
        if not recipe.handler.is_default:
            raise
        if recipe.handler.mode == "opaque":
            return recipe, _fallback_metadata(recipe, examples)
        if settings.on_unsupported == "eager":
            cls = recipe.subclass_type
            reason = f"{cls.__qualname__}: constructor cannot be traced ({error.__cause__!r}); rebuilt eagerly (opaque)"
            diagnostics.record_fallback(reason)
            warn_fallback_once(cls.__qualname__, reason)
            return _with_mode(recipe, "opaque"), _fallback_metadata(recipe, examples)
        raise UnsupportedSubclassError(
            f"{recipe.subclass_type.__qualname__} cannot be rebuilt inside the compiled-autograd graph: its "
            f"__tensor_unflatten__ fails on fake tensors ({error.__cause__!r}). Register a handler with a trace-safe "
            "rebuild, register it with mode='opaque', or pass enable(on_unsupported='eager')."
        ) from error.__cause__
    metadata = outer_metadata(example)
    metadata["size"] = tuple(_compat.size_hint(s) for s in metadata["size"])
    metadata["stride"] = tuple(_compat.size_hint(s) for s in metadata["stride"])
    reference = example
    if not recipe.handler.is_default:  # a custom rebuild must agree with the protocol's dtype/device
        reference = _example_rebuild(dataclasses.replace(recipe, handler=default_handler(recipe.subclass_type)), examples)
    check_against(recipe, example, _static_expectation(recipe, reference.dtype, reference.device))
    return recipe, metadata


def _make_override(compiler: Any, examples: list[Any] | None, settings: Config) -> Any:

    def make_subclass(subclass_meta: Any, is_runtime: bool, unwrapped_args: Sequence[Any]) -> torch.Tensor:
        start, count = subclass_meta.flat_tensor_start_idx, subclass_meta.arg_count
        recipe = recipe_from_meta(_compat.creation_meta(subclass_meta), start)
        own_examples = _example_outputs(examples, start, count)
        recipe, metadata = _capture_metadata(recipe, own_examples, settings)
        if settings.strict:  # without fake outputs dtype and device are unknown: left unchecked
            known = own_examples is not None  # a cached forward's backward has none (docs/warm_start.md)
            expected = _static_expectation(recipe, metadata["dtype"] if known else None, metadata["device"] if known else None)
            recipe = dataclasses.replace(recipe, expected=expected, key=(recipe.key, "strict"))
        recipe_id = intern(recipe)
        check_same_rebuild(  # Note [Metadata keys never hide a context] (_recipe.py)
            recipe_by_id(recipe_id),
            recipe,
            None if own_examples is None else (lambda candidate: _example_rebuild(candidate, own_examples)),
        )
        mode = recipe.handler.mode
        target = graph_callable(recipe.subclass_type, mode)
        own_args = [_compat.to_proxy(compiler, a) for a in unwrapped_args[start : start + count]]
        proxy = _compat.create_call_node(compiler, target, own_args, {"recipe": recipe_id})
        with _compat.without_proxy_tracing():
            size = tuple(1 if s is None or s < 0 else s for s in metadata["size"])
            stride = tuple(1 if s is None or s < 0 else s for s in metadata["stride"])
            dummy = torch.empty_strided(size, stride, dtype=metadata["dtype"], device=metadata["device"])
        _compat.bind_dummy(compiler, dummy, proxy)
        proxy.node.meta["subclass_ca"] = {**metadata, "mode": mode, "recipe": recipe_id}
        diagnostics.record_subclass_node(recipe.subclass_type.__name__, mode)
        return dummy

    return make_subclass


def capture_config(compiler: Any) -> Config | None:
    """The settings a capture runs with: those of the subclass_ca compiler it will call, or None (stock)."""
    return getattr(_compat.compiler_fn_of(compiler), "subclass_ca_config", None)


def proxy_call_aot_backward(compiler: Any, ctx: Any, call_original: Any) -> Any:
    """Our ``proxy_call_aot_backward``: stock for captures that are not ours (Note [Settings travel with the capture])."""
    settings = capture_config(compiler)
    if settings is None:
        return call_original()
    with _compat.STABLE_PROLOGUES.applied():
        return _proxy_aot_backward_with_epilogue(compiler, ctx, call_original, settings)


def _proxy_aot_backward_with_epilogue(compiler: Any, ctx: Any, call_original: Any, settings: Config) -> Any:
    diagnostics.begin_capture(compiler)
    diagnostics.record_aot_backward()
    diagnostics.record_forward_backend(_compat.forward_backend(ctx))  # Note [Defaults follow the user] in config.py
    _cacheable.remember_forward(ctx)
    if not _compat.has_subclass_grads(ctx):
        return call_original()
    examples = _compat.backward_output_examples(ctx)
    override = _make_override(compiler, examples, settings)
    with _compat.swapped_epilogue(ctx, override):
        return call_original()

"""Tensor hooks on subclass intermediates, desugared for Dynamo's ``trace_wrapped`` HOP.

See Note [Hooks on subclass intermediates] below.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from . import _compat
from ._nodes import graph_callable
from ._recipe import Recipe, check_same_rebuild, intern, metadata_key, rebuild, recipe_by_id
from .errors import HookOnSubclassError
from .registry import get_handler

__all__ = ["trace_wrapped_swaps"]

# Note [Hooks on subclass intermediates]
# --------------------------------------
# When the forward is traced with compiled autograd on, Dynamo defers a hook on an
# intermediate (``y.register_hook(fn)``) to the backward: the forward graph registers
# ``partial(trace_wrapped, fn=call_hook_from_backward_state, ...)`` on ``y``, and when
# AOTAutograd traces the joint graph that hook runs on ``y``'s gradient.  For a subclass
# gradient the ``trace_wrapped`` HOP has no subclass rule ("no rule registered for HOP
# trace_wrapped and subclass ...") and the forward fails to compile.
#
# :func:`subclass_trace_wrapped` (swapped in for Dynamo's ``trace_wrapped`` only inside
# ``enable()`` blocks, :func:`trace_wrapped_swaps`) desugars the subclass the same way our
# epilogue does: the HOP gets the gradient's plain inner tensors, so the AOT backward graph
# stays plain; at CA time Dynamo inlines :func:`_hook_on_rebuilt`, which rebuilds the
# gradient through the named ``subclass_ca_make_<Type>`` node (a recipe like any other),
# calls the user's hook on it and flattens the result back with ``subclass_ca_flatten``.

class _NotDesugarable(Exception):
    """Internal: this value cannot travel through trace_wrapped as plain inner tensors."""


def _recipe_from_instance(tensor: torch.Tensor, flat: list[torch.Tensor]) -> Recipe:
    """A Recipe rebuilding ``tensor`` from ``flat`` (appended to, in flatten order, recursively)."""
    cls = type(tensor)
    names, ctx = tensor.__tensor_flatten__()
    handler = get_handler(cls)
    start = len(flat)
    parts: list[tuple[str, Any]] = []
    for name in names:
        inner = getattr(tensor, name)
        if not isinstance(inner, torch.Tensor):
            raise _NotDesugarable(f"its flatten attribute {name!r} is a {type(inner).__name__}, not a tensor")
        if _compat.is_traceable_wrapper_subclass(inner):
            parts.append((name, _recipe_from_instance(inner, flat)))
        else:
            parts.append((name, len(flat)))
            flat.append(inner)
    size, stride = tuple(tensor.size()), tuple(tensor.stride())
    if not all(isinstance(d, int) for d in (*size, *stride)):
        raise _NotDesugarable(f"its outer size {list(size)} is symbolic (dynamic shapes)")
    key = (
        handler, cls, metadata_key(handler, ctx),
        tuple((attr, part.key if isinstance(part, Recipe) else part) for attr, part in parts),
        size, stride, len(flat) - start, "hook",
    )
    return Recipe(
        handler=handler, subclass_type=cls, ctx=ctx, parts=tuple(parts), outer_size=size, outer_stride=stride,
        symint_start=len(flat), symint_end=len(flat), arg_count=len(flat) - start, key=key,
    )


def _flatten_like(recipe: Recipe, tensor: Any, out: list[torch.Tensor]) -> None:
    if type(tensor) is not recipe.subclass_type:
        raise HookOnSubclassError(
            f"a tensor hook on a {recipe.subclass_type.__qualname__} intermediate returned a "
            f"{type(tensor).__qualname__}; inside compiled autograd a hook must return None or a gradient of the "
            f"same subclass ({recipe.subclass_type.__qualname__}) and layout. Return a "
            f"{recipe.subclass_type.__qualname__} from the hook."
        )
    names, _ = tensor.__tensor_flatten__()
    for name, (_, part) in zip(names, recipe.parts):
        inner = getattr(tensor, name)
        if isinstance(part, Recipe):
            _flatten_like(part, inner, out)
        else:
            out.append(inner)


def _flatten_for_hook(tensor: torch.Tensor, *, recipe: int) -> tuple[torch.Tensor, ...]:
    out: list[torch.Tensor] = []
    _flatten_like(recipe_by_id(recipe), tensor, out)
    return tuple(out)


_flatten_for_hook.__name__ = _flatten_for_hook.__qualname__ = "flatten"
_flatten_for_hook.__module__ = "subclass_ca"
_flatten_callable: Any = None


def _hook_on_rebuilt(flat: Any, *, hook_fn: Any, make: Any, flatten: Any, recipe: int, **kwargs: Any) -> Any:
    """Traced by Dynamo at CA time: rebuild the subclass gradient, run the hook, flatten its result."""
    grad = make(*flat, recipe=recipe)
    result = hook_fn(grad, **kwargs)
    if result is None:
        return flat
    return flatten(result, recipe=recipe)


def subclass_trace_wrapped(*args: Any, fn: Any, **kwargs: Any) -> Any:
    """Dynamo's ``trace_wrapped`` with subclass gradients desugared (Note [Hooks on subclass intermediates])."""
    global _flatten_callable
    original = _original_trace_wrapped
    grad = args[0] if len(args) == 1 else None
    if grad is None or not _compat.is_traceable_wrapper_subclass(grad):
        return original(*args, fn=fn, **kwargs)
    flat: list[torch.Tensor] = []
    try:
        recipe = _recipe_from_instance(grad, flat)
    except _NotDesugarable as why:
        raise HookOnSubclassError(
            f"a tensor hook on a {type(grad).__qualname__} intermediate inside the compiled region cannot be "
            f"captured: {why}. Register the hook outside the torch.compile'd function, or compile the forward "
            "outside subclass_ca.enable() (Dynamo then inlines the hook into the forward graph)."
        ) from None
    recipe_id = intern(recipe)
    # Note [Metadata keys never hide a context] (_recipe.py): the live grad has no fake twin to rebuild on
    check_same_rebuild(recipe_by_id(recipe_id), recipe, None)
    if _flatten_callable is None:
        _flatten_callable = _compat.allow_in_graph(_flatten_for_hook)
    make = graph_callable(recipe.subclass_type, "proxy")
    wrapped = functools.partial(_hook_on_rebuilt, hook_fn=fn, make=make, flatten=_flatten_callable, recipe=recipe_id)
    outs = original(tuple(flat), fn=wrapped, **kwargs)
    return rebuild(recipe, list(outs))


_original_trace_wrapped: Any = None


def _replacement(original: Any) -> Any:
    global _original_trace_wrapped
    _original_trace_wrapped = original
    return _compat.gated(_compat.BLOCKS, original, subclass_trace_wrapped)


def trace_wrapped_swaps() -> list[_compat.Swap]:
    """Swaps routing Dynamo's deferred tensor hooks through :func:`subclass_trace_wrapped`."""
    return [
        _compat.AttributeSwap(functools.partial(_compat.lookup, module), "trace_wrapped", _replacement, own_only=False)
        for module in _compat.TRACE_WRAPPED_USERS
    ]

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
#
# The same HOP carries full backward module hooks (``register_full_backward_hook`` /
# ``register_full_backward_pre_hook``): Dynamo's ``BackwardHookVariable`` installs a
# ``BackwardHook`` whose hooks are ``partial(trace_wrapped, fn=call_module_hooks_from_backward_state,
# ...)``, called as ``trace_wrapped(None, grad_inputs, grad_outputs)`` (post hook) or
# ``trace_wrapped(None, grad_outputs)`` (pre hook): tuples of gradients, some of them None,
# the returned value shaped like ``args[1]`` (``args[0]`` for a tensor hook), as torch's
# proxy rule for the HOP reads it.  So the rule is general, not per hook kind: every
# subclass tensor anywhere in the arguments (tuples/lists of tensors and None) travels as a
# tuple of its plain inner tensors under its own recipe; at CA time each is rebuilt before
# the hook runs, and the hook's result is flattened back along the returned argument's
# recipes.  Plain tensors and None pass through as they are.

class _NotDesugarable(Exception):
    """Internal: this value cannot travel through trace_wrapped as plain inner tensors."""


def _recipe_from_instance(tensor: torch.Tensor, flat: list[torch.Tensor]) -> Recipe:
    """A Recipe rebuilding ``tensor`` from ``flat`` (appended to, in flatten order, recursively)."""
    if not _compat.is_traceable_wrapper_subclass(tensor):  # the callers checked: this narrows the type only
        raise _NotDesugarable(f"a {type(tensor).__qualname__} is not a traceable wrapper subclass")
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
    subclass_type: Any = recipe.subclass_type  # Any: `type(tensor) is` a plain `type` would narrow tensor to object
    if type(tensor) is not subclass_type:
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


def _desugared(value: Any) -> tuple[Any, Any]:
    """(``value`` with every subclass tensor replaced by a tuple of its inner tensors, its plan).

    The plan has ``value``'s structure: a recipe id where a subclass was, None elsewhere.
    """
    if isinstance(value, torch.Tensor) and _compat.is_traceable_wrapper_subclass(value):
        flat: list[torch.Tensor] = []
        try:
            recipe = _recipe_from_instance(value, flat)
        except _NotDesugarable as why:
            raise HookOnSubclassError(
                f"a backward hook receiving a {type(value).__qualname__} gradient inside the compiled region "
                f"cannot be captured: {why}. Register the hook outside the torch.compile'd function, or compile "
                "the forward outside subclass_ca.enable() (Dynamo then runs the hook in the forward's place)."
            ) from None
        recipe_id = intern(recipe)
        # Note [Metadata keys never hide a context] (_recipe.py): the live grad has no fake twin to rebuild on
        check_same_rebuild(recipe_by_id(recipe_id), recipe, None)
        return tuple(flat), recipe_id
    if isinstance(value, (tuple, list)):
        pairs = [_desugared(item) for item in value]
        if all(plan is None for _, plan in pairs):
            return value, None
        return type(value)(item for item, _ in pairs), tuple(plan for _, plan in pairs)
    return value, None


def _resugared(value: Any, plan: Any, makes: dict[int, Any]) -> Any:
    """Undo :func:`_desugared`: ``makes[id]`` is the named node rebuilding recipe ``id``."""
    if plan is None:
        return value
    if isinstance(plan, int):
        return makes[plan](*value, recipe=plan)
    return type(value)(_resugared(item, sub, makes) for item, sub in zip(value, plan))


def _desugared_like(value: Any, plan: Any, flatten: Any) -> Any:
    """A hook's result flattened along ``plan``, the recipes of the argument it replaces."""
    if plan is None:
        return value
    if isinstance(plan, int):
        if value is None:
            recipe = recipe_by_id(plan)
            raise HookOnSubclassError(
                f"a backward hook returned None in place of a {recipe.subclass_type.__qualname__} gradient; "
                "inside compiled autograd a hook must return None as a whole or a gradient of the same subclass "
                f"({recipe.subclass_type.__qualname__}) and layout in that place. Return the gradient unchanged there."
            )
        return flatten(value, recipe=plan)
    if not isinstance(value, (tuple, list)) or len(value) != len(plan):
        raise HookOnSubclassError(
            f"a backward hook returned {type(value).__qualname__} in place of {len(plan)} gradients (some of them "
            "tensor subclasses); return None or a tuple with one gradient per place."
        )
    return tuple(_desugared_like(item, sub, flatten) for item, sub in zip(value, plan))


def _result_index(args: tuple[Any, ...]) -> int:
    """Which argument the HOP's output replaces: ``args[1]`` for module hooks (``args[0]`` is None)."""
    return 1 if len(args) > 1 and args[0] is None else 0


def _hook_on_rebuilt(*flat: Any, hook_fn: Any, makes: Any, flatten: Any, plans: Any, **kwargs: Any) -> Any:
    """Traced by Dynamo at CA time: rebuild the subclass gradients, run the hook, flatten its result."""
    rebuilt = [_resugared(value, plan, makes) for value, plan in zip(flat, plans)]
    result = hook_fn(*rebuilt, **kwargs)
    index = _result_index(flat)
    if result is None:
        return flat[index]
    return _desugared_like(result, plans[index], flatten)


def _is_post_hook_without_input_grads(args: tuple[Any, ...]) -> bool:
    """A module post hook called from the output side: ``(None, grad_inputs all None, grad_outputs)``."""
    return (
        len(args) == 3
        and args[0] is None
        and isinstance(args[1], (tuple, list))
        and not any(isinstance(value, torch.Tensor) for value in args[1])
        and isinstance(args[2], (tuple, list))
        and any(isinstance(value, torch.Tensor) for value in args[2])
    )


def _post_hooks_then_outputs(_: Any, grad_outputs: Any, grad_inputs: Any, *, hook_fn: Any, **kwargs: Any) -> Any:
    """Traced by Dynamo at CA time: the module's post hooks on ``(grad_inputs, grad_outputs)``, then ``grad_outputs``."""
    result = hook_fn(None, grad_inputs, grad_outputs, **kwargs)
    if result is not None and any(value is not None for value in result):
        # what eager's BackwardHook raises; ours surfaces as itself (Note [Only real graph breaks become GraphBreakError])
        raise HookOnSubclassError(
            "a full backward hook of a module none of whose inputs requires grad returned gradients; torch calls it "
            "with grad_input all None and refuses any returned gradient (eager raises 'Backward hook for Modules where "
            "no input requires gradient should always return None or None for all gradients.'). Return None from that "
            "hook (it can still read grad_output), or use register_full_backward_pre_hook to change grad_output."
        )
    return grad_outputs


def _post_hooks_kept_alive(grad_inputs: Any, grad_outputs: Any, fn: Any, kwargs: dict[str, Any]) -> None:
    """Note [Post hooks of a module whose inputs need no gradient]."""
    carried = subclass_trace_wrapped(
        None, grad_outputs, grad_inputs, fn=functools.partial(_post_hooks_then_outputs, hook_fn=fn), **kwargs
    )
    with torch.no_grad():
        for given, traced in zip(grad_outputs, carried):
            if isinstance(given, torch.Tensor):
                given.copy_(traced)  # the same values; what BackwardHook returns now depends on the hook call


# Note [Post hooks of a module whose inputs need no gradient]
# -----------------------------------------------------------
# When no input of a module requires grad, torch's ``BackwardHook`` calls the module's full
# backward post hooks from its *output* hook, as ``hook(module, (None, ...), grad_outputs)``,
# and discards the result (it must be None).  Traced with compiled autograd on, that call is a
# ``trace_wrapped`` node whose output nothing uses, and AOTAutograd's partitioner removes
# every unused node of the backward graph: the hook is silently never called (stock torch
# too).  So the call goes through the HOP with the arguments swapped: its traced output is
# shaped like ``grad_outputs`` (at CA time :func:`_post_hooks_then_outputs` runs the hooks
# and returns ``grad_outputs`` unchanged), and that output is copied into the gradients the
# output hook returns: the node is used, kept, and the hook runs every backward, as in eager.


def subclass_trace_wrapped(*args: Any, fn: Any, **kwargs: Any) -> Any:
    """Dynamo's ``trace_wrapped`` with subclass gradients desugared (Note [Hooks on subclass intermediates])."""
    global _flatten_callable
    if _is_post_hook_without_input_grads(args):
        return _post_hooks_kept_alive(args[1], args[2], fn, kwargs)
    original = _original_trace_wrapped
    pairs = [_desugared(value) for value in args]
    plans = tuple(plan for _, plan in pairs)
    if all(plan is None for plan in plans):
        return original(*args, fn=fn, **kwargs)
    if _flatten_callable is None:
        _flatten_callable = _compat.allow_in_graph(_flatten_for_hook)
    makes = {
        recipe_id: graph_callable(recipe_by_id(recipe_id).subclass_type, "proxy") for recipe_id in _recipe_ids(plans)
    }
    wrapped = functools.partial(_hook_on_rebuilt, hook_fn=fn, makes=makes, flatten=_flatten_callable, plans=plans)
    flat = tuple(value for value, _ in pairs)
    outs = original(*flat, fn=wrapped, **kwargs)
    return _rebuilt_outputs(outs, plans[_result_index(args)])


def _recipe_ids(plan: Any) -> list[int]:
    if plan is None:
        return []
    if isinstance(plan, int):
        return [plan]
    return [recipe_id for sub in plan for recipe_id in _recipe_ids(sub)]


def _rebuilt_outputs(outs: Any, plan: Any) -> Any:
    """The HOP's traced outputs with each desugared subclass rebuilt (at AOT trace time)."""
    if plan is None:
        return outs
    if isinstance(plan, int):
        return rebuild(recipe_by_id(plan), list(outs))
    return type(outs)(_rebuilt_outputs(item, sub) for item, sub in zip(outs, plan))


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

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

We wrap ``AutogradCompilerInstance.proxy_call_aot_backward`` (``_compat.AotBackwardPatch``)
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
prologue closure is also reused per AOT function (``_compat.stable_prologue_callables``),
so recaptures add nothing to Dynamo's allow_in_graph set.

Two cases the epilogue alone does not reach use the same recipes and named nodes (see the
Notes below and docs/design.md): a subclass gradient whose ``new_empty_strided`` loses the
type is stolen into ``.grad`` the way eager does (Note [Subclass gradients and
AccumulateGrad]), and a tensor hook on a subclass intermediate is desugared to its inner
tensors for Dynamo's ``trace_wrapped`` HOP (Note [Hooks on subclass intermediates]).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import re
import threading
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from . import _compat, diagnostics
from .errors import HookOnSubclassError, MetadataMismatchError, RebuildError, UnsupportedSubclassError
from .handler import Handler, default_handler
from .registry import get_handler

__all__ = [
    "Recipe",
    "install",
    "uninstall",
    "is_installed",
    "named_callables",
    "recipe_count",
    "subclass_node_targets",
]


@dataclasses.dataclass(frozen=True, eq=False)
class Recipe:
    """How to rebuild one subclass from its own flat slice of backward outputs."""

    handler: Handler
    subclass_type: type
    ctx: Any
    parts: tuple[tuple[str, Any], ...]
    """(attribute, int index into the slice | nested Recipe) in flatten order."""
    outer_size: tuple[Any, ...]
    outer_stride: tuple[Any, ...]
    symint_start: int
    """Index in the slice of the first symint that fills a symbolic (None) outer dim."""
    symint_end: int
    """Index in the slice just past this subclass's own arguments."""
    arg_count: int
    key: Any
    expected: dict[str, Any] | None = None
    """Outer metadata recorded at capture (type, size, stride, dtype, device) for strict checks."""

    def outer_size_and_stride(self, args: Sequence[Any]) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
        symints = iter(args[self.symint_start : self.symint_end])
        size = tuple(next(symints) if s is None else s for s in self.outer_size)
        stride = tuple(next(symints) if s is None else s for s in self.outer_stride)
        return size, stride


# --- building recipes from AOT metadata ----------------------------------------


def _recipe_from_meta(meta: Any, base: int, strict_expected: bool = False) -> Recipe:
    creation_meta_cls, plain_meta_cls, opaque_meta_cls = _compat.creation_meta_types()
    subclass_type = meta.original_subclass_type or type(meta.original_subclass)
    handler = get_handler(subclass_type)
    parts: list[tuple[str, Any]] = []
    own_start = meta.flat_tensor_start_idx - base
    index = own_start
    for attr, inner in meta.attrs.items():
        if isinstance(inner, creation_meta_cls):
            parts.append((attr, _recipe_from_meta(inner, base)))
            index += inner.arg_count
        else:
            parts.append((attr, index))
            index += 1
    outer_size = tuple(meta.outer_size)
    outer_stride = tuple(meta.outer_stride)
    key = (
        handler,
        subclass_type,
        _metadata_key(handler, meta.meta),
        tuple((attr, part.key if isinstance(part, Recipe) else part) for attr, part in parts),
        outer_size,
        outer_stride,
        meta.arg_count,
    )
    return Recipe(
        handler=handler,
        subclass_type=subclass_type,
        ctx=meta.meta,
        parts=tuple(parts),
        outer_size=outer_size,
        outer_stride=outer_stride,
        symint_start=index,
        symint_end=own_start + meta.arg_count,
        arg_count=meta.arg_count,
        key=key,
    )


def _metadata_key(handler: Handler, ctx: Any) -> Any:
    try:
        key = handler.metadata_key(ctx)
    except Exception as error:  # noqa: BLE001
        raise RebuildError(
            f"metadata_key of the {handler.name} raised {type(error).__name__}: {error}. "
            "Make metadata_key(ctx) a pure function of the flatten context."
        ) from error
    return _Hashable(key)


class _Hashable:
    """Wraps a metadata key so unhashable keys still compare by equality."""

    __slots__ = ("value", "_hash")

    def __init__(self, value: Any) -> None:
        self.value = value
        try:
            self._hash = hash(value)
        except TypeError:
            self._hash = hash(repr(value))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, _Hashable):
            return NotImplemented
        try:
            return bool(self.value == other.value)
        except Exception:  # noqa: BLE001 - e.g. tensors in a context
            return self.value is other.value

    def __repr__(self) -> str:
        return repr(self.value)


# --- run-time rebuild ----------------------------------------------------------

_recipes: list[Recipe] = []
_recipe_ids: dict[Any, int] = {}
_recipes_lock = threading.Lock()


def _intern(recipe: Recipe) -> int:
    with _recipes_lock:
        existing = _recipe_ids.get(recipe.key)
        if existing is not None:
            return existing
        _recipes.append(recipe)
        _recipe_ids[recipe.key] = len(_recipes) - 1
        return len(_recipes) - 1


def recipe_count() -> int:
    """Distinct rebuild recipes interned so far (one per subclass layout and metadata key)."""
    return len(_recipes)


def rebuild(recipe: Recipe, args: Sequence[Any]) -> torch.Tensor:
    """Rebuild the subclass described by ``recipe`` from its flat slice ``args``."""
    inner = {
        attr: rebuild(part, args) if isinstance(part, Recipe) else args[part]
        for attr, part in recipe.parts
    }
    size, stride = recipe.outer_size_and_stride(args)
    handler = recipe.handler
    try:
        result = handler.rebuild(inner, recipe.ctx, size, stride)
    except (RebuildError, UnsupportedSubclassError):
        raise
    except Exception as error:
        raise RebuildError(
            f"the {handler.name} failed to rebuild {recipe.subclass_type.__qualname__} "
            f"(outer size {list(size)}): {type(error).__name__}: {error}. Fix the handler's rebuild, or register a "
            "handler with mode='opaque' if the constructor cannot run on fake tensors."
        ) from error
    if not isinstance(result, recipe.subclass_type):
        returned = type(result).__qualname__ if _compat.is_traceable_wrapper_subclass(result) else "a plain Tensor"
        raise RebuildError(
            f"the {handler.name} returned {returned}, expected an instance of "
            f"{recipe.subclass_type.__qualname__}. rebuild() must return the rebuilt subclass."
        )
    return result


def check_against(recipe: Recipe, result: torch.Tensor, expected: dict[str, Any]) -> None:
    """Raise :class:`MetadataMismatchError` where ``result`` differs from ``expected``."""
    actual = _outer_metadata(result)
    problems = []
    for field_name in ("type", "dtype", "device"):
        if actual[field_name] != expected[field_name]:
            problems.append(f"{field_name} {actual[field_name]} != expected {expected[field_name]}")
    for field_name in ("size", "stride"):
        want, got = expected[field_name], actual[field_name]
        if len(want) != len(got) or any(
            isinstance(w, int) and isinstance(g, int) and w != g for w, g in zip(want, got)
        ):
            problems.append(f"{field_name} {list(got)} != expected {list(want)}")
    if problems:
        raise MetadataMismatchError(
            f"the {recipe.handler.name} rebuilt a {recipe.subclass_type.__qualname__} whose "
            + "; ".join(problems)
            + ". rebuild() must honour outer_size/outer_stride and keep the subclass's dtype and device."
        )


def _outer_metadata(tensor: torch.Tensor) -> dict[str, Any]:
    return {
        "type": type(tensor),
        "size": tuple(tensor.size()),
        "stride": tuple(tensor.stride()),
        "dtype": tensor.dtype,
        "device": tensor.device,
    }


# --- the named graph callables -------------------------------------------------

_callables: dict[tuple[type, str], Any] = {}
_callable_names: set[str] = set()
_callables_lock = threading.Lock()
_PREFIX = {"proxy": "make", "inline": "inline", "opaque": "opaque"}


def _safe_name(cls: type) -> str:
    return re.sub(r"\W", "_", cls.__name__)


def _graph_callable(cls: type, mode: str) -> Any:
    """The one callable per (subclass type, mode) that graph nodes target."""
    with _callables_lock:
        found = _callables.get((cls, mode))
        if found is not None:
            return found
        base = f"{_PREFIX[mode]}_{_safe_name(cls)}"
        name = base
        for suffix in itertools.count(2):
            if name not in _callable_names:
                break
            name = f"{base}_{suffix}"

        def rebuild_subclass(*args: Any, recipe: int) -> torch.Tensor:
            entry = _recipes[recipe]
            result = rebuild(entry, args)
            if entry.expected is not None:
                check_against(entry, result, entry.expected)
            return result

        rebuild_subclass.__name__ = rebuild_subclass.__qualname__ = name
        rebuild_subclass.__module__ = "subclass_ca"
        rebuild_subclass.__doc__ = f"Rebuild a {cls.__qualname__} gradient from its inner tensors ({mode} mode)."
        if mode == "proxy":
            target = _compat.allow_in_graph(rebuild_subclass)
        elif mode == "opaque":
            target = _compat.dynamo_disable(rebuild_subclass)
            target.__name__ = target.__qualname__ = name
            target.__module__ = "subclass_ca"
        else:
            target = rebuild_subclass
        target._subclass_ca_type = cls  # type: ignore[attr-defined]
        target._subclass_ca_mode = mode  # type: ignore[attr-defined]
        _callables[(cls, mode)] = target
        _callable_names.add(name)
        return target


def named_callables() -> dict[str, Any]:
    """Every graph callable created so far, by its graph name (it must not grow per capture)."""
    with _callables_lock:
        return {f"subclass_ca_{fn.__name__}": fn for fn in _callables.values()}


def subclass_node_targets(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """The make_subclass nodes of ours in a captured CA graph."""
    return [n for n in graph.nodes if n.op == "call_function" and hasattr(n.target, "_subclass_ca_mode")]


# --- the override --------------------------------------------------------------


@dataclasses.dataclass
class _Settings:
    strict: bool = False
    on_unsupported: str = "error"


_settings_stack: list[_Settings] = []
_install_lock = threading.Lock()
_patch: _compat.AotBackwardPatch | None = None
_warned_fallbacks: set[str] = set()


def warn_fallback_once(subclass_name: str, reason: str) -> None:
    """One warning per subclass per process when it falls back to opaque mode."""
    if subclass_name not in _warned_fallbacks:
        _warned_fallbacks.add(subclass_name)
        warnings.warn(f"subclass_ca: {reason}. Register a handler to silence this.", stacklevel=3)


def _active() -> _Settings:
    return _settings_stack[-1] if _settings_stack else _Settings()


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


def _with_mode(recipe: Recipe, mode: str) -> Recipe:
    handler = dataclasses.replace(recipe.handler, mode=mode)
    return dataclasses.replace(recipe, handler=handler, key=(recipe.key, mode))


def _static_expectation(recipe: Recipe, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """What every rebuild of ``recipe`` must produce (symbolic dims are None: not checked)."""
    return {
        "type": recipe.subclass_type,
        "size": tuple(s if isinstance(s, int) else None for s in recipe.outer_size),
        "stride": tuple(s if isinstance(s, int) else None for s in recipe.outer_stride),
        "dtype": dtype,
        "device": device,
    }


def _capture_metadata(recipe: Recipe, examples: list[Any] | None, settings: _Settings) -> tuple[Recipe, dict[str, Any]]:
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
    metadata = _outer_metadata(example)
    metadata["size"] = tuple(_compat.size_hint(s) for s in metadata["size"])
    metadata["stride"] = tuple(_compat.size_hint(s) for s in metadata["stride"])
    reference = example
    if not recipe.handler.is_default:  # a custom rebuild must agree with the protocol's dtype/device
        reference = _example_rebuild(dataclasses.replace(recipe, handler=default_handler(recipe.subclass_type)), examples)
    check_against(recipe, example, _static_expectation(recipe, reference.dtype, reference.device))
    return recipe, metadata


def _make_override(compiler: Any, examples: list[Any] | None) -> Any:
    settings = _active()

    def make_subclass(subclass_meta: Any, is_runtime: bool, unwrapped_args: Sequence[Any]) -> torch.Tensor:
        start, count = subclass_meta.flat_tensor_start_idx, subclass_meta.arg_count
        recipe = _recipe_from_meta(subclass_meta, start)
        recipe, metadata = _capture_metadata(recipe, _example_outputs(examples, start, count), settings)
        if settings.strict:
            expected = _static_expectation(recipe, metadata["dtype"], metadata["device"])
            recipe = dataclasses.replace(recipe, expected=expected, key=(recipe.key, "strict"))
        recipe_id = _intern(recipe)
        mode = recipe.handler.mode
        target = _graph_callable(recipe.subclass_type, mode)
        own_args = [_compat.to_proxy(compiler, a) for a in unwrapped_args[start : start + count]]
        proxy = _compat.create_call_node(compiler, target, own_args, {"recipe": recipe_id})
        with _compat.without_proxy_tracing():
            size = tuple(1 if s is None or s < 0 else s for s in metadata["size"])
            stride = tuple(1 if s is None or s < 0 else s for s in metadata["stride"])
            dummy = torch.empty_strided(size, stride, dtype=metadata["dtype"], device=metadata["device"])
        _compat.bind_dummy(compiler, dummy, proxy)
        proxy.node.meta["subclass_ca"] = {**metadata, "mode": mode, "recipe": recipe_id}
        # Note [Subclass gradients and AccumulateGrad]: does a fresh .grad keep the type?
        proxy.node.meta["subclass_ca"]["alloc_keeps_type"] = _allocation_keeps_type(
            recipe, _example_outputs(examples, start, count)
        )
        diagnostics.record_subclass_node(recipe.subclass_type.__name__, mode)
        return dummy

    return make_subclass


def _proxy_call_aot_backward(compiler: Any, ctx: Any, call_original: Any) -> Any:
    with _compat.stable_prologue_callables():
        return _proxy_aot_backward_with_epilogue(compiler, ctx, call_original)


def _proxy_aot_backward_with_epilogue(compiler: Any, ctx: Any, call_original: Any) -> Any:
    diagnostics.begin_capture(compiler)
    diagnostics.record_aot_backward()
    if not _compat.has_subclass_grads(ctx):
        return call_original()
    examples = _compat.backward_output_examples(ctx)
    override = _make_override(compiler, examples)

    def make_epilogue(original: Any) -> Any:
        def epilogue(outputs: Any, make_subclass_override: Any = None) -> Any:
            return original(outputs, make_subclass_override=override)

        return epilogue

    with _compat.swapped_epilogue(ctx, make_epilogue):
        return call_original()


def install(*, strict: bool = False, on_unsupported: str = "error") -> None:
    """Install the epilogue proxy (re-entrant: each install needs one uninstall)."""
    global _patch
    with _install_lock:
        if not _settings_stack:
            _patch = _compat.AotBackwardPatch(_proxy_call_aot_backward)
            _patch.install()
        _settings_stack.append(_Settings(strict=strict, on_unsupported=on_unsupported))


def uninstall() -> None:
    global _patch
    with _install_lock:
        if not _settings_stack:
            raise RuntimeError("subclass_ca capture uninstalled more times than installed")
        _settings_stack.pop()
        if not _settings_stack and _patch is not None:
            _patch.uninstall()
            _patch = None


def is_installed() -> bool:
    return bool(_settings_stack)


def raised_in_rebuild(error: BaseException) -> bool:
    """True when ``error`` (or what caused it) was raised inside one of our rebuild calls."""
    codes = {rebuild.__code__, *(getattr(fn, "__wrapped__", fn).__code__ for fn in _callables.values())}
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        tb = current.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code in codes:
                return True
            tb = tb.tb_next
        current = current.__cause__ or current.__context__
    return False


def retarget_to_opaque(graph_module: torch.fx.GraphModule) -> list[type]:
    """Switch every make_subclass node of ours to its opaque callable; returns the subclass types."""
    switched = []
    for node in subclass_node_targets(graph_module.graph):
        cls = node.target._subclass_ca_type
        if node.target._subclass_ca_mode != "opaque":
            node.target = _graph_callable(cls, "opaque")
            switched.append(cls)
    graph_module.recompile()
    return switched


# --- AccumulateGrad of subclass gradients ----------------------------------------
#
# Note [Subclass gradients and AccumulateGrad]
# --------------------------------------------
# Eager AccumulateGrad *steals* a fresh gradient (``param.grad = grad``) when nothing else
# holds it and its strides match the parameter's, so a subclass-typed gradient stays
# subclass-typed.  Under compiled autograd the gradient is a graph value that is always
# referenced, so torch's AccumulateGrad (``call_accumulate_grad``) never steals: it
# allocates with ``grad.new_empty_strided(param.size(), param.stride())`` and ``copy_``s
# into it.  A subclass whose ``__torch_dispatch__`` answers ``new_empty_strided`` with a
# plain tensor (it implements compute ops only) therefore ends up with a dense ``.grad``.
# At capture we probe ``new_empty_strided`` on the rebuilt fake gradient; where it loses
# the type, :func:`steal_subclass_accumulates` retargets that parameter's first
# accumulation (``.grad`` was None at capture) to :func:`accumulate_subclass_grad`, which
# steals exactly when eager does (matching strides) and defers to torch otherwise.
# Accumulating into an existing ``.grad`` is left to torch (``grad + new``), as in eager.

_stock_accumulate: Any = None


def _allocation_keeps_type(recipe: Recipe, examples: list[Any] | None) -> bool | None:
    """Whether ``new_empty_strided`` on the rebuilt gradient returns the subclass (None: unknown)."""
    if examples is None or recipe.handler.mode == "opaque":
        return None
    try:
        with _compat.outside_tracing():
            fake_mode = _compat.fake_mode_of([e for e in examples if isinstance(e, torch.Tensor)])
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                example = rebuild(recipe, examples)
                fresh = example.new_empty_strided(example.size(), example.stride())
    except Exception:  # noqa: BLE001 - the subclass cannot allocate at all: torch's path decides
        return None
    return isinstance(fresh, recipe.subclass_type)


def accumulate_subclass_grad(
    variable: torch.Tensor, variable_grad: torch.Tensor | None, grad: torch.Tensor, has_post_hooks: bool | None = None
) -> torch.Tensor | None:
    """AccumulateGrad for a subclass gradient, stealing it the way eager does.

    See Note [Subclass gradients and AccumulateGrad]; Dynamo inlines this function.
    """
    if variable_grad is None and grad.stride() == variable.stride():
        variable.grad = grad
        return grad
    return _stock_accumulate(variable, variable_grad, grad, has_post_hooks)


def steal_subclass_accumulates(graph_module: torch.fx.GraphModule) -> list[str]:
    """Retarget first accumulations of type-losing subclass grads; returns the subclass names."""
    global _stock_accumulate
    stock = _compat.call_accumulate_grad()
    _stock_accumulate = stock
    retargeted = []
    for node in list(graph_module.graph.nodes):
        if node.op != "call_function" or node.target is not stock or len(node.args) < 3:
            continue
        grad = node.args[2]
        meta = grad.meta.get("subclass_ca") if isinstance(grad, torch.fx.Node) else None
        if node.args[1] is None and meta is not None and meta.get("alloc_keeps_type") is False:
            node.target = accumulate_subclass_grad
            retargeted.append(grad.target._subclass_ca_type.__name__)
    if retargeted:
        graph_module.recompile()
    return retargeted


# --- tensor hooks on subclass intermediates -------------------------------------
#
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
# ``enable()``, ``_compat.swapped_trace_wrapped``) desugars the subclass the same way our
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
        handler, cls, _metadata_key(handler, ctx),
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
    _flatten_like(_recipes[recipe], tensor, out)
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
    original = _compat.original_trace_wrapped()
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
    recipe_id = _intern(recipe)
    if _flatten_callable is None:
        _flatten_callable = _compat.allow_in_graph(_flatten_for_hook)
    make = _graph_callable(recipe.subclass_type, "proxy")
    wrapped = functools.partial(_hook_on_rebuilt, hook_fn=fn, make=make, flatten=_flatten_callable, recipe=recipe_id)
    outs = original(tuple(flat), fn=wrapped, **kwargs)
    return rebuild(recipe, list(outs))


@contextlib.contextmanager
def with_compiler(compiler_fn: Any, *, dynamic: bool = True) -> Any:
    """Our epilogue proxy under compiled autograd with a caller's ``compiler_fn``.

    For measurements and tests that must see the raw CA graph: unlike ``enable()`` it adds
    none of the workarounds, cache keying or the compiled-graph wrapper.
    """
    install()
    try:
        with _compat.enable_compiled_autograd(compiler_fn, dynamic=dynamic):
            yield
    finally:
        uninstall()

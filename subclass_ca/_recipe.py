"""Recipes: what rebuilding one subclass-typed gradient needs, interned under small ids.

A :class:`Recipe` is built once per capture from AOTAutograd's creation metadata (or from a
live instance, for hooks); graph nodes carry only its id, so a node's arguments are exactly
the subclass's own inner tensors and symints.  Recipes are deduplicated by the handler's
metadata key: a new key is a new recipe, so a metadata change never reuses a stale node.

Note [Metadata keys never hide a context]
-----------------------------------------
A handler's ``metadata_key`` lets recipes whose flatten contexts differ only in parts that do
not change the rebuilt tensor share one id; the interned recipe then rebuilds with the context
of the *first* capture.  That is only right while the key covers every part of the context the
rebuild reads, so two rules keep a key from ever hiding one:

1. a handler inherited by a class that defines its own ``__tensor_flatten__`` or
   ``__tensor_unflatten__`` keys by the whole context (``handler.same_flatten_protocol``): the
   registered key was written for the parent's context, not the child's;
2. at capture, a recipe whose key matches an interned one but whose context differs is rebuilt
   both ways on the capture's fake outputs (:func:`check_same_rebuild`); if the two rebuilt
   tensors flatten to different contexts (at any nesting level) or outer metadata, the capture
   raises :class:`RebuildError` naming the handler and both contexts, before any gradient
   exists.  Without fake outputs to rebuild, differing contexts are refused outright.

So an interned recipe never rebuilds with a context other than the one torch's own epilogue
would use; the check costs nothing when contexts are equal (every built-in handler's steady
state) and runs once per capture otherwise.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import torch

from . import _compat
from ._handler import Handler
from .errors import MetadataMismatchError, RebuildError, UnsupportedSubclassError
from .registry import get_handler

__all__ = [
    "Recipe",
    "recipe_from_meta",
    "metadata_key",
    "intern",
    "check_same_rebuild",
    "recipe_by_id",
    "recipe_count",
    "all_recipes",
    "rebuild",
    "check_against",
    "outer_metadata",
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


def recipe_from_meta(meta: _compat.CreationMeta, base: int) -> Recipe:
    """The recipe for one AOT subclass output, indices relative to ``base`` (its own slice)."""
    subclass_type = meta.subclass_type
    handler = get_handler(subclass_type)
    parts: list[tuple[str, Any]] = []
    own_start = meta.start - base
    index = own_start
    for attr, inner in meta.attrs:
        if isinstance(inner, _compat.CreationMeta):
            parts.append((attr, recipe_from_meta(inner, base)))
            index += inner.arg_count
        else:  # a plain inner tensor, followed by its own symints on torch >= 2.14
            parts.append((attr, index))
            index += inner
    key = (
        handler,
        subclass_type,
        metadata_key(handler, meta.ctx),
        tuple((attr, part.key if isinstance(part, Recipe) else part) for attr, part in parts),
        meta.outer_size,
        meta.outer_stride,
        meta.arg_count,
    )
    return Recipe(
        handler=handler,
        subclass_type=subclass_type,
        ctx=meta.ctx,
        parts=tuple(parts),
        outer_size=meta.outer_size,
        outer_stride=meta.outer_stride,
        symint_start=index,
        symint_end=own_start + meta.arg_count,
        arg_count=meta.arg_count,
        key=key,
    )


def metadata_key(handler: Handler, ctx: Any) -> Any:
    try:
        key = handler.metadata_key(ctx)
    except Exception as error:
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


_recipes: list[Recipe] = []
_recipe_ids: dict[Any, int] = {}
_recipes_lock = threading.Lock()


def intern(recipe: Recipe) -> int:
    """The id of ``recipe`` (an equal-keyed recipe interned earlier keeps its id)."""
    with _recipes_lock:
        existing = _recipe_ids.get(recipe.key)
        if existing is not None:
            return existing
        _recipes.append(recipe)
        _recipe_ids[recipe.key] = len(_recipes) - 1
        return len(_recipes) - 1


def _same_context(first: Any, second: Any) -> bool:
    return _Hashable(first) == _Hashable(second)


def _flatten_contexts(tensor: Any) -> Any:
    """(type, context, outer metadata, inner contexts) of a rebuilt subclass, recursively."""
    if not isinstance(tensor, torch.Tensor) or not _compat.is_traceable_wrapper_subclass(tensor):
        return None
    names, ctx = tensor.__tensor_flatten__()
    inner = tuple((name, _flatten_contexts(getattr(tensor, name))) for name in names)
    metadata = outer_metadata(tensor)
    metadata["size"] = tuple(_compat.size_hint(s) for s in metadata["size"])
    metadata["stride"] = tuple(_compat.size_hint(s) for s in metadata["stride"])
    return (type(tensor), _Hashable(ctx), tuple(metadata.items()), inner)


def _contexts_differ(interned: Recipe, new: Recipe) -> bool:
    if not _same_context(interned.ctx, new.ctx):
        return True
    new_parts = dict(new.parts)
    return any(
        isinstance(part, Recipe) and _contexts_differ(part, new_parts[attr]) for attr, part in interned.parts
    )


def check_same_rebuild(interned: Recipe, new: Recipe, rebuild_on_examples: Any) -> None:
    """Refuse a metadata key that would make ``interned`` rebuild what ``new`` must rebuild differently.

    ``rebuild_on_examples(recipe)`` rebuilds on the capture's fake outputs, or is None when
    there are none (Note [Metadata keys never hide a context]).
    """
    if interned is new or not _contexts_differ(interned, new):
        return
    if rebuild_on_examples is not None:
        if _flatten_contexts(rebuild_on_examples(interned)) == _flatten_contexts(rebuild_on_examples(new)):
            return
        how = "rebuilding with each gives tensors with different flatten contexts or metadata"
    else:
        how = "there were no example outputs to show the two rebuild alike"
    raise RebuildError(
        f"the metadata_key of the {new.handler.name} maps two different flatten contexts of "
        f"{new.subclass_type.__qualname__} to the same key ({metadata_key(new.handler, new.ctx)!r}): {interned.ctx!r} (captured "
        f"earlier) and {new.ctx!r} (this capture), and {how}, so reusing the earlier recipe would give this "
        "gradient a stale context. No gradient was produced. Make metadata_key(ctx) cover every part of the "
        "context that changes the rebuilt tensor (or drop metadata_key to key by the whole context)."
    )


def recipe_by_id(recipe_id: int) -> Recipe:
    return _recipes[recipe_id]


def all_recipes() -> list[Recipe]:
    """Every recipe interned so far, in id order (a recipe's id is its index)."""
    with _recipes_lock:
        return list(_recipes)


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
    """Raise :class:`MetadataMismatchError` where ``result`` differs from ``expected`` (None: not checked)."""
    actual = outer_metadata(result)
    problems = []
    for field_name in ("type", "dtype", "device"):
        if expected[field_name] is not None and actual[field_name] != expected[field_name]:
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


def outer_metadata(tensor: torch.Tensor) -> dict[str, Any]:
    return {
        "type": type(tensor),
        "size": tuple(tensor.size()),
        "stride": tuple(tensor.stride()),
        "dtype": tensor.dtype,
        "device": tensor.device,
    }

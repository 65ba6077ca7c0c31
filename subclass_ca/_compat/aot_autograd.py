"""AOTAutograd internals: the backward epilogue, its subclass creation metadata, recorded outputs."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._lookup import lookup
from ._patch import AttributeSwap, PatchSet
from .dynamo import outside_tracing

__all__ = [
    "SCHEMAS",
    "CREATION_META_FIELDS",
    "EPILOGUE_WRAPPER",
    "BW_MODULE_EXTRACTION",
    "CreationMeta",
    "creation_meta",
    "has_subclass_grads",
    "backward_output_examples",
    "swapped_epilogue",
    "STABLE_PROLOGUES",
]

SCHEMAS = "torch._functorch._aot_autograd.schemas"
EPILOGUE_WRAPPER = "torch._functorch._aot_autograd.subclass_utils:wrap_tensor_subclasses"
BW_MODULE_EXTRACTION = "torch._dynamo.compiled_autograd:extract_bw_module"
CREATION_META_FIELDS = (
    "flat_tensor_start_idx",
    "arg_count",
    "attrs",
    "outer_size",
    "outer_stride",
    "meta",
    "original_subclass_type",
)


@dataclasses.dataclass(frozen=True)
class CreationMeta:
    """What subclass_ca reads of AOT's ``SubclassCreationMeta`` (one subclass-typed output)."""

    start: int
    """Index of its first flat argument among the backward outputs."""
    arg_count: int
    """Flat arguments it owns: inner tensors (recursively) then symints of symbolic outer dims."""
    attrs: tuple[tuple[str, CreationMeta | int], ...]
    """Flatten attributes in order: nested metadata for an inner subclass, else the number of flat
    slots the plain inner occupies (torch 2.13: 1; torch >= 2.14: 1 + its own size/stride symints,
    ``PlainTensorMeta.arg_count``)."""
    outer_size: tuple[Any, ...]
    outer_stride: tuple[Any, ...]
    ctx: Any
    """The flatten context (constant metadata)."""
    subclass_type: type


def creation_meta(meta: Any) -> CreationMeta:
    """Read one ``SubclassCreationMeta`` (recursively) into :class:`CreationMeta`."""
    creation_cls = lookup(SCHEMAS + ":SubclassCreationMeta")
    attrs = tuple(
        (name, creation_meta(inner) if isinstance(inner, creation_cls) else _plain_slots(inner))
        for name, inner in meta.attrs.items()
    )
    return CreationMeta(
        start=meta.flat_tensor_start_idx,
        arg_count=meta.arg_count,
        attrs=attrs,
        outer_size=tuple(meta.outer_size),
        outer_stride=tuple(meta.outer_stride),
        ctx=meta.meta,
        subclass_type=meta.original_subclass_type or type(meta.original_subclass),
    )


def _plain_slots(meta: Any) -> int:
    """Flat slots of a non-subclass inner meta (PlainTensorMeta / OpaqueMeta): feature-detected ``arg_count``."""
    count = getattr(meta, "arg_count", 1)
    return count if isinstance(count, int) else 1


def has_subclass_grads(ctx: Any) -> bool:
    forward_cls = getattr(ctx, "_forward_cls", None)
    return getattr(forward_cls, "maybe_subclass_metadata", None) is not None


def backward_output_examples(ctx: Any) -> list[Any] | None:
    """The AOT backward graph's output values (fake tensors/symints) recorded at trace time.

    Note [AOTAutograd cache and backward metadata]: torch does not keep ``node.meta["val"]`` on
    the backward graph reliably.  Saving an AOTAutograd cache entry (inductor: compiled functions
    with an FX-graph cache key) runs ``serialize_graph_module(bw_module)``, which sets
    ``node.meta = {}`` *in place* on the live backward module compiled autograd later pastes; an
    entry is saved when the backward is compiled (a backward outside compiled autograd, an eager
    backward compile for dynamic shapes).  A cache hit gives a module deserialized from that
    stripped copy.  Where the meta is gone but the lazy-compile info still holds the backward's
    fake placeholders, the outputs are recomputed by fake propagation; otherwise None (callers
    must never lose behaviour on None: see ``_accumulate.py``).
    """
    compiled_function = ctx._forward_cls
    try:
        bw_module = lookup(BW_MODULE_EXTRACTION)(compiled_function)
    except Exception:  # noqa: BLE001 - lazily compiled or cached backward: no graph
        return None
    graph = getattr(bw_module, "graph", None)
    if graph is None:
        return None
    output = next((n for n in graph.nodes if n.op == "output"), None)
    if output is None:
        return None
    values = []
    for arg in output.args[0]:
        if isinstance(arg, torch.fx.Node):
            if "val" not in arg.meta:
                return _propagated_backward_outputs(compiled_function, bw_module)
            values.append(arg.meta["val"])
        else:
            values.append(arg)
    return values


def _propagated_backward_outputs(compiled_function: Any, bw_module: Any) -> list[Any] | None:
    """The backward's outputs by fake propagation over its recorded fake placeholders (None: impossible)."""
    placeholders = getattr(getattr(compiled_function, "_lazy_backward_info", None), "placeholder_list", None)
    if placeholders is None:
        return None
    # the placeholders' own fake mode (detect_fake_mode would also consult the active CA modes)
    modes = {id(m): m for m in (getattr(p, "fake_mode", None) for p in placeholders) if m is not None}
    if len(modes) != 1:
        return None
    (fake_mode,) = modes.values()
    try:
        with outside_tracing(), fake_mode:
            outputs = torch.fx.Interpreter(bw_module).run(*placeholders)
    except Exception:  # noqa: BLE001 - e.g. an op without a fake kernel: unknown
        return None
    return list(outputs)


@contextlib.contextmanager
def swapped_epilogue(ctx: Any, make_epilogue: Callable[[Any], Any]) -> Iterator[None]:
    """Replace one AOT function's backward epilogue for one trace (its own class attribute)."""
    forward_cls = ctx._forward_cls
    original = forward_cls.__dict__.get("_bw_epilogue_fn")
    inherited = original is None
    if inherited:
        original = forward_cls._bw_epilogue_fn
    forward_cls._bw_epilogue_fn = make_epilogue(original)
    try:
        yield
    finally:
        if inherited:
            del forward_cls._bw_epilogue_fn
        else:
            forward_cls._bw_epilogue_fn = original


_stable_prologues: dict[tuple[int, ...], Any] = {}
_PROLOGUE_NAME = "call_aot_bwd_prologue"


def _stable_allow_in_graph(original: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def allow_in_graph(fn: Any) -> Any:
        if getattr(fn, "__name__", None) != _PROLOGUE_NAME or not getattr(fn, "__closure__", None):
            return original(fn)
        key = tuple(id(cell.cell_contents) for cell in fn.__closure__)
        cached = _stable_prologues.get(key)
        if cached is None:
            # keep the closure alive so the ids in the key can never be reused
            cached = _stable_prologues[key] = (original(fn), fn.__closure__)
        return cached[0]

    return allow_in_graph


STABLE_PROLOGUES = PatchSet(
    "stable AOT prologue callables",
    lambda: [AttributeSwap(lambda: lookup("torch._dynamo"), "allow_in_graph", _stable_allow_in_graph, own_only=False)],
)
"""Reuse one allow_in_graph prologue callable per AOT function across recaptures.

Stock CA wraps a fresh ``call_aot_bwd_prologue`` closure in ``allow_in_graph`` on every
capture, growing Dynamo's allowed-callable id set forever.  The closure only closes over
the AOT function's constant ``_bw_prologue_fn``, so the first one is reused.  Acquired only
while one of our AOT-backward proxies runs.
"""

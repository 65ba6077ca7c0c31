"""AOTAutograd internals: the backward epilogue, its subclass creation metadata, recorded outputs."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import threading
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
    "epilogue_style",
    "EPILOGUES",
    "MODULE_EPILOGUE",
    "STABLE_PROLOGUES",
    "INDUCTOR_OUTPUT",
    "AOT_EAGER_COMPILER",
    "forward_backend",
]

SCHEMAS = "torch._functorch._aot_autograd.schemas"
RUNTIME_WRAPPERS = "torch._functorch._aot_autograd.runtime_wrappers"
EPILOGUE_WRAPPER = "torch._functorch._aot_autograd.subclass_utils:wrap_tensor_subclasses"
BW_MODULE_EXTRACTION = "torch._dynamo.compiled_autograd:extract_bw_module"
INDUCTOR_OUTPUT = "torch._inductor.output_code:OutputCode"
"""What inductor's compiler returns for each graph it compiles (an AOT function's ``compiled_fw``)."""
AOT_EAGER_COMPILER = "torch._dynamo.backends.debugging:boxed_nop"
"""The forward and backward compiler of ``aot_eager`` (and its decomposition variants): returns the graph itself."""
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


# Note [Two shapes of the AOT backward epilogue]
# ----------------------------------------------
# Compiled autograd traces through an AOT function's backward epilogue, which re-wraps the plain
# inner gradients into subclasses through ``wrap_tensor_subclasses(..., make_subclass_override=)``.
# torch has had it in two shapes, told apart by what exists (``EPILOGUES``), never by version:
#
# * ``"per-function"`` (torch 2.13 on): every AOT function's ``CompiledFunction`` carries a
#   generated ``_bw_epilogue_fn(out, make_subclass_override=None)``, which compiled autograd calls
#   with its own override.  We swap that one class attribute for the one trace.
# * ``"module-level"`` (up to torch 2.12): compiled autograd calls the module function
#   ``runtime_wrappers._backward_epilogue_functional(metadata, subclass_meta, out, *,
#   make_subclass_override=None, ...)`` for every AOT function, and so does every eager backward
#   of a compiled region.  The module attribute is therefore replaced only while one of our
#   proxies runs (``MODULE_EPILOGUE``), by a function that uses our override in the thread that set
#   it and torch's own arguments everywhere else, so an eager backward in another thread sees stock
#   behaviour.
#
# Either way the override receives the same ``(subclass_meta, is_runtime, unwrapped_args)``.

EPILOGUES: dict[str, str] = {
    "per-function": RUNTIME_WRAPPERS + ":_codegen_backward_epilogue",
    "module-level": RUNTIME_WRAPPERS + ":_backward_epilogue_functional",
}
"""Epilogue shape -> the torch internal whose presence selects it (first present wins)."""


@functools.cache
def epilogue_style() -> str:
    """Which shape of backward epilogue this torch has (Note [Two shapes of the AOT backward epilogue])."""
    for style, dotted in EPILOGUES.items():
        try:
            lookup(dotted)
        except (ImportError, AttributeError):
            continue
        return style
    raise LookupError("no known AOT backward epilogue: " + " or ".join(EPILOGUES.values()))


_epilogue_override = threading.local()


def _module_epilogue(original: Callable[..., Any]) -> Callable[..., Any]:
    def _backward_epilogue_functional(metadata: Any, subclass_meta: Any, out: Any, *args: Any, **kwargs: Any) -> Any:
        override = getattr(_epilogue_override, "value", None)
        if override is not None:
            kwargs["make_subclass_override"] = override
        return original(metadata, subclass_meta, out, *args, **kwargs)

    return _backward_epilogue_functional


MODULE_EPILOGUE = PatchSet(
    "module-level AOT backward epilogue override",
    lambda: [AttributeSwap(lambda: lookup(RUNTIME_WRAPPERS), "_backward_epilogue_functional", _module_epilogue, own_only=False)],
)
"""Our override for the module-level epilogue, in the proxying thread only (Note [Two shapes of the AOT backward epilogue])."""


@contextlib.contextmanager
def swapped_epilogue(ctx: Any, override: Callable[..., Any]) -> Iterator[None]:
    """Trace one AOT function's backward epilogue with ``override`` as its ``make_subclass_override``.

    Note [Two shapes of the AOT backward epilogue].
    """
    forward_cls = ctx._forward_cls
    if epilogue_style() == "module-level":
        with MODULE_EPILOGUE.applied():
            prior = getattr(_epilogue_override, "value", None)
            _epilogue_override.value = override
            try:
                yield
            finally:
                _epilogue_override.value = prior
        return
    original = forward_cls.__dict__.get("_bw_epilogue_fn")
    inherited = original is None
    if inherited:
        original = forward_cls._bw_epilogue_fn

    def epilogue(outputs: Any, make_subclass_override: Any = None) -> Any:
        return original(outputs, make_subclass_override=override)

    forward_cls._bw_epilogue_fn = epilogue
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


def _class_in_loaded_module(dotted: str) -> Any:
    """``dotted``'s object when its module is already imported (never imports inductor for a question), else None."""
    module_name, _, attr = dotted.partition(":")
    module = sys.modules.get(module_name)
    return getattr(module, attr, None) if module is not None else None


def forward_backend(ctx: Any) -> str | None:
    """The backend that compiled the forward of an AOT backward node: ``"inductor"``, ``"aot_eager"``, or None.

    Read off the AOT function's compiled forward (``compiled_fw``, unwrapped through the ``functools.wraps``
    of AOT's runtime wrappers): an inductor output, or the function ``boxed_nop`` returns.  None for any
    other compiler (a custom backend) and where torch keeps neither (Note [Defaults follow the user] in
    ``config.py``).
    """
    compiled = getattr(getattr(ctx, "_forward_cls", None), "compiled_fw", None)
    for _ in range(16):
        inner = getattr(compiled, "__wrapped__", None)
        if inner is None:
            break
        compiled = inner
    output_code = _class_in_loaded_module(INDUCTOR_OUTPUT)
    if isinstance(output_code, type) and isinstance(compiled, output_code):
        return "inductor"
    boxed_nop = _class_in_loaded_module(AOT_EAGER_COMPILER)
    if (
        boxed_nop is not None
        and getattr(compiled, "__module__", None) == boxed_nop.__module__
        and getattr(compiled, "__qualname__", "").startswith(boxed_nop.__qualname__ + ".")
    ):
        return "aot_eager"
    return None

"""torch's persistent compile caches: AOTAutogradCache's key pickler, its allowlist, the mega-cache API.

Note [Warm start through torch's caches] in ``subclass_ca/_warm_start/cacheable.py`` says what we do with them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
from collections.abc import Callable
from typing import Any, cast

import torch

from ._lookup import lookup
from ._patch import AttributeSwap

__all__ = [
    "GENERATED_DIAGNOSTIC_GLOBALS",
    "CACHE_PICKLER",
    "MARKED_CACHEABLE_OPTION",
    "CA_OPS_MODULE",
    "INLINED_CA_OPS",
    "PROLOGUE_MODULE",
    "PROLOGUE_NAME",
    "cache_global_swap",
    "AOT_CACHE_KEY",
    "aot_key_swap",
    "extended_cache_key",
    "rekey_pending_forward",
    "Uncacheable",
    "aot_key_swap_supported",
    "forward_cache_key",
    "forward_has_subclass_inputs",
    "marked_cacheable_supported",
    "marked_cacheable_functions",
    "ca_op_name",
    "is_stable_prologue",
    "prologue_inner",
    "cache_counters",
    "compile_time_metrics",
    "pending_forward_entry",
    "aot_forward_class",
    "save_cache_artifacts",
    "load_cache_artifacts",
    "artifact_ids",
    "without_artifacts",
    "cache_dir",
]

CACHE_PICKLER = "torch._functorch._aot_autograd.autograd_cache:AOTAutogradCachePickler"
"""Its ``_format_global_for_cache_key`` writes one import line per global of the graph into the key."""
MARKED_CACHEABLE_OPTION = "unsafe_marked_cacheable_functions"
"""``torch._inductor.config`` dict ``{"module.name": version}``: call targets AOTAutogradCache may cache."""
CA_OPS_MODULE = "torch._dynamo.compiled_autograd.ops"
"""The ``__module__`` compiled autograd gives its graph ops (not an importable module)."""
INLINED_CA_OPS: dict[str, tuple[str, ...]] = {"torch._dynamo.external_utils.call_accumulate_grad": ("AccumulateGrad",)}
"""CA graph targets that Dynamo inlines into calls of compiled autograd's ops (by op name)."""
PROLOGUE_MODULE = "torch._dynamo.compiled_autograd"
PROLOGUE_NAME = "call_aot_bwd_prologue"
GENERATED_DIAGNOSTIC_GLOBALS: frozenset[str] = frozenset({"_compile_id_"})
"""Globals of AOT's generated backward prologue (torch 2.13+) that only name its graph in error messages.

The Dynamo compile id is numbered per process in compile order: a key that described it would
differ between two processes that compile the same code in another order (a restart whose forward
replays a kept trace compiles nothing before its blocks, say), and every entry after it would miss.
"""


def cache_global_swap(key_of: Callable[[Any], str | None]) -> AttributeSwap:
    """AOTAutogradCache's key line for a graph global: ``key_of(obj)`` where it answers, torch's otherwise.

    torch writes an import statement per global, which fails for compiled autograd's ops (their
    module does not exist) and for closures, so every CA graph bypasses the cache; ``key_of``
    answers with a description of what the object does instead (never for anything else).
    """

    def make(original: Any) -> Any:
        format_global = original.__func__ if isinstance(original, staticmethod) else original

        def _format_global_for_cache_key(name: str, obj: Any) -> str:
            key = key_of(obj)
            if key is None:
                return cast(str, format_global(name, obj))
            return f"# subclass_ca cacheable {name}: {key}"

        _format_global_for_cache_key.__subclass_ca_original__ = format_global  # type: ignore[attr-defined]
        return staticmethod(_format_global_for_cache_key)

    return AttributeSwap(lambda: lookup(CACHE_PICKLER), "_format_global_for_cache_key", make)


AOT_CACHE_KEY = "torch._functorch._aot_autograd.autograd_cache:autograd_cache_key"
"""``autograd_cache_key(graph, example_inputs, aot_config, ...) -> (key, debug_lines)``, read as a module global by its callers."""


def aot_key_swap_supported() -> bool:
    """Whether this torch computes AOTAutogradCache keys through :data:`AOT_CACHE_KEY`."""
    try:
        return callable(lookup(AOT_CACHE_KEY))
    except (ImportError, AttributeError):
        return False


class Uncacheable(Exception):
    """Raised by an ``aot_key_swap`` extension: this graph's compile must not enter AOTAutogradCache at all."""


def aot_key_swap(extension: Callable[[Any, Any, str], str | None], outside: Callable[[Any, Any, str], str | None],
                 keyed: Callable[[str], None], scope: Any) -> AttributeSwap:
    """AOTAutogradCache keys get ``extension(module, example_inputs, torch_key)`` appended inside ``scope``, and
    ``outside(module, example_inputs, torch_key)`` outside it.

    ``module``: what AOT compiles, a GraphModule or torch's wrapper of one with flat inputs (its ``gm``).

    Each answers None where torch's key stands (outside ``scope``: every compile subclass_ca did not
    save, Note [Forwards compiled outside a block] in ``subclass_ca/_warm_start/outside.py``), and raises
    :class:`Uncacheable` where nothing can describe the graph (torch then bypasses its cache for that
    compile, as for any graph it cannot key); Note [Keys by behaviour] in ``subclass_ca/_warm_start/keys.py``.
    """
    module_name, _, attr = AOT_CACHE_KEY.partition(":")

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def autograd_cache_key(mod: Any, example_inputs: Any, config: Any, *rest: Any, **kwargs: Any) -> Any:
            key, lines = original(mod, example_inputs, config, *rest, **kwargs)
            try:
                extra = (extension if scope.depth else outside)(mod, example_inputs, key)
            except Uncacheable as why:
                raise lookup("torch._functorch._aot_autograd.autograd_cache:BypassAOTAutogradCache")(
                    f"subclass_ca: {why}"
                ) from None
            if extra is None:
                return key, lines
            extended = extended_cache_key(key, extra)
            keyed(extended)
            return extended, [*lines, f"[subclass_ca behaviour]: {extra}"]

        return autograd_cache_key

    return AttributeSwap(lambda: importlib.import_module(module_name), attr, make)


def extended_cache_key(key: str, extra: str) -> str:
    """torch's AOTAutogradCache key with a behaviour key appended (:func:`aot_key_swap`)."""
    return key + digest_of(extra)


def digest_of(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=8).hexdigest()


def forward_has_subclass_inputs(forward_cls: Any) -> bool:
    """Whether an AOT function takes a wrapper-subclass input (unknown metadata: assume it does)."""
    metadata = getattr(forward_cls, "metadata", None)
    inputs = getattr(metadata, "subclass_inp_meta", None)
    if inputs is None:
        return True
    return any(type(meta).__name__ == "SubclassCreationMeta" for meta in inputs)


def forward_cache_key(forward_cls: Any) -> str | None:
    """The AOTAutogradCache key a forward's entry would be written under (None: none, or unknown)."""
    compiler = _backward_compiler(forward_cls)
    key = getattr(getattr(getattr(compiler, "aot_config", None), "cache_info", None), "cache_key", None)
    return key if isinstance(key, str) else None


def marked_cacheable_supported() -> bool:
    """Whether this torch has both hooks a CA graph needs to be cached (the allowlist and the key pickler)."""
    try:
        config = lookup("torch._inductor:config")
        pickler = lookup(CACHE_PICKLER)
    except (ImportError, AttributeError):
        return False
    return isinstance(getattr(config, MARKED_CACHEABLE_OPTION, None), dict) and "_format_global_for_cache_key" in pickler.__dict__


def marked_cacheable_functions() -> dict[str, str]:
    """The allowlist as the user (or torch) left it; ours is added per compile through ``options``."""
    return dict(getattr(lookup("torch._inductor:config"), MARKED_CACHEABLE_OPTION, {}))


def ca_op_name(obj: Any) -> tuple[str, bool] | None:
    """``(name, is_custom_function)`` for one of compiled autograd's graph ops, else None."""
    if type(obj).__name__ != "Op" or getattr(obj, "__module__", None) != CA_OPS_MODULE:
        return None
    return obj.__name__, bool(getattr(obj, "is_custom_function", True))


def is_stable_prologue(obj: Any) -> bool:
    """An AOT backward prologue callable of compiled autograd's (a closure over the AOT function's prologue)."""
    return (
        getattr(obj, "__name__", None) == PROLOGUE_NAME
        and getattr(obj, "__module__", None) == PROLOGUE_MODULE
        and bool(getattr(obj, "__closure__", None))
    )


def prologue_inner(obj: Any) -> list[Any]:
    """What a prologue closure closes over: the AOT function's generated prologue (its behaviour)."""
    return [cell.cell_contents for cell in obj.__closure__]


def aot_forward_class(ctx: Any) -> Any:
    """The AOT autograd Function class of an AOT backward node's context (None for anything else)."""
    return getattr(ctx, "_forward_cls", None)


def _backward_compiler(forward_cls: Any) -> Any:
    """AOT's lazy backward compiler of an AOT function (its ``_backward_impl`` closes over it), or None."""
    impl = getattr(forward_cls, "_backward_impl", None)
    for cell in getattr(impl, "__closure__", None) or ():
        compiler = cell.cell_contents
        if type(compiler).__name__ == "_AutogradBackwardCompiler":
            return compiler
    return None


def _pending_compiler(forward_cls: Any) -> Any:
    """The backward compiler of an AOT function whose forward entry is still unwritten (its backward never compiled,
    the entry cacheable), or None (compiled already, loaded from the cache, or not cacheable)."""
    compiler = _backward_compiler(forward_cls)
    if compiler is None or not hasattr(compiler, "get_or_compile"):
        return None
    if compiler.compiled_bw is not None or compiler.try_save_cache_entry is None:
        return None
    return compiler


def rekey_pending_forward(forward_cls: Any, key: str) -> bool:
    """Make the entry a forward's pending backward compile writes (:func:`pending_forward_entry`) go under ``key``;
    False where there is none to rekey (compiled already, loaded from the cache, not cacheable)."""
    compiler = _pending_compiler(forward_cls)
    info = getattr(getattr(compiler, "aot_config", None), "cache_info", None)
    if info is None or not isinstance(getattr(info, "cache_key", None), str):
        return False
    info.cache_key = key  # read when the entry is written (try_save_cache_entry reads aot_config.cache_info)
    return True


def pending_forward_entry(forward_cls: Any) -> Callable[[], Any] | None:
    """For an AOT function whose forward was compiled but whose backward never was: a call that compiles it.

    AOTAutogradCache writes a forward's entry only once the backward is compiled (lazily, at the
    first eager backward); under compiled autograd that never happens, since the backward graph
    is pasted into the CA graph.  Compiling it through AOT's own lazy compiler writes the entry.
    None when there is nothing to do (compiled already, loaded from the cache, or not cacheable).
    """
    compiler = _pending_compiler(forward_cls)
    if compiler is None:
        return None
    return lambda: compiler.get_or_compile(saved_tensors_use_once=False)


def cache_counters() -> dict[str, int]:
    """AOTAutogradCache and FX graph cache counters of this process (hits, misses, bypasses, saves)."""
    counters = torch._dynamo.utils.counters
    names = {
        "aot_hit": ("aot_autograd", "autograd_cache_hit"),
        "aot_miss": ("aot_autograd", "autograd_cache_miss"),
        "aot_bypass": ("aot_autograd", "autograd_cache_bypass"),
        "aot_saved": ("aot_autograd", "autograd_cache_saved"),
        "fx_hit": ("inductor", "fxgraph_cache_hit"),
        "fx_miss": ("inductor", "fxgraph_cache_miss"),
        "fx_bypass": ("inductor", "fxgraph_cache_bypass"),
    }
    return {name: int(counters[group][key]) for name, (group, key) in names.items()}


def compile_time_metrics() -> dict[str, list[float]]:
    """torch's per-phase compile timers of this process (seconds per call, by phase name)."""
    return dict(lookup("torch._dynamo.utils:compilation_time_metrics"))


def save_cache_artifacts() -> bytes | None:
    """torch's mega-cache of every compile artifact this process saved or loaded (None: nothing)."""
    saved = torch.compiler.save_cache_artifacts()
    return None if saved is None else saved[0]


def load_cache_artifacts(data: bytes) -> Any:
    """Write artifacts from :func:`save_cache_artifacts` into this process's caches (before compiling)."""
    return torch.compiler.load_cache_artifacts(data)


ARTIFACT_MANAGER = "torch.compiler._cache:CacheArtifactManager"
"""Reads and writes the mega-cache format (``deserialize``: ``{artifact type: [artifact with .key]}``)."""
ARTIFACT_SERIALIZER = ("torch.utils._appending_byte_serializer:AppendingByteSerializer", "torch.compiler._cache:_serialize_single_cache")


def artifact_ids(data: bytes) -> frozenset[tuple[str, str]] | None:
    """The (type, key) of each artifact in torch's mega-cache ``data``; None when this torch's format cannot be read."""
    try:
        artifacts = lookup(ARTIFACT_MANAGER).deserialize(data)
    except (ImportError, AttributeError):
        return None
    if artifacts is None:
        return frozenset()
    return frozenset((kind, artifact.key) for kind, items in artifacts.items() for artifact in items)


def without_artifacts(data: bytes, ids: frozenset[tuple[str, str]]) -> bytes | None:
    """torch's mega-cache ``data`` less the artifacts named by ``ids``; None when this torch's format cannot be rewritten."""
    try:
        artifacts = lookup(ARTIFACT_MANAGER).deserialize(data)
        serializer = lookup(ARTIFACT_SERIALIZER[0])(serialize_fn=lookup(ARTIFACT_SERIALIZER[1]))
    except (ImportError, AttributeError):
        return None
    if artifacts is None:
        return None
    kept = [(kind, [a for a in items if (kind, a.key) not in ids]) for kind, items in artifacts.items()]
    serializer.extend([(kind, items) for kind, items in kept if items])
    return bytes(serializer.to_bytes())


def cache_dir() -> str:
    """The folder torch's compile caches live in (``TORCHINDUCTOR_CACHE_DIR`` or its default)."""
    return str(lookup("torch._inductor.runtime.cache_dir_utils:cache_dir")())

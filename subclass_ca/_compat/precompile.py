"""Dynamo's precompile pieces: record one frame's guards and transformed code, put them back on a later process's code.

Note [Skipping Dynamo's trace of an unchanged CA graph] in ``subclass_ca/_warm_start/traced.py``
says what we do with them.  Everything here is torch's (``torch._dynamo.package``, the C++
frame cache, the bundled AOTAutograd entry); a torch that moves one of them turns the feature
off (``precompile_supported``), and CA graphs are traced again as before.
"""

from __future__ import annotations

import importlib
import pickle
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ._lookup import lookup
from ._patch import BLOCKS, AttributeSwap, gated
from .dynamo import dynamo_disable

__all__ = [
    "PRECOMPILE_PARTS",
    "precompile_supported",
    "new_package",
    "dynamo_optimize",
    "inductor_backend",
    "flat_input_backend",
    "recorded_frame",
    "recording_bypassed",
    "portable_compile_configs",
    "install_frame",
    "guard_requires_grad_swap",
    "is_dropped_guard",
]

NON_LEAF_GRAD_WARNING = r"The \.grad attribute of a Tensor that is not a leaf Tensor is being accessed"
"""torch's UserWarning for reading ``.grad`` of a non-leaf tensor, which its guards pickler does for a CA graph input
that is a saved activation: our recording's doing, not the user's, so it is silenced there and only there."""
PRECOMPILE_PARTS = {
    "package": "torch._dynamo.package:CompilePackage",
    "guards state loader": "torch._dynamo.package:load_guards_state",
    "guard manager loader": "torch._dynamo.package:load_guard_manager",
    "serialized code": "torch._dynamo.package:SerializedCode",
    "frame cache entry loader": "torch._C._dynamo.eval_frame:_load_precompile_entry",
    "bundled AOT callable": "torch._dynamo.aot_compile_types:BundledAOTAutogradSerializableCallable",
    "graph input flattening": "torch._dynamo.utils:flatten_graph_inputs",
    "guards pickler": "torch._dynamo.guards:GuardsStatePickler._unpickle_traceable_wrapper_subclass",
    "inductor wrapper": "torch:_TorchCompileInductorWrapper",
}
"""What recording and installing a traced CA graph uses, by name (all or nothing)."""


def precompile_supported() -> bool:
    """Whether this torch has every part of :data:`PRECOMPILE_PARTS`."""
    try:
        for dotted in PRECOMPILE_PARTS.values():
            lookup(dotted)
    except (ImportError, AttributeError):
        return False
    return True


def new_package(fn: Callable[..., Any]) -> Any:
    """A fresh recording for the frame of ``fn``: Dynamo fills it while it traces (guards, transformed code, backends)."""
    return lookup(PRECOMPILE_PARTS["package"])(fn)


def dynamo_optimize(backend: Any, *, dynamic: bool | None, package: Any, guard_filter: Callable[..., Any]) -> Callable[[Any], Any]:
    """``torch.compile(fullgraph=True)`` of one frame with a recording and a guard filter (torch.compile takes neither)."""
    return torch._dynamo.optimize(backend, nopython=True, dynamic=dynamic, package=package, guard_filter_fn=guard_filter)


def inductor_backend(options: dict[str, Any] | None, dynamic: bool | None) -> Any:
    """What ``torch.compile(backend="inductor", options=options)`` hands Dynamo."""
    return lookup(PRECOMPILE_PARTS["inductor wrapper"])(None, options, dynamic)


class _FlatInputs:
    """A compiled CA graph taking Dynamo's graph arguments: the boxed ``inputs`` list first, flattened as torch does
    (``listed``); a regional piece's arguments are tensors already and pass as they are."""

    def __init__(self, compiled: Any, *, boxed: bool, listed: bool = True) -> None:
        self.compiled = compiled
        self.boxed = boxed
        self.listed = listed

    def __call__(self, *args: Any) -> Any:
        if not self.listed:
            return self.compiled(*args)
        flat = [*args[0], *args[1:]]
        args[0].clear()  # the graph owns its inputs (compiled autograd's boxed calling convention)
        return self.compiled(flat) if self.boxed else self.compiled(*flat)


_BACKEND_ID = "_backend_id"
"""The per-process name Dynamo gives a frame's backend under a precompile package (read by AOT as
``precompile_backend_id``, part of its cache key)."""


def flat_input_backend(backend: Any) -> Callable[[torch.fx.GraphModule, list[Any]], Any]:
    """``backend`` for a CA graph frame, compiled so that the result can be serialized (a bundled AOT entry).

    torch's inductor path wraps a graph with a boxed list input in a closure that keeps no
    ``serialize``; flattening it here keeps the AOT function that has one.
    """
    flatten = lookup(PRECOMPILE_PARTS["graph input flattening"])

    def compile_frame(graph_module: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        if not any(isinstance(value, list) for value in example_inputs):  # a regional piece: tensors already
            # Dynamo names the frame's backend per process (a uuid) on the graph, and AOT puts that name in its cache
            # key: every restart would miss.  A flattened whole graph carries no name, so neither does a piece.
            backend_id = graph_module.__dict__.pop(_BACKEND_ID, None)
            try:
                with torch._functorch.config.patch(bundled_autograd_cache=True):
                    return _FlatInputs(backend(graph_module, example_inputs), boxed=False, listed=False)
            finally:
                if backend_id is not None:
                    setattr(graph_module, _BACKEND_ID, backend_id)
        compiled: list[Any] = []

        def compile_flat(flat_module: Any, flat_inputs: Any) -> Any:
            with torch._functorch.config.patch(bundled_autograd_cache=True):
                compiled.append(backend(flat_module, flat_inputs))
            return compiled[-1]

        flatten(graph_module, example_inputs, compile_flat)
        return _FlatInputs(compiled[-1], boxed=True)

    return compile_frame


def _main_entry(package: Any) -> Any:
    return next(iter(package._codes.values()))


def recording_bypassed(package: Any) -> bool:
    """Whether torch gave up the recording (it then fails the compile: ``guards_state`` is None)."""
    return bool(_main_entry(package).bypassed)


def portable_compile_configs() -> list[dict[str, Any]]:
    """Dynamo's, AOTAutograd's and inductor's configs as torch's own cache keys read them."""
    return [dict(lookup(name).save_config_portable()) for name in ("torch._dynamo:config", "torch._functorch:config", "torch._inductor:config")]


def recorded_frame(package: Any) -> bytes | None:
    """What Dynamo recorded for the frame, serialized; None when it cannot be replayed in another process.

    None: the recording was bypassed (a guard that cannot be serialized), has no compiled graph,
    or its compiled graph has no serializable AOT entry.
    """
    entry = _main_entry(package)
    if entry.bypassed or not entry.guarded_codes or not entry.backend_ids:
        return None
    bundled = lookup(PRECOMPILE_PARTS["bundled AOT callable"])
    backends = {}
    listed = {}
    for backend_id in entry.backend_ids:
        compiled = package.cached_backends.get(backend_id)
        if not isinstance(compiled, _FlatInputs) or getattr(compiled.compiled, "serialize", None) is None:
            return None
        backends[backend_id] = bundled.serialize_compile_artifacts(bundled(compiled.compiled))
        listed[backend_id] = compiled.listed
    frame = {
        "import_sources": dict(entry.import_sources),
        "guarded_codes": [(code.guards_state, code.dynamo_code) for code in entry.guarded_codes],
        "backends": backends,
        "listed": listed,
    }
    return pickle.dumps(frame)


def install_frame(recorded: bytes, code: Any, frame_globals: dict[str, Any]) -> None:
    """Put a :func:`recorded_frame` on ``code`` (whose frames run with ``frame_globals``): its next call skips tracing.

    The guards are checked at every call as for any compiled frame; a call they refuse is traced
    and compiled as usual.
    """
    frame = pickle.loads(recorded)  # noqa: S301  -- written by save_cache() into torch's own cache folder or file
    bundled = lookup(PRECOMPILE_PARTS["bundled AOT callable"])
    serialized_code = lookup(PRECOMPILE_PARTS["serialized code"])
    load_guards_state = lookup(PRECOMPILE_PARTS["guards state loader"])
    load_guard_manager = lookup(PRECOMPILE_PARTS["guard manager loader"])
    load_entry = lookup(PRECOMPILE_PARTS["frame cache entry loader"])
    for alias, module_name in frame["import_sources"].items():
        frame_globals[alias] = importlib.import_module(module_name)
    for backend_id, data in frame["backends"].items():
        compiled = bundled.deserialize_compile_artifacts(data)
        listed = frame.get("listed", {}).get(backend_id, True)
        frame_globals[backend_id] = dynamo_disable(_FlatInputs(compiled, boxed=False, listed=listed))
    for guards_state, dynamo_code in frame["guarded_codes"]:
        manager = load_guard_manager(load_guards_state(guards_state), code, frame_globals)
        load_entry(code, manager, serialized_code.to_code_object(dynamo_code))


def is_dropped_guard(entry: Any) -> bool:
    """A guard a replayed CA graph frame goes without: globals (keyed instead) and the type of ``self``.

    The frame's globals are the CA graph's own (its generated code's), which the record's key
    describes; ``self`` is the graph module whose code the record is installed on, of a class
    made per instance.
    """
    return bool(entry.is_global) or (entry.name == "self" and entry.guard_type == "TYPE_MATCH")


def guard_requires_grad_swap() -> AttributeSwap:
    """Keep ``requires_grad`` of a wrapper-subclass input in a serialized guard (inside a block); a subclass
    input torch cannot pickle gives the recording up instead of failing the compile.

    torch's guards pickler rebuilds such an input from a meta copy made without it, so the
    replayed guard expects ``requires_grad=False`` for every subclass parameter and refuses
    every call (torch 2.11 to 2.15).
    """

    def make(original: Any) -> Any:
        def reducer_override(self: Any, obj: Any) -> Any:
            try:
                if isinstance(obj, torch.Tensor) and not obj.is_leaf:
                    with warnings.catch_warnings():  # torch's pickler reads every input's .grad (a saved activation's too)
                        warnings.filterwarnings("ignore", message=NON_LEAF_GRAD_WARNING, category=UserWarning)
                        reduced = original(self, obj)
                else:
                    reduced = original(self, obj)
            except Exception as error:
                if not isinstance(obj, torch.Tensor):
                    raise
                # torch pickles a subclass input through a meta copy (empty_like); a subclass that
                # implements no such op (torchao's Int8QuantizedTrainingLinearWeight) failed the whole
                # compile.  AttributeError is what torch's pickler turns into "these guards cannot be
                # serialized": it gives the recording up and the graph compiles without one.
                raise AttributeError(f"a guard on a {type(obj).__qualname__} input cannot be serialized: {error}") from error
            if isinstance(obj, torch.Tensor) and isinstance(reduced, tuple) and obj.requires_grad and \
                    getattr(reduced[0], "__name__", "") == "_unpickle_traceable_wrapper_subclass":
                return _with_requires_grad, (reduced[0], reduced[1])
            return reduced

        return gated(BLOCKS, original, reducer_override)

    return AttributeSwap(lambda: lookup(PRECOMPILE_PARTS["guards pickler"].rpartition(".")[0]), "reducer_override", make)


def _with_requires_grad(rebuild: Callable[..., torch.Tensor], args: Sequence[Any]) -> torch.Tensor:
    return rebuild(*args).requires_grad_(True)

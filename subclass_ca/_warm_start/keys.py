"""Every key the warm start builds, in one module: a graph's by behaviour (the one rule for reuse across processes: a
key describes what a graph computes, by tracing it), a CA graph global's key line, a kept trace's record key.

Note [Keys by behaviour]
------------------------
A compiled artifact used in another process (an AOTAutogradCache entry of a CA graph, a kept
Dynamo trace, a forward entry that ``save_cache()`` writes) must compute what the cold path
would compute now.  AOT bakes into it whatever Python the graph reaches: a rebuild and the
helpers it calls, ``__tensor_unflatten__``, the ``__torch_dispatch__`` of every wrapper subclass
that flows through the graph, module constants, class attributes, closures, hidden object
state.  Describing that code by names (a module by its name, a class by three methods, an
object by ``repr``) misses every indirection, and no finite walk of code can promise otherwise.

So a key describes behaviour by what it traces to, which is what AOT bakes:

* **the behaviour key** of a graph and its inputs (:func:`behaviour_key`) is the aten graph
  ``make_fx`` records for it on fake copies of the inputs, with every wrapper subclass
  desugared (inputs enter as plain inner tensors and are rebuilt inside the trace, so their
  dispatch is traced; outputs and the ``.grad`` of leaf inputs leave flattened), plus the
  subclass structure around the plain tensors (types, flatten contexts, sizes and strides,
  described by ``fingerprint.describe``), the values of constants the trace captured, and the
  installed versions of the distributions that define the subclass types met (an upgrade
  that changes only code the graph does not trace, such as runtime wrappers, is then a miss,
  never a stale hit).  Our build, torch's and Python's versions are in it too.
* **where it is used** -- one key per artifact, no other path across processes:
  - an AOTAutogradCache entry compiled inside a block, of a CA graph (admitted to the cache by
    our allowlist, ``cacheable.compile_kwargs``) or of a forward with a wrapper-subclass input:
    torch's key gets the behaviour key of Dynamo's graph and its example inputs appended
    (:func:`aot_key_extension`, through ``_compat.aot_key_swap``); ``save_cache()`` writes only
    forward entries whose key is torch's own for plain inputs or was extended so;
  - a kept trace (``traced.py``): its record key holds the behaviour key of the CA graph on its
    first call's inputs, and a frame Dynamo compiles a second time (other inputs) is not kept.
* **where it cannot be established** -- symbolic sizes (the trace would be another graph),
  hooks in the CA graph for a kept trace (they act on state outside it: FSDP2's unshard, an
  optimizer step), anything the trace or a description raises -- torch is told to bypass its
  cache for that compile (no entry written or read, even in this process; Dynamo's and compiled
  autograd's own caches still reuse the graph) and no trace is kept.  ``enable(cache=False)``
  (or ``SUBCLASS_CA_CACHE=0``) keeps CA graphs out of torch's persistent caches altogether, as
  stock compiled autograd does.

Cost: one ``make_fx`` trace per CA graph capture and per subclass-input forward compiled in
a block, in every process (benchmarks/ gives the figures); on a restart it replaces AOT's own
trace, partition and lowering, not Dynamo's guards.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
import threading
import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .. import _compat
from .._recipe import all_recipes
from ..config import Config, cache_key
from .fingerprint import Unstable, describe, digest, package_digest, process_local, tensor_contents

__all__ = ["behaviour_key", "cross_process_key", "aot_key_extension", "behaviour_keyed", "remember_keyed", "key_of",
           "global_kind", "graph_key"]


_keyed: set[str] = set()
_lock = threading.Lock()


@functools.cache
def _distributions() -> dict[str, list[str]]:
    return dict(importlib.metadata.packages_distributions())


def _provides(distribution: importlib.metadata.Distribution, top: str) -> bool:
    listed = distribution.read_text("top_level.txt")
    if listed is not None:
        return top in listed.split()
    return any(path.parts and path.parts[0] in (top, f"{top}.py") for path in distribution.files or ())


@functools.cache
def _providers(top: str) -> tuple[str, ...]:
    """The installed distributions that provide the top-level package ``top``.

    ``packages_distributions()`` reads every installed distribution's file list (0.06-0.13 s with
    torch installed, paid by the first key of a restart).  A regular package is provided by the
    distribution of its own name in the common case: that one is checked alone.  A namespace
    package (several distributions share it) or another name takes the full scan.
    """
    module = sys.modules.get(top)
    if module is not None and getattr(module, "__file__", None):
        for name in dict.fromkeys((top, top.replace("_", "-"))):
            try:
                distribution = importlib.metadata.distribution(name)
            except importlib.metadata.PackageNotFoundError:
                continue
            if _provides(distribution, top):
                return (distribution.metadata["Name"],)
    return tuple(_distributions().get(top, ()))


def _versions(classes: Sequence[type]) -> list[str]:
    """The installed distributions (name==version) that define ``classes``; a class of none: its module's file."""
    found: set[str] = set()
    for cls in classes:
        top = (cls.__module__ or "").split(".")[0]
        if top in ("torch", "builtins"):
            continue  # torch's version is in every key
        names = _providers(top)
        if names:
            found.update(f"{name}=={importlib.metadata.version(name)}" for name in names)
        else:
            found.add(f"{cls.__module__} (no distribution)")
    return sorted(found)


def _graph_lines(graph_module: torch.fx.GraphModule) -> list[str]:
    lines = [graph_module.code]
    for node in graph_module.graph.nodes:
        value = node.meta.get("val")
        if node.op == "placeholder" and isinstance(value, torch.Tensor):
            lines.append(f"{node.name}: {value.dtype} {value.device} {tuple(value.shape)} {value.stride()}")
        elif node.op == "get_attr":
            attr = getattr(graph_module, str(node.target))
            if not isinstance(attr, torch.Tensor):
                raise Unstable(f"a graph attribute {node.target} of type {type(attr).__qualname__}")
            lines.append(f"{node.target}: {tensor_contents(attr)}")
    return lines


def behaviour_key(fn: Callable[..., Any], args: Sequence[Any]) -> str:
    """What ``fn(*args)`` computes, as a key two processes share exactly when it computes the same (Note [Keys by behaviour]).

    Raises :class:`Unstable` (with the reason) where that cannot be established.
    """
    try:
        trace = _compat.trace_desugared(fn, args)
    except _compat.SymbolicInputs as why:
        raise Unstable(str(why)) from None
    except Exception as error:  # noqa: BLE001  -- a key must never fail the compile it keys
        raise Unstable(f"tracing it raised {type(error).__name__}: {str(error).strip()[:200]}") from None
    return digest(
        package_digest(), f"torch {torch.__version__}", f"python {sys.version_info[:3]}",
        *_graph_lines(trace.graph_module),
        describe(trace.inputs), describe(trace.outputs),
        *_versions(trace.classes),
    )


def cross_process_key(what: str, fn: Callable[..., Any], args: Sequence[Any], *, refuse: str | None = None) -> str:
    """The behaviour key of ``fn(*args)``, or this process's nonce with the reason (``refuse``: a reason known already)."""
    if refuse is None:
        try:
            return behaviour_key(fn, args)
        except Unstable as why:
            refuse = str(why)
    return process_local(what, refuse)


def aot_key_extension(module: Any, example_inputs: Sequence[Any], torch_key: str | None = None) -> str | None:
    """What to add to torch's AOTAutogradCache key of a graph compiled inside a block (Note [Keys by behaviour]).

    torch's key is the Dynamo graph, its globals and its inputs' metadata: complete for a graph of
    torch ops over plain inputs (None: torch's key stands), blind to a wrapper subclass's code and
    type and to what our CA graph call targets do.  Such a graph gets its behaviour key, or raises
    :class:`_compat.Uncacheable` (torch bypasses its cache for it) where that cannot be established.
    """
    with_subclass = any(_compat.is_traceable_wrapper_subclass(v) for v in example_inputs)
    ca_graph = _is_ca_graph(getattr(module, "gm", module))
    if not (with_subclass or ca_graph):
        return None
    what = "a CA graph" if ca_graph else f"a forward with {_subclass_names(example_inputs)} inputs"
    try:
        key = behaviour_key(module, example_inputs)
    except Unstable as why:
        process_local(what, str(why))  # recorded: uncacheable_reasons() says why
        raise _compat.Uncacheable(f"{what} has no key by behaviour: {why}") from None
    return key


def remember_keyed(cache_key: str) -> None:
    """An AOTAutogradCache key :func:`aot_key_extension` extended (its entry may be written by ``save_cache()``)."""
    with _lock:
        _keyed.add(cache_key)


def _is_ca_graph(graph_module: torch.fx.GraphModule) -> bool:
    for node in graph_module.graph.nodes:
        target = node.target
        if node.op == "call_function" and (
            hasattr(target, "_subclass_ca_type") or _compat.ca_op_name(target) is not None or _compat.is_stable_prologue(target)
        ):
            return True
    return False


def _subclass_names(values: Sequence[Any]) -> str:
    return ", ".join(sorted({type(v).__qualname__ for v in values if _compat.is_traceable_wrapper_subclass(v)}))


def behaviour_keyed(cache_key: str | None) -> bool:
    """Whether an AOTAutogradCache key is one :func:`aot_key_extension` extended in this process."""
    with _lock:
        return cache_key in _keyed


# --- key lines of CA graph globals (Note [Warm start through torch's caches] in cacheable.py) ----------------------


_prologue_keys: dict[int, tuple[Any, str]] = {}


def _base() -> str:
    return f"{package_digest()}; torch {torch.__version__}"


def _stable(what: str, build: Any) -> str:
    try:
        return digest(_base(), build())
    except Unstable as why:
        reason = str(why)
    except Exception as error:  # noqa: BLE001  -- a description must never fail the compile it keys
        reason = f"describing it raised {type(error).__name__}: {error}"
    return process_local(what, reason)


def _callable_key(target: Any) -> str:
    from ..registry import get_handler

    cls = target._subclass_ca_type

    def build() -> str:
        recipes = [(i, r) for i, r in enumerate(all_recipes()) if _uses(r, cls)]
        return "; ".join([
            f"{target.__name__} mode={target._subclass_ca_mode}",
            describe(get_handler(cls)),
            *(f"recipe {i}: {_describe_recipe(r)}" for i, r in recipes),
        ])

    return _stable(f"{target.__name__} ({cls.__qualname__})", build)


def _uses(recipe: Any, cls: type) -> bool:
    return recipe.subclass_type is cls


def _describe_recipe(recipe: Any) -> str:
    parts = ", ".join(f"{attr}={_describe_recipe(p) if hasattr(p, 'parts') else describe(p)}" for attr, p in recipe.parts)
    return (
        f"{describe(recipe.handler)} ctx={describe(recipe.ctx)} parts=[{parts}] size={describe(recipe.outer_size)} "
        f"stride={describe(recipe.outer_stride)} symints={recipe.symint_start}:{recipe.symint_end} args={recipe.arg_count} "
        f"expected={describe(recipe.expected)}"
    )


def _prologue_key(prologue: Any) -> str:
    found = _prologue_keys.get(id(prologue))
    if found is not None and found[0] is prologue:
        return found[1]
    key = _stable("an AOT backward prologue", lambda: describe(_compat.prologue_inner(prologue)))
    _prologue_keys[id(prologue)] = (prologue, key)  # the prologue is kept alive: its id is never reused
    return key


def global_kind(obj: Any) -> str | None:
    """Which kind of CA graph global ``obj`` is ("callable": one of our make_<Subclass>, "op": a compiled autograd op,
    "prologue": an AOT backward prologue), without building its key; None: none of them (torch's own key line)."""
    if hasattr(obj, "_subclass_ca_type"):
        return "callable"
    op = _compat.ca_op_name(obj)
    if op is not None:
        return None if op[1] else "op"  # custom C++ functions are numbered per process
    return "prologue" if _compat.is_stable_prologue(obj) else None


def key_of(obj: Any) -> str | None:
    """The key line for a CA graph global of the kinds :func:`global_kind` names (Note [Warm start through torch's
    caches] in ``cacheable.py``); None: torch's own."""
    kind = global_kind(obj)
    if kind == "callable":
        return _callable_key(obj)
    if kind == "op":
        return digest(_base(), f"compiled autograd op {obj.__name__}")
    if kind == "prologue":
        return _prologue_key(obj)
    return None


# --- the record key of a kept trace (Note [Skipping Dynamo's trace of an unchanged CA graph] in traced.py) ------


def _global_line(name: str, value: Any) -> str | None:
    if isinstance(value, types.ModuleType):
        return f"{name}: module {value.__name__}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return f"{name}: {value!r}"
    described = key_of(value)
    if described is not None:
        return f"{name}: {described}"
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    if isinstance(module, str) and isinstance(qualname, str) and "<locals>" not in qualname:
        try:
            found: Any = sys.modules.get(module) or __import__(module, fromlist=["_"])
            for part in qualname.split("."):
                found = getattr(found, part)
        except (ImportError, AttributeError):
            return None
        if found is value:
            return f"{name}: {module}:{qualname}"
    return None


def _constant_line(name: str, value: Any) -> str | None:
    if not isinstance(value, torch.Tensor) or _compat.is_traceable_wrapper_subclass(value) or value.is_meta:
        return None
    try:
        return f"{name}: {tensor_contents(value)}"
    except Unstable:
        return None  # a fake constant: nothing to describe, so no record


def _configs() -> str:
    return "; ".join(describe(snapshot) for snapshot in _compat.portable_compile_configs())


def graph_key(graph_module: torch.fx.GraphModule, config: Config, behaviour: str) -> str | None:
    """The record key of a CA graph (Note [Skipping Dynamo's trace of an unchanged CA graph]); None: not describable.

    ``behaviour``: what the graph computes on its first call's inputs (Note [Keys by behaviour]); the
    rest of the key is what Dynamo's trace of the graph's code depends on.
    """
    forward = graph_module.forward
    frame_globals = forward.__globals__
    lines = [package_digest(), f"torch {torch.__version__}", f"python {sys.version_info[:3]}", repr(cache_key(config)),
             behaviour, graph_module.code]
    for name in sorted(set(forward.__code__.co_names) & frame_globals.keys()):
        line = _global_line(name, frame_globals[name])
        if line is None:
            return None
        lines.append(line)
    for node in graph_module.graph.nodes:
        if node.op == "get_attr":
            line = _constant_line(str(node.target), getattr(graph_module, str(node.target), None))
            if line is None:
                return None
            lines.append(line)
        elif node.op == "call_module":
            return None
    try:
        lines.append(_configs())
    except Unstable:
        return None
    return digest(*lines)

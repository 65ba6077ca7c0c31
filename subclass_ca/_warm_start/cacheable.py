"""Make a CA graph's compile an entry of torch's own persistent caches, keyed by what it does.

Note [Warm start through torch's caches]
----------------------------------------
A restarted job recompiles every CA graph: inductor's FX graph cache already holds the
kernels, but AOTAutogradCache *bypasses* every CA graph, so Dynamo's graph is traced by AOT
and partitioned again in each process.  Two things refuse it, both in torch:

1. its allowlist (``check_node_safe``) admits no call target of compiled autograd's own
   (``ops.validate_outputs``, ``ops.AccumulateGrad``, the per-node ops), nor the AOT backward
   prologue closure, nor our named ``make_<Subclass>`` callables;
2. its key pickler writes one *import line* per graph global, which fails for all of them
   (CA's ops live in a module that does not exist; the prologue is a closure).

The rule: a call target is admitted only with a key line that describes everything it does,
so that equal keys in two processes mean equal behaviour.

* compiled autograd's ops: the op name and torch's version (a per-node op is the node type's
  formula; its saved values are graph inputs or constants already in the key), plus our own
  code digest (our AccumulateGrad swaps change what it traces to).  Custom C++ functions
  (``CppNode<name><n>``) are numbered per process and stay refused;
* an AOT backward prologue: the code AOT generated for it and every value that code reads
  (tangent metadata, subclass unwrap code), described by ``fingerprint.describe``; except the
  Dynamo compile id it names in error messages (``_compat.GENERATED_DIAGNOSTIC_GLOBALS``), which
  is numbered per process in compile order: with it, a restart whose forward replayed a kept
  trace (so compiled one frame fewer first) missed every entry after it, regional pieces included;
* one of our ``make_<Subclass>`` callables: the handler (rebuild and metadata-key code and
  their closures), the subclass's flatten protocol code, and *every recipe interned for that
  class so far* (its id -> what it rebuilds), because a node carries only ``recipe=<id>``.
  Two processes that interned the same recipes in the same order hit; any other history
  misses.  That is the deterministic training job (same captures in the same order), and it
  can never make a graph rebuild with another process's recipe.

The forward graphs are torch's own entries, but AOTAutogradCache writes a forward's entry only
after compiling its backward, which compiled autograd never does (it pastes the backward graph
into its CA graph): so under compiled autograd, ours or stock, every process traces its forwards
again.  Compiling that backward at capture would make every cold start pay one more compile;
instead each captured AOT function is remembered (weakly), and ``save_cache()`` compiles the
backwards still pending, which writes their forwards' entries: a job that asks for a warm
start pays that once, in the run that saves.  A forward loaded from the cache hands compiled autograd
its backward as torch serialized it (other node names, constants, no fake values); the CA graph
is rewritten into one form both give, and nothing in it is decided from fake values, so it is the
cold run's (Note [One CA graph for fresh and cached forwards] in ``_canonical.py``)
and the first restart after ``save_cache()`` finds it.  Dynamo's trace of the CA graph, which
has to run before this cache can be asked, is kept as well (Note [Skipping Dynamo's trace of an
unchanged CA graph] in ``traced.py``).

Anything without a stable description (an object known only by its address, a tensor's
values) gets this process's nonce in its key: the entry is written and reused in-process but
misses in every other process.  Our key lines replace torch's only for the objects above;
every other global keeps torch's import line.  The allowlist is passed per compile through
``torch.compile(options=...)`` (an inductor config patch that is itself part of the key),
naming just the targets of that graph, so it does not depend on what else the process did.
Only the ``inductor`` backend without ``mode=`` takes ``options``; any other backend has no
AOTAutogradCache and compiles as before.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch

from .. import _compat
from ..config import Config
from .keys import behaviour_keyed, global_kind, key_of
from .outside import key_for_save

__all__ = [
    "key_of", "compile_kwargs", "cacheable_names", "cache_global_swap",
    "remember_forward", "complete_forward_entries",
]

_forwards: weakref.WeakSet[Any] = weakref.WeakSet()
_forwards_lock = threading.Lock()


def cache_global_swap() -> Any:
    """The resident swap of AOTAutogradCache's key line per global (acting only for :func:`key_of`'s objects)."""
    return _compat.cache_global_swap(key_of)


def cacheable_names(graph_module: torch.fx.GraphModule) -> list[str]:
    """The graph's call targets we can describe, as AOTAutogradCache's allowlist names them."""
    names = set()
    for node in graph_module.graph.nodes:
        if node.op != "call_function":
            continue
        name = f"{getattr(node.target, '__module__', None)}.{getattr(node.target, '__name__', None)}"
        if global_kind(node.target) is not None:  # the keys themselves are built once, when torch pickles the graph
            names.add(name)
        names.update(f"{_compat.CA_OPS_MODULE}.{op}" for op in _compat.INLINED_CA_OPS.get(name, ()))
    return sorted(names)


def compile_kwargs(graph_module: torch.fx.GraphModule, config: Config) -> Mapping[str, Any]:
    """``torch.compile`` keywords for one CA graph (or split piece): the user's, plus our allowlist for inductor.

    The allowlist only admits the graph to AOTAutogradCache; its key is what the graph computes,
    appended by ``keys.aot_key_extension`` (Note [Keys by behaviour]), so a torch without
    that hook admits nothing.  ``cache=False`` (``enable(cache=False)``) keeps the graph out, as stock does
    (``Config.persistent_caches``).
    """
    kwargs = config.compile_kwargs
    if not config.persistent_caches or not _compat.marked_cacheable_supported():
        return kwargs
    if not _compat.aot_key_swap_supported():
        return kwargs
    names = cacheable_names(graph_module)
    if not names:
        return kwargs
    options = dict(kwargs.get("options") or {})
    marked = {**_compat.marked_cacheable_functions(), **options.get(_compat.MARKED_CACHEABLE_OPTION, {})}
    marked.update({name: "subclass_ca" for name in names if name not in marked})
    options[_compat.MARKED_CACHEABLE_OPTION] = marked
    return {**kwargs, "options": options}


def remember_forward(ctx: Any) -> None:
    """Remember the AOT function of a captured backward node (its forward entry may still be unwritten)."""
    forward_cls = _compat.aot_forward_class(ctx)
    if forward_cls is not None and forward_cls not in _forwards:
        with _forwards_lock:
            _forwards.add(forward_cls)


def _admitted(forward_cls: Any) -> bool:
    """Whether a forward's entry may cross processes: torch's key describes it, or it got its behaviour key."""
    if not _compat.forward_has_subclass_inputs(forward_cls):
        return True
    return behaviour_keyed(_compat.forward_cache_key(forward_cls))


def complete_forward_entries() -> int:
    """Compile the pending backwards of remembered AOT functions, writing their forwards' cache entries; returns how many.

    Only forwards whose key describes what they compute (Note [Keys by behaviour]), those compiled outside a block
    given theirs now (Note [Forwards compiled outside a block] in ``outside.py``); the others are traced again by a
    restarted process.
    """
    with _forwards_lock:
        forwards = list(_forwards)
    for forward_cls in forwards:
        if not _admitted(forward_cls):
            key_for_save(forward_cls)  # compiled outside a block: keyed by behaviour now, if it can be
    found = [_compat.pending_forward_entry(f) for f in forwards if _admitted(f)]
    pending = [p for p in found if p is not None]
    for compile_backward in pending:
        compile_backward()
    return len(pending)

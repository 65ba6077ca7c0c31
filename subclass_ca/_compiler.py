"""The compiler compiled autograd calls with each captured graph, and one of it per configuration.

Equal settings share one validated :class:`Config`, one :class:`CACompiler` and one cache token
(:class:`Settings`, Note [Interned settings] in ``api.py``); the token keeps CA caches of different
settings apart (Note [Keeping CA caches apart] in ``_compat/compiled_autograd.py``).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import _compat, diagnostics
from ._accumulate import steal_subclass_accumulates
from ._canonical import canonical_form
from ._graph import CompiledCAGraph
from ._hook_order import order_hooks_after_reads
from ._nodes import mode_of, subclass_nodes
from .config import Config, cache_key, followed

__all__ = ["CACompiler", "cache_token", "Settings", "settings_for"]

# Note [Static-first CA graphs]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# Compiled autograd keys its cache on the autograd graph's structure and keeps, per cached graph,
# the sizes it was captured with (each tensor size, each SymInt of a node's saved state).  With
# torch's ``dynamic=True`` every one of them enters the first CA graph as a symbol, so the CA graph
# and the AOT backwards pasted into it are compiled for symbolic shapes even when a model only ever
# sees one shape: inductor's kernels are generic, and the graph carries the symbols' guards and
# size arithmetic at every step.  With ``dynamic=False`` compiled autograd starts static and, when a
# size it specialised on changes, marks *that* size dynamic and recaptures once; later values of it
# hit the cache (its ``check_dynamic_sizes``).  That is Dynamo's own automatic-dynamic rule, and it is
# our default (``Config.dynamic=None``): a fixed-shape training loop gets a static graph, a
# variable-length one pays one recapture per forward graph, never one per length.
# ``dynamic=True`` keeps torch's all-symbolic first capture (one capture fewer when every step has
# a new length); ``dynamic=False`` also compiles the CA graph with ``torch.compile(dynamic=False)``,
# so that Dynamo specialises the sizes compiled autograd made dynamic: one compile per distinct size,
# never a symbolic kernel.  The setting is part of the cache token, so blocks of different settings
# never share a CA graph that holds a compiled region (the token reaches torch's key through it).


class CACompiler:
    """The ``compiler_fn`` compiled autograd calls with each captured graph; it carries the settings.

    ``compile_graph`` compiles the graph instead of ``torch.compile(backend=config.backend)``:
    Dynamo's own compiler for a ``torch.compile``-d train step (flag style, see
    :func:`_adopt_flag_style_compiler`), or, with ``raw=True``, a test's or benchmark's function
    that must see the raw CA graph (no compiled-graph wrapper, no scoped workarounds).
    """

    def __init__(
        self,
        config: Config,
        compile_graph: Callable[[torch.fx.GraphModule], Any] | None = None,
        *,
        raw: bool = False,
    ) -> None:
        self.subclass_ca_config = config
        self._compile_graph = compile_graph
        self._raw = raw
        self._factory: Any = None

    @property
    def factory(self) -> Any:
        """What C++ autograd is handed while this compiler is active (built once, not per block)."""
        if self._factory is None:
            self._factory = _compat.compiler_factory(self)
        return self._factory

    def _capture(self, graph_module: torch.fx.GraphModule) -> Any:
        if self._raw:  # Note [Hooks run after every read of the tensor they are given]; ours: on the first run
            order_hooks_after_reads(graph_module)
        # Note [Subclass gradients and AccumulateGrad]; the graph's code is generated once for both rewrites
        stolen = steal_subclass_accumulates(graph_module, recompile=self._raw)
        # Note [One CA graph for fresh and cached forwards]; a caller's own compiler sees the graph as torch gave it
        if not self._raw and not canonical_form(graph_module) and stolen:
            graph_module.recompile()
        nodes = subclass_nodes(graph_module.graph)
        config = followed(self.subclass_ca_config, diagnostics.forward_backends())  # Note [Defaults follow the user]
        fullgraph = config.fullgraph and not any(mode_of(node) == "opaque" for node in nodes)
        report = diagnostics.finish_capture(
            graph_nodes=len(graph_module.graph.nodes),
            fullgraph=fullgraph,
            ca_counters=_compat.ca_counters(),
            graph_code=graph_module.code,
            backend=config.backend,
        )
        if config.report:
            diagnostics.logger.warning("%s", report.summary())
        if self._raw and self._compile_graph is not None:
            return self._compile_graph(graph_module)
        return CompiledCAGraph(graph_module, config, fullgraph, report, self._compile_graph)

    # Note [Capture code is never traced] (_compat/compiled_autograd.py)
    __call__ = _compat.dynamo_disable(_capture)


# --- cache tokens (Note [Keeping CA caches apart] in _compat/compiled_autograd.py) -----

_cache_tokens: dict[tuple[Any, ...], int] = {}
_cache_tokens_lock = threading.Lock()


def cache_token(config: Config, *, raw: bool = False) -> int:
    """A small int per distinct configuration: CA graphs are cached separately per token.

    ``raw``: for :func:`capture_with`, whose graphs go to a caller's compiler instead of ours.
    """
    key = (*cache_key(config), raw)
    with _cache_tokens_lock:
        token = _cache_tokens.get(key)
        if token is None:
            token = _cache_tokens[key] = len(_cache_tokens)
        return token


# --- one compiler per configuration (Note [Interned settings] in api.py) ----------


class Settings:
    """One validated configuration with its compiler and cache token, shared by equal ``enable()`` calls."""

    __slots__ = ("config", "compiler", "token")

    def __init__(self, config: Config) -> None:
        self.config = config
        self.compiler = CACompiler(config)
        """Shared, so its ``factory`` is built once per configuration, not once per ``enable()``."""
        self.token = cache_token(config)


_settings: dict[tuple[Any, ...], Settings] = {}
_settings_lock = threading.Lock()


def settings_for(config: Config) -> Settings:
    """The :class:`Settings` of every configuration equal to ``config`` (the first one seen is kept).

    Equal means equal cache keys (:func:`cache_token`: compile kwargs compared by ``repr``) and
    the same ``report``, which is not part of the cache key but is read by the compiler.  The
    interned ``Config`` holds its own copy of ``compile_kwargs``.
    """
    key = (*cache_key(config), config.report)
    found = _settings.get(key)
    if found is None:
        with _settings_lock:
            found = _settings.get(key)
            if found is None:
                interned = dataclasses.replace(config, compile_kwargs=dict(config.compile_kwargs))
                found = _settings[key] = Settings(interned)
    return found

"""``enable()``: run ``backward()`` through compiled autograd with our epilogue proxy."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import _capture, _compat, _fsdp2, diagnostics
from .config import Config
from .errors import UnsupportedSubclassError

__all__ = ["enable", "reset"]


def _check_backend(backend: Any) -> None:
    if isinstance(backend, str):
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"enable(backend=...): unknown backend {backend!r}; allowed values are {sorted(known)} or a callable")


class _CompiledCAGraph:
    """The compiled CA graph, with one recovery path when compiling our rebuild nodes fails.

    If the first call fails *while compiling* (fullgraph: nothing has run yet) and the error
    was raised inside one of our rebuilds, ``on_unsupported="error"`` raises
    UnsupportedSubclassError naming the subclass types (no gradient produced), and
    ``"eager"`` recompiles the graph with those nodes opaque (one warning per subclass).
    """

    def __init__(
        self, graph_module: torch.fx.GraphModule, config: Config, fullgraph: bool, report: diagnostics.CaptureReport
    ) -> None:
        self._graph_module = graph_module
        self._config = config
        self._report = report
        self._compiled = self._compile(fullgraph)
        self._checked = not fullgraph or not _capture.subclass_node_targets(graph_module.graph)
        self._graph_breaks_allowed = not fullgraph

    def _compile(self, fullgraph: bool) -> Any:
        config = self._config
        return torch.compile(self._graph_module, backend=config.backend, fullgraph=fullgraph, **config.compile_kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Note [FSDP2 under compiled autograd] in _fsdp2.py: detect FSDP2 hooks before the graph
        # runs, run the engine final callbacks eager hooks queue, check FSDP2 finished its backward.
        fsdp2_states = _fsdp2.prepare(self, args)
        if not self._graph_breaks_allowed:  # fullgraph: no eager code in the graph can queue a callback
            return self._run(*args, **kwargs)
        with _fsdp2.final_callbacks():
            result = self._run(*args, **kwargs)
        _fsdp2.check_finished(fsdp2_states)
        return result

    def allow_graph_breaks(self, reason: str) -> None:
        """Compile with graph breaks (fullgraph=False) from now on; the capture report records why."""
        if self._graph_breaks_allowed:
            return
        self._graph_breaks_allowed = True
        self._compiled = self._compile(False)
        self._checked = True
        self._report.fullgraph = False
        self._report.fallbacks.append(reason)

    def _run(self, *args: Any, **kwargs: Any) -> Any:
        diagnostics.record_run(self._report)
        if self._checked:
            return self._compiled(*args, **kwargs)
        try:
            result = self._compiled(*args, **kwargs)
        except Exception as error:
            if not _compat.is_compile_failure(error):
                raise
            return self._recover(error, args, kwargs)
        self._checked = True
        return result

    def _recover(self, error: Exception, args: Any, kwargs: Any) -> Any:
        if not _capture.raised_in_rebuild(error):
            raise error
        names = sorted({node.target._subclass_ca_type.__qualname__ for node in _capture.subclass_node_targets(self._graph_module.graph)})
        if self._config.on_unsupported != "eager":
            raise UnsupportedSubclassError(
                f"compiling the compiled-autograd graph failed inside the rebuild of {names} "
                f"({type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}). "
                "No gradient was produced. Register a handler with a trace-safe rebuild, register it with "
                "mode='opaque', or pass enable(on_unsupported='eager') to rebuild eagerly."
            ) from error
        _capture.retarget_to_opaque(self._graph_module)
        self._compiled = self._compile(False)
        self._checked = True
        self._report.fullgraph = False
        for name in names:
            reason = f"{name}: rebuild could not be compiled ({type(error).__name__}); rebuilt eagerly (opaque)"
            self._report.fallbacks.append(reason)
            _capture.warn_fallback_once(name, reason)
        return self._compiled(*args, **kwargs)


def _make_compiler_fn(config: Config) -> Callable[[torch.fx.GraphModule], Any]:
    def compile_ca_graph(graph_module: torch.fx.GraphModule) -> Any:
        _capture.steal_subclass_accumulates(graph_module)  # Note [Subclass gradients and AccumulateGrad]
        nodes = _capture.subclass_node_targets(graph_module.graph)
        fullgraph = not any(node.target._subclass_ca_mode == "opaque" for node in nodes)
        report = diagnostics.finish_capture(
            graph_nodes=len(graph_module.graph.nodes),
            fullgraph=fullgraph,
            ca_counters=_compat.ca_counters(),
            graph_code=graph_module.code,
        )
        if config.report:
            diagnostics.logger.warning("%s", report.summary())
        return _CompiledCAGraph(graph_module, config, fullgraph, report)

    return compile_ca_graph


_cache_tokens: dict[Any, int] = {}
_cache_tokens_lock = threading.Lock()


def _cache_token(config: Config) -> int:
    """A small int per distinct configuration: CA graphs are cached separately per token.

    Note [Keeping CA caches apart]: compiled autograd's cache is global and not keyed by the
    compiler; ``_compat.cache_key_token`` folds this token into AOT backward nodes' cache keys,
    so a graph captured by stock CA or under other settings is never reused by this block.
    """
    key = _cache_key(config)
    with _cache_tokens_lock:
        for known, token in _cache_tokens.items():
            if known == key:
                return token
        token = _cache_tokens[key] = len(_cache_tokens)  # type: ignore[index]
        return token


def _cache_key(config: Config) -> tuple[Any, ...]:
    return (
        config.backend,
        repr(sorted(config.compile_kwargs.items())),
        config.dynamic,
        config.strict,
        config.on_unsupported,
    )


class enable(contextlib.ContextDecorator):
    """Capture ``backward()`` with compiled autograd, rebuilding subclasses through our proxy.

    Use as ``with subclass_ca.enable(): loss.backward()`` or as a decorator on a training
    step.  ``backend`` is anything ``torch.compile(backend=...)`` accepts; the CA graph is
    compiled as ``torch.compile(ca_graph, backend=backend, fullgraph=True, **compile_kwargs)``.
    Every torch setting and patched attribute is restored on exit (also on an exception);
    blocks nest.  See ``Config`` for the keyword options.
    """

    def __init__(
        self,
        backend: str | Callable[..., Any] = "aot_eager",
        *,
        dynamic: bool = True,
        strict: bool = False,
        on_unsupported: str = "error",
        report: bool = False,
        **compile_kwargs: Any,
    ) -> None:
        self.config = Config(
            backend=backend,
            compile_kwargs=compile_kwargs,
            dynamic=dynamic,
            strict=strict,
            on_unsupported=on_unsupported,
            report=report,
        )
        _check_backend(backend)
        self._exit_stacks = threading.local()

    def _stacks(self) -> list[contextlib.ExitStack]:
        stacks = getattr(self._exit_stacks, "stacks", None)
        if stacks is None:
            stacks = self._exit_stacks.stacks = []
        return stacks

    def __enter__(self) -> enable:
        _compat.require_support()
        stack = contextlib.ExitStack()
        try:
            _capture.install(strict=self.config.strict, on_unsupported=self.config.on_unsupported)
            stack.callback(_capture.uninstall)
            stack.enter_context(_compat.installed_workarounds())
            stack.enter_context(_compat.swapped_trace_wrapped(_capture.subclass_trace_wrapped))
            stack.enter_context(
                _compat.enable_compiled_autograd(_make_compiler_fn(self.config), dynamic=self.config.dynamic)
            )
            stack.enter_context(diagnostics.cache_miss_logging())
            stack.enter_context(_compat.cache_key_token(_cache_token(self.config)))
        except BaseException:
            stack.close()
            raise
        self._stacks().append(stack)
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        return bool(self._stacks().pop().__exit__(*exc_info))


def reset() -> None:
    """Forget compiled graphs (Dynamo and compiled autograd caches): the next backward recaptures."""
    torch._dynamo.reset()
    _compat.reset_compiled_autograd()

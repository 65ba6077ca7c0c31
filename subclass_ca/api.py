"""``enable()``: run ``backward()`` through compiled autograd with our epilogue proxy."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import Any

import torch

from . import _capture, _compat, diagnostics
from .config import Config

__all__ = ["enable", "reset"]


def _check_backend(backend: Any) -> None:
    if isinstance(backend, str):
        known = torch._dynamo.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"enable(backend=...): unknown backend {backend!r}; allowed values are {sorted(known)} or a callable")


def _make_compiler_fn(config: Config) -> Callable[[torch.fx.GraphModule], Any]:
    def compile_ca_graph(graph_module: torch.fx.GraphModule) -> Any:
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
        return torch.compile(graph_module, backend=config.backend, fullgraph=fullgraph, **config.compile_kwargs)

    return compile_ca_graph


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
            stack.enter_context(
                _compat.enable_compiled_autograd(_make_compiler_fn(self.config), dynamic=self.config.dynamic)
            )
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

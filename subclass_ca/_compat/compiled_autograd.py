"""torch's compiled autograd: turning it on, its cache, counters, logger and AOT-backward hook point."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from ._lookup import lookup
from ._patch import AttributeSwap, CallSwap
from .dynamo import dynamo_disable

__all__ = [
    "CA_MODULE",
    "COMPILER_INSTANCE",
    "AOT_BACKWARD_PARAMS",
    "enable_compiled_autograd",
    "ca_enable_swap",
    "compiled_autograd_state",
    "autograd_compiler",
    "reset_compiled_autograd",
    "clear_compiled_autograd_cache",
    "capture_watch_swaps",
    "ca_counters",
    "ca_verbose_log",
    "verbose_logger_swap",
    "stock_ca_compiler",
    "is_stock_make_subclass",
    "compiler_fn_of",
    "aot_backward_swap",
    "cache_key_swap",
    "call_accumulate_grad",
]

CA_MODULE = "torch._dynamo.compiled_autograd"
COMPILER_INSTANCE = "torch._dynamo.compiled_autograd:AutogradCompilerInstance"
AOT_BACKWARD_PARAMS = ("pinputs", "psaved_tensors", "saved_tensors", "pctx", "ctx")
AUTOGRAD_FUNCTION_CTX = "torch.autograd.function:BackwardCFunction"
_C_CA = "torch._C:_dynamo.compiled_autograd"


def enable_compiled_autograd(compiler_fn: Callable[..., Any], *, dynamic: bool = True) -> Any:
    """torch's own context manager that routes ``backward()`` through compiled autograd."""
    return lookup(CA_MODULE + ":_enable")(compiler_fn, dynamic=dynamic)


def ca_enable_swap(adopt: Callable[[Any], Any]) -> AttributeSwap:
    """``compiled_autograd._enable`` with its ``compiler_fn`` passed through ``adopt`` first.

    It is what Dynamo enters around each call of a ``torch.compile``-d function when
    ``torch._dynamo.config.compiled_autograd`` is set (``adopt`` leaves our own compilers alone).
    """

    def make(original: Any) -> Any:
        @functools.wraps(original)
        def _enable(compiler_fn: Any, *args: Any, **kwargs: Any) -> Any:
            return original(adopt(compiler_fn), *args, **kwargs)

        _enable.__subclass_ca_original__ = original  # type: ignore[attr-defined]
        return _enable

    return AttributeSwap(lambda: lookup(CA_MODULE), "_enable", make, own_only=False)


def compiled_autograd_state() -> dict[str, Any]:
    """Module-level compiled-autograd flags, for exact save/restore checks."""
    ca = lookup(CA_MODULE)
    return {
        name: getattr(ca, name)
        for name in ("compiled_autograd_enabled", "in_compiled_autograd_region", "depth")
        if hasattr(ca, name)
    }


def autograd_compiler() -> Any:
    """The compiler C++ autograd currently holds (read by setting and restoring it)."""
    setter = lookup(_C_CA + ".set_autograd_compiler")
    prior = setter(None, False)
    setter(*prior)
    return prior


def clear_compiled_autograd_cache() -> None:
    """Drop compiled autograd's graph cache only (keeps the installed compiler and counters)."""
    lookup(_C_CA + ".clear_cache")()


_CAPTURING = "_subclass_ca_capturing"


def capture_watch_swaps(on_abandoned: Callable[[], None]) -> list[AttributeSwap]:
    """Call ``on_abandoned()`` for every compiled-autograd capture that fails.

    A capture is *abandoned* when ``begin_capture`` ran but ``end_capture`` never returned:
    torch refused to trace (double backward through a compiled region), a rebuild of ours
    raised, a hook failed...  torch calls ``close()`` on the compiler instance on success and
    on failure (C++ ``ClosingTHPObjectPtr``); ``close`` is an instance attribute, so it is
    wrapped per instance in ``begin_capture``.  ``on_abandoned`` must not raise.  See Note
    [Failed captures and the verbose logger] in ``diagnostics.py``.
    """

    def make_begin(original: Any) -> Any:
        @functools.wraps(original)
        def begin_capture(self: Any, *args: Any, **kwargs: Any) -> Any:
            close = getattr(self, "close", None)
            if close is not None:
                setattr(self, _CAPTURING, True)

                def close_and_report() -> Any:
                    try:
                        return close()
                    finally:
                        if self.__dict__.pop(_CAPTURING, False):
                            on_abandoned()

                self.close = close_and_report
            return original(self, *args, **kwargs)

        return dynamo_disable(begin_capture)  # Note [Capture code is never traced]

    def make_end(original: Any) -> Any:
        @functools.wraps(original)
        def end_capture(self: Any, *args: Any, **kwargs: Any) -> Any:
            result = original(self, *args, **kwargs)
            self.__dict__.pop(_CAPTURING, None)  # reached only when the capture succeeded
            return result

        return dynamo_disable(end_capture)  # Note [Capture code is never traced]

    locate = lambda: lookup(COMPILER_INSTANCE)  # noqa: E731
    return [AttributeSwap(locate, "begin_capture", make_begin), AttributeSwap(locate, "end_capture", make_end)]


def reset_compiled_autograd() -> None:
    """Drop compiled autograd's graph cache (forces the next backward to recapture)."""
    lookup(CA_MODULE).reset()


def ca_counters() -> dict[str, int]:
    return dict(lookup("torch._dynamo.utils:counters")["compiled_autograd"])


def ca_verbose_log() -> Any:
    """torch's own verbose compiled-autograd logger when the user enabled it (TORCH_LOGS), else None."""
    ca = lookup(CA_MODULE)
    enabled = getattr(ca, "snapshot_verbose_logging_enabled", None)
    if enabled is None or not enabled():
        return None
    return getattr(ca, "verbose_log", None)


def verbose_logger_swap(make: Callable[[Any], Any]) -> CallSwap:
    """Compiled autograd's C++ verbose logger (where torch says *why* a backward missed its cache)."""
    return CallSwap(
        get=ca_verbose_log,
        set=lookup(_C_CA + ".set_verbose_logger"),
        make=make,
        label="torch._C._dynamo.compiled_autograd.set_verbose_logger",
    )


def stock_ca_compiler(backend: Any, **compile_kwargs: Any) -> Callable[..., Any]:
    """The compiler_fn torch documents: ``lambda gm: torch.compile(gm, backend=..., fullgraph=True)``."""
    return lambda gm: torch.compile(gm, backend=backend, fullgraph=True, **compile_kwargs)


def is_stock_make_subclass(target: Any) -> bool:
    """True for the anonymous ``make_subclass`` closure stock CA emits per epilogue call."""
    return getattr(target, "__name__", None) == "make_subclass" and getattr(target, "__module__", None) == CA_MODULE


def compiler_fn_of(compiler: Any) -> Any:
    """The ``compiler_fn`` a compiled-autograd capture (an AutogradCompilerInstance) will call."""
    return getattr(compiler, "compiler_fn", None)


def aot_backward_swap(wrapper: Callable[..., Any]) -> AttributeSwap:
    """``AutogradCompilerInstance.proxy_call_aot_backward`` routed through ``wrapper(compiler, ctx, call)``.

    ``call`` runs torch's original with the same arguments; ``ctx`` is the autograd ctx of
    the AOT backward node.
    """

    def make(original: Any) -> Any:
        signature = inspect.signature(original)

        @functools.wraps(original)
        def proxy_call_aot_backward(compiler: Any, *args: Any, **kwargs: Any) -> Any:
            bound = signature.bind(compiler, *args, **kwargs)
            return wrapper(compiler, bound.arguments["ctx"], lambda: original(compiler, *args, **kwargs))

        # Note [Capture code is never traced]: inside a torch.compile-d train step that calls
        # backward(), Dynamo's frame callback is still active while compiled autograd captures, so
        # it would compile our capture-time Python as user frames, with guards that can reuse one
        # subclass output's argument slice for the next one.  Every entry point torch calls into
        # during a capture is therefore dynamo.disable-d.
        disabled = dynamo_disable(proxy_call_aot_backward)
        disabled.__subclass_ca_original__ = original  # type: ignore[attr-defined]
        return disabled

    return AttributeSwap(lambda: lookup(COMPILER_INSTANCE), "proxy_call_aot_backward", make)


_CACHE_KEY_MARK = 0x5CA  # "subclass_ca" marker ahead of our token in an autograd function's CA key


def cache_key_swap(current_token: Callable[[], int | None]) -> AttributeSwap:
    """Fold ``current_token()`` into every custom autograd function's compiled-autograd cache key.

    Note [Keeping CA caches apart]: compiled autograd's graph cache is process-global and
    not keyed by the compiler, so a graph captured by stock CA (or under other settings)
    would otherwise be reused.  AOT backward nodes contribute ``ctx._compiled_autograd_key()``
    to the cache key; only its leading id is a static key (the rest are lifted as symints),
    so the token is hashed into it (62 bits fit C++'s ssize_t).  ``None``: torch's own key.
    """

    def make(original: Any) -> Any:
        def _compiled_autograd_key(ctx: Any) -> Any:
            key = original(ctx)
            token = current_token()
            if token is None:
                return key
            function_id, *rest = key
            return (hash((function_id, _CACHE_KEY_MARK, token)) & ((1 << 62) - 1), *rest)

        return _compiled_autograd_key

    return AttributeSwap(lambda: lookup(AUTOGRAD_FUNCTION_CTX), "_compiled_autograd_key", make)


def call_accumulate_grad() -> Callable[..., Any]:
    """The function compiled autograd's AccumulateGrad nodes call (``external_utils.call_accumulate_grad``)."""
    return lookup("torch._dynamo.external_utils:call_accumulate_grad")

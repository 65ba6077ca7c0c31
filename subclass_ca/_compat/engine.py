"""The autograd engine's final callbacks (Note [FSDP2 under compiled autograd] in ``_fsdp2.py``)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ._patch import AttributeSwap, PatchSet

__all__ = ["final_callback_redirect_problem", "collect_engine_callbacks", "execution_engine", "ENGINE_CALLBACKS"]

_local = threading.local()
_collecting_engine: Any = None


def final_callback_redirect_problem() -> str | None:
    """Why engine final callbacks cannot be redirected on this torch (None: they can)."""
    holder = getattr(torch.autograd, "Variable", None)
    engine = getattr(holder, "_execution_engine", None)
    if engine is None or not callable(getattr(engine, "queue_callback", None)):
        return "torch.autograd.Variable._execution_engine.queue_callback is missing"
    try:
        type("_Probe", (type(engine),), {})
    except TypeError as error:
        return f"the autograd engine type {type(engine).__qualname__} cannot be subclassed ({error})"
    return None


def _engine_with_sink(original: Any) -> Any:
    """One process-wide engine object that behaves as torch's, except ``queue_callback``.

    It subclasses torch's engine type (so Dynamo still recognises it) and routes
    ``queue_callback`` to the calling thread's sink while one is active.
    """
    global _collecting_engine
    if _collecting_engine is None:
        base = type(original)

        def queue_callback(self: Any, callback: Callable[[], None]) -> None:
            sinks = getattr(_local, "sinks", None)
            if sinks:
                sinks[-1].append(callback)
                return
            base.queue_callback(self, callback)

        cls = type("SubclassCACollectingEngine", (base,), {"queue_callback": queue_callback, "__module__": __name__})
        _collecting_engine = cls()
    return _collecting_engine


ENGINE_CALLBACKS = PatchSet(
    "engine final-callback redirect",
    lambda: [AttributeSwap(lambda: torch.autograd.Variable, "_execution_engine", _engine_with_sink, own_only=False)],
)


@contextlib.contextmanager
def collect_engine_callbacks(sink: list[Callable[[], None]]) -> Iterator[None]:
    """While active on this thread, ``Variable._execution_engine.queue_callback(cb)`` appends to ``sink``.

    torch 2.13's engine never runs final callbacks queued by eager code (hooks that
    Dynamo graph-breaks on) while a compiled-autograd graph runs; the caller runs them.
    """
    sinks = getattr(_local, "sinks", None)
    if sinks is None:
        sinks = _local.sinks = []
    with ENGINE_CALLBACKS.applied():
        sinks.append(sink)
        try:
            yield
        finally:
            sinks.pop()


def execution_engine() -> Any:
    """The object ``torch.autograd.Variable._execution_engine`` currently holds."""
    return torch.autograd.Variable._execution_engine

"""The handler registry: register, unregister and look up handlers by MRO.

Thread-safe; registering the same class twice raises unless ``replace=True``; the
public view (:func:`handlers`) is read-only.  A capture binds the handler it looked up
into its graph node, so registering while a capture runs cannot change that capture.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import torch

from . import _compat
from ._handler import (
    MODES,
    Handler,
    MetadataKeyFn,
    Mode,
    RebuildFn,
    check_callable_arity,
    default_handler,
    inherited_handler,
    unflatten_rebuild,
    whole_context_key,
)
from .errors import DuplicateHandlerError, RegistrationError

__all__ = ["register_handler", "handler", "unregister_handler", "get_handler", "handlers"]

_lock = threading.RLock()
_handlers: dict[type, Handler] = {}
_defaults: dict[type, Handler] = {}
_inherited: dict[type, Handler] = {}
"""Handlers derived for subclasses of registered classes; recomputed when the registration changes."""
_deferred: dict[str, Callable[[], Any]] = {}

_C = TypeVar("_C", bound=type)

_REBUILD_SIGNATURE = "rebuild(inner_tensors: dict, ctx, outer_size, outer_stride) -> Tensor"


def _validate_class(cls: Any) -> None:
    if not isinstance(cls, type) or not issubclass(cls, torch.Tensor):
        raise RegistrationError(
            f"register_handler expects a torch.Tensor subclass, got {cls!r}. "
            "Pass the wrapper subclass type itself (e.g. register_handler(MyTensor))."
        )
    if cls is torch.Tensor or cls is torch.nn.Parameter:
        raise RegistrationError(f"{cls.__qualname__} is not a wrapper subclass; register your subclass type instead.")
    missing = [name for name in ("__tensor_flatten__", "__tensor_unflatten__") if not hasattr(cls, name)]
    if missing:
        raise RegistrationError(
            f"{cls.__qualname__} lacks {' and '.join(missing)}: subclass_ca rebuilds subclasses through the "
            "traceable wrapper subclass protocol. Define __tensor_flatten__ (returning inner attribute names and a "
            "constant context) and __tensor_unflatten__(inner, ctx, outer_size, outer_stride)."
        )


def register_handler(
    cls: type,
    *,
    rebuild: RebuildFn | None = None,
    metadata_key: MetadataKeyFn | None = None,
    mode: Mode = "proxy",
    replace: bool = False,
) -> Handler:
    """Register how ``cls`` (and its subclasses) are rebuilt in the CA graph; returns the handler."""
    _validate_class(cls)
    if mode not in MODES:
        raise RegistrationError(
            f"unknown mode {mode!r} for {cls.__qualname__}; allowed values are {MODES}."
        )
    if rebuild is not None:
        check_callable_arity(rebuild, 4, what="rebuild", cls=cls, expected=_REBUILD_SIGNATURE)
    if metadata_key is not None:
        check_callable_arity(metadata_key, 1, what="metadata_key", cls=cls, expected="metadata_key(ctx) -> hashable")
    new = Handler(
        cls=cls,
        rebuild=rebuild if rebuild is not None else unflatten_rebuild(cls),
        metadata_key=metadata_key if metadata_key is not None else whole_context_key,
        mode=mode,
    )
    with _lock:
        existing = _handlers.get(cls)
        if existing is not None and not replace:
            raise DuplicateHandlerError(
                f"a handler for {cls.__module__}.{cls.__qualname__} is already registered ({existing.mode} mode). "
                "Pass replace=True to override it, or unregister_handler() first."
            )
        _handlers[cls] = new
        _inherited.clear()
    return new


def handler(
    cls: type,
    *,
    metadata_key: MetadataKeyFn | None = None,
    mode: Mode = "proxy",
    replace: bool = False,
) -> Callable[[RebuildFn], RebuildFn]:
    """Decorator form: ``@handler(MyTensor)`` over a ``rebuild`` function registers it."""

    def decorate(rebuild: RebuildFn) -> RebuildFn:
        register_handler(cls, rebuild=rebuild, metadata_key=metadata_key, mode=mode, replace=replace)
        return rebuild

    return decorate


def unregister_handler(cls: type) -> Handler:
    """Remove the handler registered for exactly ``cls``; returns it."""
    with _lock:
        try:
            _inherited.clear()
            return _handlers.pop(cls)
        except KeyError:
            raise KeyError(
                f"no handler is registered for {getattr(cls, '__qualname__', cls)!r}; "
                f"registered: {sorted(c.__qualname__ for c in _handlers)}"
            ) from None


def defer_registration(qualified_name: str, register: Callable[[], Any]) -> None:
    """Run ``register()`` the first time a class named ``module.QualName`` is looked up.

    Lets optional built-ins (torchao) register without importing their library.
    """
    with _lock:
        _deferred[qualified_name] = register


def _run_deferred(cls: type) -> None:
    for base in getattr(cls, "__mro__", (cls,)):
        register = _deferred.pop(f"{base.__module__}.{base.__qualname__}", None)
        if register is not None:
            register()


def get_handler(cls: type) -> Handler:
    """The handler for ``cls``: the nearest registration along its MRO, else the protocol default."""
    with _lock:
        if _deferred:
            _run_deferred(cls)
        for base in getattr(cls, "__mro__", (cls,)):
            found = _handlers.get(base)
            if found is not None:
                if base is cls:
                    return found
                inherited = _inherited.get(cls)
                if inherited is None or inherited.inherited_from is not base or inherited.mode != found.mode:
                    inherited = _inherited[cls] = inherited_handler(found, cls)
                return inherited
        fallback = _defaults.get(cls)
        if fallback is None:
            if not _compat.is_traceable_wrapper_subclass_type(cls):
                _validate_class(cls)
            fallback = _defaults[cls] = default_handler(cls)
        return fallback


def handlers() -> Mapping[type, Handler]:
    """A read-only snapshot of the registered handlers (defaults not included)."""
    with _lock:
        return types.MappingProxyType(dict(_handlers))

"""What a handler is: how one wrapper-subclass type is rebuilt inside the CA graph.

A subclass with a standard ``__tensor_flatten__``/``__tensor_unflatten__`` needs no
handler code at all: :func:`default_handler` rebuilds it through the protocol.  A custom
handler says only what differs (``rebuild``, ``metadata_key`` or ``mode``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from .errors import RegistrationError

__all__ = [
    "Handler",
    "Mode",
    "MODES",
    "RebuildFn",
    "MetadataKeyFn",
    "default_handler",
    "inherited_handler",
    "same_flatten_protocol",
]

Mode = Literal["proxy", "inline", "opaque"]
#: proxy: one named allow_in_graph node per rebuild (default) ·
#: inline: Dynamo traces the rebuild (trace-safe constructors) ·
#: opaque: the rebuild runs eagerly at run time, never traced (a graph break).
MODES: tuple[str, ...] = ("proxy", "inline", "opaque")

RebuildFn = Callable[[dict[str, Any], Any, Sequence[Any], Sequence[Any]], torch.Tensor]
MetadataKeyFn = Callable[[Any], Hashable]


def unflatten_rebuild(cls: type) -> RebuildFn:
    """The protocol rebuild: ``cls.__tensor_unflatten__(inner, ctx, outer_size, outer_stride)``."""

    def rebuild(inner: dict[str, Any], ctx: Any, outer_size: Sequence[Any], outer_stride: Sequence[Any]) -> torch.Tensor:
        rebuilt: torch.Tensor = cls.__tensor_unflatten__(inner, ctx, outer_size, outer_stride)  # type: ignore[attr-defined]
        return rebuilt

    rebuild.__name__ = f"{cls.__name__}.__tensor_unflatten__"
    return rebuild


def whole_context_key(ctx: Any) -> Any:
    """Default metadata key: the whole flatten context identifies the graph."""
    return ctx


@dataclass(frozen=True, kw_only=True)
class Handler:
    """How subclass_ca rebuilds instances of ``cls`` in the compiled-autograd graph."""

    cls: type
    """The wrapper tensor subclass this handler serves (and its subclasses, by MRO)."""
    rebuild: RebuildFn
    """``rebuild(inner_tensors, ctx, outer_size, outer_stride) -> Tensor``."""
    metadata_key: MetadataKeyFn = whole_context_key
    """Which part of the constant flatten context identifies a graph; must cover every
    part that changes the rebuilt tensor (a different key always gets a new graph node)."""
    mode: Mode = "proxy"
    """How the rebuild lands in the graph; one of :data:`MODES`."""
    is_default: bool = field(default=False)
    """True for the protocol fallback used when nothing is registered."""
    inherited_from: type | None = None
    """The registered base class whose handler this is, for a subclass of it (see :func:`inherited_handler`)."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"Handler.mode for {self.cls.__qualname__}: got {self.mode!r}, allowed values are {MODES}")

    @property
    def name(self) -> str:
        kind = "default" if self.is_default else "registered"
        name = f"{kind} handler for {self.cls.__module__}.{self.cls.__qualname__}"
        if self.inherited_from is not None:
            name += f" (inherited from {self.inherited_from.__qualname__})"
        return name


def check_callable_arity(fn: Any, arity: int, *, what: str, cls: type, expected: str) -> None:
    """Raise :class:`RegistrationError` unless ``fn`` accepts ``arity`` positional arguments."""
    if not callable(fn):
        raise RegistrationError(f"{what} for {cls.__qualname__} must be callable, got {type(fn).__name__}. Pass a function {expected}.")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # builtins without a signature: trust the caller
    try:
        signature.bind(*range(arity))
    except TypeError as error:
        raise RegistrationError(
            f"{what} for {cls.__qualname__} has signature {signature}, which cannot take "
            f"{arity} positional arguments ({error}). Define it as {expected}."
        ) from None


def inherited_handler(registered: Handler, cls: type) -> Handler:
    """The handler a subclass ``cls`` of ``registered.cls`` gets: same mode, its own class.

    It keeps the registered metadata key only while it flattens exactly as the registered class
    does; a child with its own flatten protocol is keyed by its whole context.

    A registered ``rebuild`` builds instances of the class it was written for, so the
    subclass is rebuilt through its own ``__tensor_unflatten__`` (the protocol), which is
    what produces ``cls`` in eager; a custom rebuild that must serve a family registers
    each class (or the child) explicitly.
    """
    return Handler(
        cls=cls,
        rebuild=unflatten_rebuild(cls),
        metadata_key=registered.metadata_key if same_flatten_protocol(cls, registered.cls) else whole_context_key,
        mode=registered.mode,
        inherited_from=registered.cls,
    )


def same_flatten_protocol(cls: type, base: type) -> bool:
    """Whether ``cls`` flattens exactly as ``base`` does (it overrides neither protocol method).

    A registered ``metadata_key`` reads the context of the class it was written for; a child with
    its own ``__tensor_flatten__``/``__tensor_unflatten__`` may put anything in its context, so
    only the whole context identifies its graph (Note [Metadata keys never hide a context]).
    """
    return all(
        getattr(cls, name, None) is getattr(base, name, None) for name in ("__tensor_flatten__", "__tensor_unflatten__")
    )


def default_handler(cls: type) -> Handler:
    """The protocol handler used for any traceable wrapper subclass without a registration."""
    return Handler(cls=cls, rebuild=unflatten_rebuild(cls), is_default=True)

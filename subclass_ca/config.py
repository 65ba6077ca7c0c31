"""The validated settings of one ``enable()`` block."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

__all__ = [
    "Config", "CACHE_ENV", "DEFAULT_BACKEND", "DYNAMIC_CHOICES", "ON_UNSUPPORTED", "SETTINGS", "CACHE_KEYED_SETTINGS",
    "FLAGS", "cache_key", "followed",
]

ON_UNSUPPORTED: tuple[str, ...] = ("error", "eager")
CACHE_ENV = "SUBCLASS_CA_CACHE"
"""``SUBCLASS_CA_CACHE=0`` in the environment makes ``cache=False`` the default of every ``enable()``."""
_RESERVED_COMPILE_KWARGS = ("backend", "fullgraph", "dynamic")
"""Set through their own fields, never through compile_kwargs."""
DEFAULT_BACKEND = "inductor"
"""``torch.compile``'s default backend: what ``Config.backend=None`` compiles with when no forward names one."""
DYNAMIC_CHOICES: tuple[bool | None, ...] = (None, True, False)
"""``Config.dynamic``: static-first (None, the default), dynamic from the first capture, never dynamic."""


@dataclass(frozen=True, kw_only=True)
class Config:
    """Settings of one ``subclass_ca.enable()`` block (frozen; validated on creation)."""

    backend: str | Callable[..., Any] | None = None
    """Anything ``torch.compile(backend=...)`` accepts: a name or a ``(gm, example_inputs)`` callable.  None (the
    default): the backend that compiled the forwards the backward captures, else ``torch.compile``'s default,
    inductor (Note [Defaults follow the user])."""
    compile_kwargs: Mapping[str, Any] = field(default_factory=dict)
    """Extra keyword arguments for ``torch.compile`` of the CA graph (not backend/fullgraph)."""
    dynamic: bool | None = None
    """How the sizes of the autograd graph enter the CA graph (Note [Static-first CA graphs] in ``_compiler.py``).
    None: static first, Dynamo's automatic-dynamic rule: the first capture specialises every size; a size
    that changes recaptures once with that size dynamic.  True: every size dynamic from the first capture
    (torch's default for compiled autograd).  False: never dynamic: each new size compiles the CA graph anew."""
    strict: bool = False
    """Check every rebuilt subclass against the metadata recorded at capture; raise on mismatch."""
    on_unsupported: str = "error"
    """An unregistered subclass whose constructor cannot be traced: "error" raises, "eager" rebuilds it opaquely."""
    report: bool = field(default=False, metadata={"keys_cache": False})
    """Log a capture report (see ``subclass_ca.last_report()``) after every capture; collect cache-miss reasons."""
    fullgraph: bool = True
    """Compile the CA graph whole.  True: a backward that needs a graph break (e.g. an optimizer step
    inside a post-accumulate-grad hook) raises :class:`GraphBreakError` naming the code, before any
    gradient.  False: Dynamo breaks the graph there and runs that code eagerly; the capture
    report lists the breaks."""

    cache: bool = field(default_factory=lambda: os.environ.get(CACHE_ENV, "1") != "0")
    """Let compiled CA graphs cross processes (torch's persistent caches, kept traces), each under the key of what
    it computes (Note [Keys by behaviour] in ``_warm_start/keys.py``).  False keeps every CA graph out of
    them, as stock compiled autograd does (the default is False when the environment sets ``SUBCLASS_CA_CACHE=0``)."""

    regional: bool = True
    """Compile each distinct piece of a CA graph with repeated compiled regions once, reused by every identical block
    (Note [Regional CA graphs] in ``_regional.py``).  False compiles the whole graph as one (fusion across blocks,
    and a backward that fails to compile fails before any gradient)."""

    @property
    def persistent_caches(self) -> bool:
        """Whether a CA graph compiled under these settings may cross processes: ``cache`` is on and torch's persistent
        caches serve its compile, which they do for inductor without ``mode=`` (a mode's CUDA graphs or autotuning
        are not kept).  The one place that rule lives (a ``backend=None`` config is resolved first: :func:`followed`)."""
        return self.cache and self.backend == "inductor" and "mode" not in self.compile_kwargs

    def __post_init__(self) -> None:
        if not (self.backend is None or isinstance(self.backend, str) or callable(self.backend)):
            raise ValueError(f"Config.backend must be None, a backend name or a callable, got {self.backend!r}")
        if isinstance(self.backend, str) and not self.backend:
            raise ValueError("Config.backend must not be empty; use e.g. 'aot_eager' or 'inductor'")
        if not isinstance(self.compile_kwargs, Mapping):
            raise ValueError(f"Config.compile_kwargs must be a mapping, got {type(self.compile_kwargs).__name__}")
        reserved = [k for k in _RESERVED_COMPILE_KWARGS if k in self.compile_kwargs]
        if reserved:
            raise ValueError(
                f"Config.compile_kwargs must not set {reserved}: pass backend= and fullgraph= as settings of "
                "their own (enable(backend=..., fullgraph=..., dynamic=...))"
            )
        for name in FLAGS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Config.{name} must be True or False, got {getattr(self, name)!r}")
        if not any(self.dynamic is choice for choice in DYNAMIC_CHOICES):
            raise ValueError(f"Config.dynamic must be None, True or False, got {self.dynamic!r}")
        if self.on_unsupported not in ON_UNSUPPORTED:
            raise ValueError(f"Config.on_unsupported: got {self.on_unsupported!r}, allowed values are {ON_UNSUPPORTED}")


# The settings are declared once, as the fields above; everything else derives from them.
SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(Config) if f.name != "compile_kwargs")
"""The settings ``enable()`` takes as keywords (besides ``**compile_kwargs``), in declaration order."""
CACHE_KEYED_SETTINGS: tuple[str, ...] = tuple(f.name for f in fields(Config) if f.metadata.get("keys_cache", True))
"""The settings that change what a CA graph is (each distinct combination gets its own CA cache entries)."""
FLAGS: tuple[str, ...] = tuple(f.name for f in fields(Config) if f.type in ("bool", bool))
"""The settings that must be exactly True or False."""


def cache_key(config: Config) -> tuple[Any, ...]:
    """The value of :data:`CACHE_KEYED_SETTINGS` of ``config``, hashable (compile kwargs compared by ``repr``)."""
    return tuple(
        repr(sorted(config.compile_kwargs.items())) if name == "compile_kwargs" else getattr(config, name)
        for name in CACHE_KEYED_SETTINGS
    )


# Note [Defaults follow the user]
# -------------------------------
# Most models are compiled as ``torch.compile(model)``: inductor.  A CA graph compiled with another
# backend than its forwards' gives a slower step (an inductor-compiled MLP stack under a bare
# ``enable()`` that compiled with aot_eager stepped 1.36x compile-only's) or, the other way round,
# a surprise.  So ``Config.backend=None``, the default, is resolved per capture, from what the
# capture holds: each AOT backward pasted into the CA graph names the backend that compiled its
# forward (``_compat.forward_backend``: inductor, aot_eager, or unknown), recorded as the capture
# runs (``diagnostics.forward_backends``).  One backend named by every forward is followed;
# no AOT backward (an eager forward), an unknown compiler (a custom backend) or several distinct
# ones give ``torch.compile``'s default, inductor.  An explicit ``backend=`` always wins, and the
# testing kit names ``aot_eager`` where it certifies bitwise.
#
# Resolution happens at capture, never at ``enable()``: one block may back-propagate through
# forwards compiled differently.  The resolved value is the Config the compiled CA graph carries,
# so what keys its compile across processes (``cache_key`` in its kept-trace and behaviour keys)
# holds the backend it was compiled with.  Within a process compiled autograd's cache keeps
# ``backend=None`` graphs apart from every explicit backend (the token, Note [Keeping CA caches
# apart]), and among ``backend=None`` graphs the key holds each AOT function's identity, which
# fixes the backend that compiled it: a cached graph is never reused for forwards that would
# resolve otherwise.


def followed(config: Config, forward_backends: Iterable[str | None]) -> Config:
    """``config`` with ``backend=None`` resolved for a capture whose forwards were compiled by ``forward_backends``
    (None: a compiler we cannot name); ``config`` itself when it names a backend (Note [Defaults follow the user])."""
    if config.backend is not None:
        return config
    names = set(forward_backends)
    backend = names.pop() if len(names) == 1 and None not in names else DEFAULT_BACKEND
    return replace(config, backend=backend)

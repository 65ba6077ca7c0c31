"""``enable()`` and ``reset()``: the front door over the runtime (``_runtime.py``)."""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Callable
from typing import Any

import torch

from . import _compat, _compiler, _runtime, diagnostics
from .config import SETTINGS, Config

__all__ = ["enable", "reset"]


_valid_backend_names: set[str] = set()
"""Backend names already found registered: each name is looked up in torch's registry once."""
_COMMON_DEBUG_BACKENDS = ("aot_eager", "eager")
"""Tagged "debug" by torch, so absent from ``list_backends()``, but what users compile with when testing."""


def _check_backend(backend: Any) -> None:
    if not isinstance(backend, str) or backend in _valid_backend_names:
        return
    known = torch.compiler.list_backends(exclude_tags=())
    if backend not in known:
        user_facing = sorted({*torch.compiler.list_backends(), *(b for b in _COMMON_DEBUG_BACKENDS if b in known)})
        raise ValueError(
            f"enable(backend=...): unknown backend {backend!r}; pass a callable or a registered backend name, "
            f"e.g. {user_facing} (torch.compiler.list_backends(exclude_tags=()) lists every registered name, "
            "debug and testing ones included)"
        )
    _valid_backend_names.add(backend)


# Note [Interned settings]
# ------------------------
# The idiom is a fresh ``enable(...)`` per training step.  Equal settings therefore share one
# validated Config, one CACompiler (its compiler factory built once) and one cache token
# (``_compiler.settings_for``), so constructing an ``enable`` costs a dict lookup: keyword
# arguments seen before map straight to their Settings (``_by_keywords``), without building or
# validating a Config.  Flags given are keyed by identity (``id(True)``), so ``dynamic=1`` never
# finds ``dynamic=True``'s entry and is still rejected; compile kwargs are keyed with each
# value's type; values that cannot be hashed (e.g. ``options={...}``) take the slow path,
# which still ends in the shared Settings.  Whether cache-miss reasons are collected is read
# on every construction, as before (``report=True`` or the ``subclass_ca`` logger at INFO).
# Settings live as long as the process, like the cache tokens they carry (a new callable
# backend per step makes a new one per step, as it made a new token before).

_info_enabled = diagnostics.logger.isEnabledFor
"""Whether cache-miss reasons are asked for (the ``subclass_ca`` logger at INFO: ``SUBCLASS_CA_LOG=info|debug``), bound
once: asked on every construction."""
_by_keywords: dict[tuple[Any, ...], _compiler.Settings] = {}
_MAX_KEYWORD_SETS = 1024
"""Beyond this many distinct keyword sets (e.g. a new lambda backend per step) no more are remembered."""


class enable:
    """Capture ``backward()`` with compiled autograd, rebuilding subclasses through our proxy.

    Use as ``with subclass_ca.enable(): loss.backward()`` or as a decorator on a training
    step.  Settings come either as keyword arguments (see :class:`Config` for each) or as
    one ``config=Config(...)``, not both.  ``backend`` is anything ``torch.compile(backend=...)``
    accepts; the CA graph is compiled as ``torch.compile(ca_graph, backend=backend,
    fullgraph=True, **compile_kwargs)``.  On exit (also on an exception) torch's state is as
    before: compiled autograd off (or the outer block's), its flags, multithreading and logger
    restored; the few torch functions subclass_ca wraps stay installed but act only inside
    blocks, calling torch's own everywhere else, and :func:`reset` restores them exactly
    (Note [Resident patches]).  Blocks nest (Note [enable() blocks and threads]).  A fresh
    ``enable(...)`` per step is cheap: equal settings share one validated Config, compiler and
    CA cache token (Note [Interned settings]).
    """

    # No instance __dict__: a fresh object per training step is the idiom (Note [Interned settings]).
    __slots__ = ("config", "_compiler", "_token", "_miss_log")

    def __init__(
        self,
        backend: str | Callable[..., Any] | None = None,
        *,
        config: Config | None = None,
        dynamic: bool | None = None,
        strict: bool | None = None,
        on_unsupported: str | None = None,
        report: bool | None = None,
        fullgraph: bool | None = None,
        cache: bool | None = None,
        regional: bool | None = None,
        **compile_kwargs: Any,
    ) -> None:
        if config is None:
            key: tuple[Any, ...] | None
            if dynamic is None and strict is None and report is None and fullgraph is None and cache is None and regional is None:
                key = (backend, on_unsupported)  # the usual call: enable(backend=...)
            else:
                key = (backend, on_unsupported, id(dynamic), id(strict), id(report), id(fullgraph), id(cache), id(regional))
            if compile_kwargs:
                key += tuple((name, type(value), value) for name, value in compile_kwargs.items())
            try:
                settings = _by_keywords.get(key)
            except TypeError:  # an unhashable value: build and validate a Config below
                settings, key = None, None
            if settings is None:
                settings = self._settings(backend, dynamic, strict, on_unsupported, report, fullgraph, cache, regional,
                                          compile_kwargs)
                if key is not None and len(_by_keywords) < _MAX_KEYWORD_SETS:
                    _by_keywords[key] = settings
            self.config = settings.config
        else:
            if not isinstance(config, Config):
                raise TypeError(f"enable(config=...) takes a subclass_ca.Config, got {type(config).__name__}")
            given = locals()
            keywords = [name for name in SETTINGS if given[name] is not None]
            if keywords or compile_kwargs:
                raise TypeError(
                    f"enable(config=...) was also given {sorted([*keywords, *compile_kwargs])}: put every setting "
                    "in the Config (dataclasses.replace(config, ...)) or pass keywords only"
                )
            _check_backend(config.backend)
            settings = _compiler.settings_for(config)
            self.config = config
        self._compiler = settings.compiler
        self._token = settings.token
        self._miss_log = settings.config.report or _info_enabled(logging.INFO)

    @staticmethod
    def _settings(
        backend: Any, dynamic: Any, strict: Any, on_unsupported: Any, report: Any, fullgraph: Any, cache: Any,
        regional: Any, compile_kwargs: dict[str, Any],
    ) -> _compiler.Settings:
        """Validate keyword settings into a Config (first time seen) and return their shared Settings."""
        given = locals()
        keywords = {name: given[name] for name in SETTINGS if given[name] is not None}
        config = Config(**keywords, compile_kwargs=compile_kwargs)
        _check_backend(config.backend)
        return _compiler.settings_for(config)

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # Note [A bare @enable]: @subclass_ca.enable over a step that cannot be a backend
        if len(args) == 1 and not kwargs and _is_bare_decoration(args[0]):
            return _in_default_block(args[0])
        return super().__new__(cls)

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """A bare ``@enable`` over a two-argument method binds like the method (Note [A bare @enable])."""
        backend = self.config.backend
        if instance is None or isinstance(backend, str) or not callable(backend):
            return self
        return functools.partial(self.__call__, instance)

    def __enter__(self) -> enable:
        _runtime.enter_block(self, self.config, self._compiler, self._token, miss_log=self._miss_log)
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        return _runtime.exit_block(self, exc_info)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """As a decorator: every call of ``func`` runs inside this block (as ``contextlib.ContextDecorator``)."""
        if len(args) != 1 or kwargs or not callable(args[0]) or isinstance(args[0], torch.Tensor):
            backend = self.config.backend
            if callable(backend) and not isinstance(backend, str):
                # Note [A bare @enable]: a two-argument step taken for a backend, now called like a step
                with _default_enable():
                    return backend(*args, **kwargs)
            raise TypeError(
                f"subclass_ca.enable(...) was called with {len(args)} positional and {len(kwargs)} keyword "
                "argument(s): an enable object decorates one function (@subclass_ca.enable() over a training "
                "step) or is entered with `with subclass_ca.enable(): ...`."
            )
        func = args[0]

        @functools.wraps(func)
        def inner(*args: Any, **kwargs: Any) -> Any:
            with self:
                return func(*args, **kwargs)

        return inner


# Note [A bare @enable]
# ---------------------
# ``@subclass_ca.enable`` without parentheses hands the decorated function to ``enable``'s
# first parameter, ``backend``, which also takes a backend callable ``(gm, example_inputs)``.
# A lone positional callable that cannot take those two arguments is the decorated function:
# ``enable.__new__`` returns it wrapped to run inside a default block.  One that can (a two-argument train
# step) stays a backend, but since torch never calls the enable object itself (it calls the
# compiler), calling the object with anything but one function to decorate means it was a bare
# decorator: it then runs the function inside a default block.  Either way the function runs
# under compiled autograd; it never silently becomes a backend that nothing calls.


def _is_bare_decoration(candidate: Any) -> bool:
    """A lone positional callable that cannot take a backend's ``(gm, example_inputs)``."""
    if isinstance(candidate, str) or not callable(candidate):
        return False
    try:
        inspect.signature(candidate).bind(None, None)
    except TypeError:
        return True
    except ValueError:  # no signature (builtins): trust it as a backend
        return False
    return False


def _in_default_block(step: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(step)
    def run(*args: Any, **kwargs: Any) -> Any:
        with _default_enable():
            return step(*args, **kwargs)

    return run


def _default_enable() -> enable:
    return enable()


def reset() -> None:
    """Forget compiled graphs (Dynamo and compiled autograd caches): the next backward recaptures.

    Outside every ``enable()`` block it also puts each torch attribute subclass_ca replaced
    back to torch's identical object (Note [Resident patches]); the next block installs them again.
    """
    torch.compiler.reset()
    _compat.reset_compiled_autograd()
    diagnostics.cache_cleared()
    if not _compat.BLOCKS.depth:
        _compat.uninstall_resident()

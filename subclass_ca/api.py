"""``enable()`` and ``reset()``: the front door over the runtime (``_runtime.py``)."""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from . import _compat, _runtime, diagnostics
from .config import Config

__all__ = ["enable", "reset"]


def _check_backend(backend: Any) -> None:
    if isinstance(backend, str):
        known = torch.compiler.list_backends(exclude_tags=())
        if backend not in known:
            raise ValueError(f"enable(backend=...): unknown backend {backend!r}; allowed values are {sorted(known)} or a callable")


class enable(contextlib.ContextDecorator):
    """Capture ``backward()`` with compiled autograd, rebuilding subclasses through our proxy.

    Use as ``with subclass_ca.enable(): loss.backward()`` or as a decorator on a training
    step.  Settings come either as keyword arguments (see :class:`Config` for each) or as
    one ``config=Config(...)``, not both.  ``backend`` is anything ``torch.compile(backend=...)``
    accepts; the CA graph is compiled as ``torch.compile(ca_graph, backend=backend,
    fullgraph=True, **compile_kwargs)``.  On exit (also on an exception) torch's state is as
    before: compiled autograd off (or the outer block's), its flags, multithreading and logger
    restored; the few torch functions subclass_ca wraps stay installed but act only inside
    blocks, calling torch's own everywhere else, and :func:`reset` restores them exactly
    (Note [Resident patches]).  Blocks nest (Note [enable() blocks and threads]).
    """

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
        **compile_kwargs: Any,
    ) -> None:
        self._bare_function: Callable[..., Any] | None = None
        """The function under a bare ``@subclass_ca.enable`` (no parentheses), run by :meth:`__call__`."""
        if callable(backend) and not isinstance(backend, str) and config is None and not compile_kwargs and all(
            value is None for value in (dynamic, strict, on_unsupported, report, fullgraph)
        ):
            # Note [A bare @enable]: a lone positional callable is a backend or the decorated function
            if not _binds_as_backend(backend):
                self._bare_function, backend = backend, None
                functools.update_wrapper(self, self._bare_function)
            else:
                self._bare_function = backend  # ambiguous: a backend unless it is later called like a function
        keywords = {
            name: value
            for name, value in (
                ("backend", backend),
                ("dynamic", dynamic),
                ("strict", strict),
                ("on_unsupported", on_unsupported),
                ("report", report),
                ("fullgraph", fullgraph),
            )
            if value is not None
        }
        if config is not None:
            if not isinstance(config, Config):
                raise TypeError(f"enable(config=...) takes a subclass_ca.Config, got {type(config).__name__}")
            if keywords or compile_kwargs:
                raise TypeError(
                    f"enable(config=...) was also given {sorted([*keywords, *compile_kwargs])}: put every setting "
                    "in the Config (dataclasses.replace(config, ...)) or pass keywords only"
                )
        else:
            config = Config(**keywords, compile_kwargs=compile_kwargs)
        _check_backend(config.backend)
        self.config = config
        self._compiler = _runtime.CACompiler(config)
        self._token = _runtime.cache_token(config)
        self._miss_log = config.report or diagnostics.miss_reasons_requested()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Decorate a function (``@enable(...)``), or run the function of a bare ``@enable``."""
        bare = self._bare_function
        if bare is not None and (self.config.backend is not bare or not _is_decoration(args, kwargs)):
            runner = self if self.config.backend is not bare else _default_enable()
            with runner:
                return bare(*args, **kwargs)
        if not _is_decoration(args, kwargs):
            raise TypeError(
                f"subclass_ca.enable(...) was called with {len(args)} positional and {len(kwargs)} keyword "
                "argument(s): an enable object decorates one function (@subclass_ca.enable() over a training "
                "step) or is entered with `with subclass_ca.enable(): ...`."
            )
        return super().__call__(args[0])

    def __get__(self, instance: Any, owner: Any = None) -> Any:
        """A bare ``@enable`` over a method binds like the method."""
        if instance is None or self._bare_function is None:
            return self
        return functools.partial(self.__call__, instance)

    def __enter__(self) -> enable:
        _runtime.enter_block(self, self.config, self._compiler, self._token, miss_log=self._miss_log)
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        return _runtime.exit_block(self, exc_info)


# Note [A bare @enable]
# ---------------------
# ``@subclass_ca.enable`` without parentheses hands the decorated function to ``enable``'s
# first parameter, ``backend``, which also takes a backend callable ``(gm, example_inputs)``.
# A lone positional callable that cannot take those two arguments is the decorated function:
# the object runs it inside a default block when called.  One that can (a two-argument train
# step) stays a backend, but since torch never calls the enable object itself (it calls the
# compiler), calling the object with anything but one function to decorate means it was a bare
# decorator: it then runs the function inside a default block.  Either way the function runs
# under compiled autograd; it never silently becomes a backend that nothing calls.


def _binds_as_backend(candidate: Callable[..., Any]) -> bool:
    try:
        inspect.signature(candidate).bind(None, None)
    except TypeError:
        return False
    except ValueError:  # no signature (builtins): trust it as a backend
        return True
    return True


def _is_decoration(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return len(args) == 1 and not kwargs and callable(args[0]) and not isinstance(args[0], torch.Tensor)


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

"""``enable()`` and ``reset()``: the front door over the runtime (``_runtime.py``)."""

from __future__ import annotations

import contextlib
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

    def __enter__(self) -> enable:
        _runtime.enter_block(self, self.config, self._compiler, self._token, miss_log=self._miss_log)
        return self

    def __exit__(self, *exc_info: Any) -> bool:
        return _runtime.exit_block(self, exc_info)


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

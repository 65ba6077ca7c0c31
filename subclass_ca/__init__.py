"""subclass_ca: compiled autograd for wrapper tensor subclasses.

The whole public API is imported here; everything else is private or a submodule:
``subclass_ca.diagnostics`` (reports, graph-callable and recipe counts),
``subclass_ca.testing`` (the testing kit) and ``subclass_ca.distributed`` (``run_workers``: a
function on N local processes, bounded; tooling, imported only on demand).
"""

from __future__ import annotations

from . import (
    _builtin_handlers,  # noqa: F401  (registers the built-in handlers)
    diagnostics,
)
from ._compat import SUPPORTED_TORCH, TESTED_TORCH
from ._handler import MODES, Handler
from ._version import __version__
from ._warm_start.files import CacheFile, load_cache, save_cache
from .api import enable, reset
from .config import Config
from .diagnostics import CaptureReport, cache_stats, clear_reports, last_report, reports
from .errors import (
    BackwardCompileError,
    CacheFileError,
    CompiledOptimizerStepError,
    DDPUnsupportedError,
    DuplicateHandlerError,
    FSDP2UnsupportedError,
    GraphBreakError,
    HookOnSubclassError,
    HookOrderError,
    MetadataMismatchError,
    RebuildError,
    RegionalCompileError,
    RegistrationError,
    SubclassCAError,
    UnsupportedSubclassError,
    UnsupportedTorchError,
    UntrustedCacheWarning,
)
from .registry import get_handler, handler, handlers, register_handler, unregister_handler

__all__ = [
    # capture
    "enable",
    "reset",
    "Config",
    # warm start (Note [Warm start through torch's caches])
    "save_cache",
    "load_cache",
    "CacheFile",
    # handlers
    "register_handler",
    "handler",
    "unregister_handler",
    "get_handler",
    "handlers",
    "Handler",
    "MODES",
    # diagnostics
    "CaptureReport",
    "last_report",
    "reports",
    "clear_reports",
    "cache_stats",
    "diagnostics",
    # errors
    "SubclassCAError",
    "UnsupportedTorchError",
    "RegistrationError",
    "DuplicateHandlerError",
    "RebuildError",
    "MetadataMismatchError",
    "UnsupportedSubclassError",
    "FSDP2UnsupportedError",
    "DDPUnsupportedError",
    "HookOnSubclassError",
    "HookOrderError",
    "GraphBreakError",
    "BackwardCompileError",
    "RegionalCompileError",
    "CompiledOptimizerStepError",
    "CacheFileError",
    "UntrustedCacheWarning",
    # versions
    "SUPPORTED_TORCH",
    "TESTED_TORCH",
    "__version__",
]

"""torch's logging: the ``TORCH_LOGS`` registry and structured-trace (``TORCH_TRACE``) artifacts.

Note [subclass_ca in torch's logs]
----------------------------------
``TORCH_LOGS`` is parsed when torch is imported, before any library can register a name, so
``TORCH_LOGS=subclass_ca`` (INFO) and ``+subclass_ca`` (DEBUG) reach our logger through torch's
module-name rule: a name that is an importable module enables the logger of that name, with torch's
handler and format.  Registering ``subclass_ca`` as a log alias afterwards (:func:`register_log`)
makes it a name of torch's registry like ``dynamo``: ``torch._logging.set_logs(modules={"subclass_ca":
logging.DEBUG})`` and later re-parses of the variable find it without walking the package again, and
``TORCH_LOGS=help`` lists it.  Structured-trace artifacts need no registration: ``trace_structured``
writes them whenever ``TORCH_TRACE`` is set, and tlparse renders each under its name.  Both are
optional: without them the logger still logs (``SUBCLASS_CA_LOG``) and a trace holds no entries of ours.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from ._lookup import lookup

__all__ = ["LOG_REGISTRY", "STRUCTURED_TRACE", "register_log", "structured_trace_enabled", "trace_artifact"]

LOG_REGISTRY = "torch._logging._internal:register_log"
STRUCTURED_TRACE = "torch._logging._internal:trace_structured"
_TRACE_LOG = "torch._logging._internal:trace_log"
COMPILE_ID = "torch._guards:CompileId"


def register_log(alias: str, qualified_names: list[str]) -> bool:
    """Make ``alias`` a ``TORCH_LOGS`` name for the loggers ``qualified_names``; False where torch has no registry."""
    try:
        lookup(LOG_REGISTRY)(alias, qualified_names)
    except (ImportError, AttributeError):
        return False
    return True


@functools.cache
def _trace() -> tuple[Any, logging.Logger | None]:
    try:
        return lookup(STRUCTURED_TRACE), lookup(_TRACE_LOG)
    except (ImportError, AttributeError):
        return None, None


def structured_trace_enabled() -> bool:
    """Whether a structured trace is being written (``TORCH_TRACE``): torch's trace log has a handler."""
    trace_structured, trace_log = _trace()
    return trace_structured is not None and bool(getattr(trace_log, "handlers", None))


def _compile_id(compiled_autograd_id: int | None) -> Any:
    if compiled_autograd_id is None:
        return None
    try:
        return lookup(COMPILE_ID)(compiled_autograd_id=compiled_autograd_id, frame_id=None, frame_compile_id=None)
    except (ImportError, AttributeError, TypeError):
        return None


def trace_artifact(
    name: str, payload_fn: Callable[[], str], *, encoding: str = "string", compiled_autograd_id: int | None = None
) -> None:
    """One ``artifact`` entry named ``name`` in the structured trace (nothing when no trace is written).

    ``payload_fn`` is called only when the entry is written; ``compiled_autograd_id`` files it with that CA
    graph's own entries (tlparse groups by compile id).  Never raises: a trace is a diagnostic.
    """
    trace_structured, _ = _trace()
    if trace_structured is None or not structured_trace_enabled():
        return
    try:
        trace_structured(
            "artifact",
            metadata_fn=lambda: {"name": name, "encoding": encoding},
            payload_fn=payload_fn,
            expect_trace_id=False,
            compile_id=_compile_id(compiled_autograd_id),
        )
    except Exception:
        logging.getLogger("subclass_ca").debug("structured trace entry %s not written", name, exc_info=True)

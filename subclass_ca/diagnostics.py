"""Per-capture reports: what the capture did, for humans and for tests.

A report is built when compiled autograd hands a captured graph to our compiler
function; ``last_report()`` returns the newest, ``reports()`` all of this process's.
Logging goes to the ``subclass_ca`` logger (quiet by default; ``SUBCLASS_CA_LOG=info|debug``, or torch's
``TORCH_LOGS=subclass_ca`` / ``TORCH_LOGS=+subclass_ca``, Note [subclass_ca in torch's logs] in
``_compat/logs.py``).  A ``TORCH_TRACE`` run also gets structured-trace artifacts, rendered by tlparse:
each CA graph with its named subclass nodes (``subclass_ca_graph``), compiled autograd's cache-miss
reasons (``subclass_ca_cache_miss``), warm-start hits and misses (``subclass_ca_warm_start``) and
refused cache files or folders (``subclass_ca_trust_refusal``).

Cache hits and recompiles.  Compiled autograd keeps its own cache of captured graphs,
keyed on the autograd graph's structure and sizes; a cache miss is a new capture (one
report), a hit runs a cached graph without calling our compiler.  Each report therefore
counts ``runs`` of its compiled graph: the first run follows the capture, every later
run is a cache hit.  The *reason* for a miss comes from torch itself: while an
``enable()`` block is active we route compiled autograd's C++ verbose logger
(``torch._C._dynamo.compiled_autograd.set_verbose_logger``) to :class:`_CacheMissLog`,
which keeps its "Cache miss due to ..." lines and hands them to the next report.  This is
done only when reasons are asked for (``enable(report=True)`` or ``SUBCLASS_CA_LOG=info``);
otherwise, or where torch lacks that hook, ``CaptureReport.miss_reasons_available`` is
False and the summary says so.  Dynamo-level recompiles *of* one CA graph (guard failures inside
``torch.compile``) are not reported here: torch exposes their reasons only through its
``recompiles`` log artifact (``TORCH_LOGS=recompiles``).
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from . import _compat
from ._nodes import named_callables
from ._recipe import recipe_count

__all__ = [
    "CaptureReport",
    "last_report",
    "reports",
    "clear_reports",
    "cache_stats",
    "named_callables",
    "recipe_count",
    "logger",
    "forward_backends",
    "record_forward_backend",
    "record_warm_start",
    "record_trust_refusal",
    "ARTIFACTS",
]

logger = logging.getLogger("subclass_ca")
_level = os.environ.get("SUBCLASS_CA_LOG", "").strip().upper()
if _level in ("INFO", "DEBUG", "WARNING"):
    logger.setLevel(_level)
    if not logger.handlers:
        _stream = logging.StreamHandler()
        _stream.setFormatter(logging.Formatter("[subclass_ca %(levelname)s] %(message)s"))
        logger.addHandler(_stream)

_compat.register_log("subclass_ca", ["subclass_ca"])  # Note [subclass_ca in torch's logs]

ARTIFACTS = ("subclass_ca_graph", "subclass_ca_cache_miss", "subclass_ca_warm_start", "subclass_ca_trust_refusal")
"""The names of our structured-trace artifacts (``TORCH_TRACE``), as tlparse lists them."""

_MAX_REPORTS = 256


@dataclass(kw_only=True)
class CaptureReport:
    """What one compiled-autograd capture contained."""

    capture_index: int
    """0-based index of this capture within the process (subclass_ca captures only)."""
    aot_backwards: int = 0
    """AOT backward nodes pasted into the CA graph."""
    subclass_nodes: Counter[tuple[str, str]] = field(default_factory=Counter)
    """make_subclass nodes keyed by (subclass type name, mode)."""
    fallbacks: list[str] = field(default_factory=list)
    """Subclasses that fell back to opaque mode (on_unsupported="eager"), with the reason."""
    graph_nodes: int = 0
    """Total nodes in the captured CA graph."""
    fullgraph: bool = True
    """Whether the CA graph was compiled with fullgraph=True (False: ``enable(fullgraph=False)``, opaque nodes, FSDP2)."""
    split_pieces: int = 0
    """Pieces the CA graph was split into at FSDP2 / ``dynamo.disable``-d hooks, each compiled with
    fullgraph=True (0: not split; Note [Splitting the CA graph at FSDP2's hooks] in ``_split.py``)."""
    split_hooks: int = 0
    """Hook calls run eagerly between the pieces of a split graph."""
    regional_pieces: int = 0
    """Pieces of a regional CA graph, one per compiled region (0: compiled whole; Note [Regional CA graphs] in ``_regional.py``)."""
    regional_compiles: int = 0
    """Distinct pieces compiled for it (each reused by every identical piece), counted as they are first run."""
    graph_breaks: list[str] = field(default_factory=list)
    """Dynamo's graph-break reasons met compiling this CA graph (only with fullgraph=False)."""
    ca_counters: dict[str, int] = field(default_factory=dict)
    """torch's compiled_autograd counters after this capture (captures, compiles, ...)."""
    graph_code: str = ""
    """The CA graph's Python code, for reading and for graph assertions."""
    runs: int = 0
    """Times this capture's compiled graph ran: the first run follows the capture, each later one is a cache hit."""
    miss_reasons: list[str] = field(default_factory=list)
    """torch's own "Cache miss due to ..." messages that led to this capture (empty for a capture
    made while no reason hook was installed, e.g. the very first one of a process on old torch)."""
    miss_reasons_available: bool = True
    """False when reasons were not collected (not asked for, or this torch gives no hook)."""
    forward_backends: Counter[str | None] = field(default_factory=Counter)
    """Which backend compiled the forward of each captured AOT backward (None: one we cannot name)."""
    backend: str | None = None
    """The backend the CA graph is compiled with (``enable(backend=...)``, or the one followed: Note [Defaults
    follow the user] in ``config.py``); None where the compiler did not say."""

    @property
    def cache_hits(self) -> int:
        """Backwards that reused this capture's graph from compiled autograd's cache."""
        return max(self.runs - 1, 0)

    def nodes_for(self, type_name: str, mode: str | None = None) -> int:
        """How many make_subclass nodes rebuild ``type_name`` (optionally in one mode)."""
        return sum(n for (name, m), n in self.subclass_nodes.items() if name == type_name and (mode is None or m == mode))

    @property
    def total_subclass_nodes(self) -> int:
        return sum(self.subclass_nodes.values())

    def summary(self) -> str:
        lines = [
            f"capture #{self.capture_index}: {self.aot_backwards} AOT backward(s), {self.graph_nodes} graph nodes, "
            f"fullgraph={self.fullgraph}" + (f", backend={self.backend}" if self.backend is not None else ""),
        ]
        if self.forward_backends:
            named = ", ".join(f"{name or 'unknown'} x{n}" for name, n in sorted(self.forward_backends.items(), key=str))
            lines.append(f"  forwards compiled by: {named}")
        for (name, mode), count in sorted(self.subclass_nodes.items()):
            lines.append(f"  {count} x make_subclass {name} [{mode}]")
        if self.regional_pieces:
            lines.append(f"  regional: {self.regional_pieces} piece(s), {self.regional_compiles} distinct compile(s)")
        if self.split_pieces:
            lines.append(f"  split: {self.split_pieces} compiled piece(s), {self.split_hooks} eager hook call(s)")
        lines += [f"  fallback: {reason}" for reason in self.fallbacks]
        lines += [f"  graph break: {reason}" for reason in self.graph_breaks]
        lines.append(f"  runs={self.runs} (cache hits={self.cache_hits})")
        if not self.miss_reasons_available:
            lines.append("  cache-miss reason: not collected (enable(report=True) or SUBCLASS_CA_LOG=info collects it)")
        lines += [f"  cache miss: {reason}" for reason in self.miss_reasons]
        if self.ca_counters:
            counters = ", ".join(f"{k}={v}" for k, v in sorted(self.ca_counters.items()))
            lines.append(f"  torch compiled_autograd counters (process-wide): {counters}")
        return "\n".join(lines)


_lock = threading.Lock()
_reports: list[CaptureReport] = []
_pending = threading.local()
_capture_count = 0


def _pending_events() -> dict[str, Any]:
    events = getattr(_pending, "events", None)
    if events is None:
        events = _pending.events = {"aot_backwards": 0, "nodes": Counter(), "fallbacks": [], "misses": [], "forwards": Counter()}
    return events


def begin_capture(compiler: Any) -> None:
    """Start recording for the capture run by ``compiler`` (torch's compiler instance).

    Events left by a capture that never reached our compiler function (e.g. one compiled by
    another compiler while the proxy was installed) are dropped, so they cannot leak into
    the next report.  The instance is held weakly and compared by identity.
    """
    events = _pending_events()
    owner = events.get("compiler")
    if owner is not None and owner() is not compiler:
        events.update(aot_backwards=0, nodes=Counter(), fallbacks=[], forwards=Counter())
    events["compiler"] = weakref.ref(compiler)


def record_aot_backward() -> None:
    _pending_events()["aot_backwards"] += 1


def record_forward_backend(backend: str | None) -> None:
    """The backend that compiled the forward of an AOT backward this capture pastes (None: one we cannot name)."""
    _pending_events()["forwards"][backend] += 1


def forward_backends() -> Counter[str | None]:
    """The backends that compiled the forwards of the capture running in this thread (Note [Defaults follow the
    user] in ``config.py``); read by the compiler before it compiles the graph."""
    return Counter(_pending_events()["forwards"])


def record_subclass_node(type_name: str, mode: str) -> None:
    _pending_events()["nodes"][(type_name, mode)] += 1
    logger.debug("make_subclass node for %s [%s]", type_name, mode)


def record_fallback(reason: str) -> None:
    _pending_events()["fallbacks"].append(reason)


def record_cache_miss(reason: str) -> None:
    """A compiled-autograd cache miss (torch's message); the next capture's report keeps it."""
    _pending_events()["misses"].append(reason)
    logger.debug("compiled autograd %s", reason[:1].lower() + reason[1:])
    _compat.trace_artifact("subclass_ca_cache_miss", lambda: reason)  # before its capture begins: no id yet


def record_warm_start(event: str, key: str, detail: str = "") -> None:
    """A warm-start event: ``event`` is ``"hit"`` (a kept trace replayed), ``"miss"`` (none found: traced afresh),
    ``"recorded"`` or ``"refused"`` (torch gave the recording up); ``key`` names the CA graph's record."""
    text = f"warm start {event}: {key}" + (f" ({detail})" if detail else "")
    logger.debug("%s", text)
    _compat.trace_artifact("subclass_ca_warm_start", lambda: text)


def record_trust_refusal(topic: str, where: str, message: str) -> None:
    """A cache file, kept trace or folder that was not read because it is not trusted (Note [Trusting a compile
    cache] in ``_warm_start/trust.py``): logged at INFO and traced each time, warned about once by the caller."""
    logger.info("untrusted %s in %s: %s", topic, where, message)
    _compat.trace_artifact("subclass_ca_trust_refusal", lambda: f"{topic} {where}\n{message}")


def record_run(report: CaptureReport) -> None:
    """One run of ``report``'s compiled graph (called by the compiled CA graph wrapper)."""
    report.runs += 1  # runs happen in the thread owning the blocks (Note [enable() blocks and threads])
    if report.runs > 1 and logger.isEnabledFor(logging.DEBUG):
        logger.debug("capture #%d: cache hit (run %d)", report.capture_index, report.runs)


class _CacheMissLog:
    """The object torch's C++ compiled autograd calls ``.debug(message)`` on (its verbose logger).

    Keeps the cache-miss lines and forwards everything to torch's own verbose logger when
    the user enabled it (``TORCH_LOGS=compiled_autograd_verbose``), so we never hide its output.
    """

    def __init__(self, forward_to: Any = None) -> None:
        self._forward_to = forward_to

    def debug(self, message: Any, *args: Any) -> None:
        text = str(message) % args if args else str(message)
        if text.startswith("Cache miss"):
            record_cache_miss(text)
        if self._forward_to is not None:
            self._forward_to.debug(message, *args)


# Note [Failed captures and the verbose logger]
# ---------------------------------------------
# torch's C++ compiled autograd walks the autograd graph through its shadow-graph cache,
# *creating* a cache node per step, and stores the compiled function in the final node only
# after a successful capture.  With a verbose logger installed it also computes a "compile
# reason" (a node key not seen before, or sizes that became dynamic).  A failed capture
# (torch's refusal of a double backward, a RebuildError of ours, ...) leaves the final node
# behind without a compiled function; the next backward of the same graph finds every key and
# unchanged sizes (no reason), still misses, and ``TORCH_INTERNAL_ASSERT(!vlogger.has_value()
# || compile_reason.has_value())`` fires on every later backward of that graph until the cache
# is cleared.  Without a verbose logger the dangling node is harmless (a plain recapture);
# stock torch crashes the same way under TORCH_LOGS=compiled_autograd_verbose.
#
# So (1) the logger is installed only when reasons are asked for (``enable(report=True)`` or
# ``SUBCLASS_CA_LOG=info|debug``), and (2) a failed capture (``_compat.capture_watch_swaps``)
# clears compiled autograd's graph cache when a verbose logger is installed, and otherwise marks
# the cache as holding dangling nodes, so that installing our logger clears it first.

_miss_log: _CacheMissLog | None = None
"""Kept alive here: torch's C++ side holds the logger without owning a reference."""
_dangling_cache_nodes = False
"""A capture failed while no verbose logger was installed (Note [Failed captures and the verbose logger])."""


def _make_miss_log(original: Any) -> _CacheMissLog:
    global _miss_log
    _miss_log = _CacheMissLog(forward_to=original)
    return _miss_log


def start_miss_log() -> None:
    """Acquire the cache-miss log; first drop dangling cache nodes a failed capture left behind."""
    global _dangling_cache_nodes
    if _dangling_cache_nodes:
        _compat.clear_compiled_autograd_cache()
        _dangling_cache_nodes = False
    CACHE_MISS_LOG.acquire()


def capture_abandoned() -> None:
    """A compiled-autograd capture failed; never raises (called while torch unwinds the capture)."""
    global _dangling_cache_nodes
    try:
        _pending.events = None  # events of the failed capture must not reach the next report
        if CACHE_MISS_LOG.holders > 0 or _compat.ca_verbose_log() is not None:
            _compat.clear_compiled_autograd_cache()
            _dangling_cache_nodes = False
            logger.debug("capture failed: compiled autograd's cache cleared (a verbose logger is installed)")
        else:
            _dangling_cache_nodes = True
    except Exception:
        logger.debug("capture_abandoned failed", exc_info=True)


def cache_cleared() -> None:
    """Compiled autograd's cache was cleared (``subclass_ca.reset()``): no dangling nodes remain."""
    global _dangling_cache_nodes
    _dangling_cache_nodes = False


CACHE_MISS_LOG = _compat.PatchSet(
    "compiled autograd cache-miss log", lambda: [_compat.verbose_logger_swap(_make_miss_log)]
)


def miss_reasons_available() -> bool:
    """Whether this torch lets us hear compiled autograd's cache-miss reasons."""
    return not any(name.startswith("compiled autograd verbose logger") for name in _compat.missing_optional_features())


def finish_capture(
    *, graph_nodes: int, fullgraph: bool, ca_counters: dict[str, int], graph_code: str, backend: Any = None
) -> CaptureReport:
    """Turn the events recorded since the previous capture into a report (``backend``: what compiles the graph)."""
    global _capture_count
    events = _pending_events()
    _pending.events = None
    with _lock:
        report = CaptureReport(
            capture_index=_capture_count,
            aot_backwards=events["aot_backwards"],
            subclass_nodes=events["nodes"],
            fallbacks=events["fallbacks"],
            graph_nodes=graph_nodes,
            fullgraph=fullgraph,
            ca_counters=ca_counters,
            graph_code=graph_code,
            miss_reasons=events["misses"],
            miss_reasons_available=CACHE_MISS_LOG.holders > 0,
            forward_backends=events["forwards"],
            backend=None if backend is None else backend if isinstance(backend, str) else getattr(backend, "__name__", repr(backend)),
        )
        _capture_count += 1
        _reports.append(report)
        del _reports[:-_MAX_REPORTS]
    logger.info("%s", report.summary())
    _compat.trace_artifact(
        "subclass_ca_graph", lambda: f"{report.summary()}\n\n{graph_code}", compiled_autograd_id=_compat.capture_id()
    )
    return report


def last_report() -> CaptureReport | None:
    """The newest capture report in this process, or None before any capture."""
    with _lock:
        return _reports[-1] if _reports else None


def reports() -> list[CaptureReport]:
    """All capture reports kept (the newest 256)."""
    with _lock:
        return list(_reports)


def clear_reports() -> None:
    with _lock:
        _reports.clear()


def capture_count() -> int:
    """Captures reported so far in this process (the next report's ``capture_index``)."""
    with _lock:
        return _capture_count


def cache_stats(since: int = 0) -> dict[str, int]:
    """Totals over the kept reports with ``capture_index >= since``.

    ``captures`` (= compiled-autograd cache misses that reached our compiler), ``runs``
    (backwards run through those graphs), ``cache_hits`` (runs that reused a cached graph)
    and ``make_subclass_nodes``.
    """
    with _lock:
        chosen = [r for r in _reports if r.capture_index >= since]
        return {
            "captures": len(chosen),
            "runs": sum(r.runs for r in chosen),
            "cache_hits": sum(r.cache_hits for r in chosen),
            "make_subclass_nodes": sum(r.total_subclass_nodes for r in chosen),
        }

"""Per-capture reports: what the capture did, for humans and for tests.

A report is built when compiled autograd hands a captured graph to our compiler
function; ``last_report()`` returns the newest, ``reports()`` all of this process's.
Logging goes to the ``subclass_ca`` logger (quiet by default; ``SUBCLASS_CA_LOG=info|debug``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

__all__ = ["CaptureReport", "last_report", "reports", "clear_reports", "logger"]

logger = logging.getLogger("subclass_ca")
_level = os.environ.get("SUBCLASS_CA_LOG", "").strip().upper()
if _level in ("INFO", "DEBUG", "WARNING"):
    logger.setLevel(_level)
    if not logger.handlers:
        _stream = logging.StreamHandler()
        _stream.setFormatter(logging.Formatter("[subclass_ca %(levelname)s] %(message)s"))
        logger.addHandler(_stream)

_MAX_REPORTS = 256


@dataclass(kw_only=True)
class CaptureReport:
    """What one compiled-autograd capture contained."""

    capture_index: int
    """0-based index of this capture within the process (subclass_ca captures only)."""
    aot_backwards: int = 0
    """AOT backward nodes pasted into the CA graph."""
    subclass_nodes: Counter = field(default_factory=Counter)
    """make_subclass nodes keyed by (subclass type name, mode)."""
    fallbacks: list[str] = field(default_factory=list)
    """Subclasses that fell back to opaque mode (on_unsupported="eager"), with the reason."""
    graph_nodes: int = 0
    """Total nodes in the captured CA graph."""
    fullgraph: bool = True
    """Whether the CA graph was compiled with fullgraph=True (False when opaque nodes force a break)."""
    ca_counters: dict[str, int] = field(default_factory=dict)
    """torch's compiled_autograd counters after this capture (captures, compiles, ...)."""
    graph_code: str = ""
    """The CA graph's Python code, for reading and for graph assertions."""

    def nodes_for(self, type_name: str, mode: str | None = None) -> int:
        """How many make_subclass nodes rebuild ``type_name`` (optionally in one mode)."""
        return sum(n for (name, m), n in self.subclass_nodes.items() if name == type_name and (mode is None or m == mode))

    @property
    def total_subclass_nodes(self) -> int:
        return sum(self.subclass_nodes.values())

    def summary(self) -> str:
        lines = [
            f"capture #{self.capture_index}: {self.aot_backwards} AOT backward(s), {self.graph_nodes} graph nodes, "
            f"fullgraph={self.fullgraph}",
        ]
        for (name, mode), count in sorted(self.subclass_nodes.items()):
            lines.append(f"  {count} x make_subclass {name} [{mode}]")
        lines += [f"  fallback: {reason}" for reason in self.fallbacks]
        if self.ca_counters:
            lines.append("  compiled_autograd counters: " + ", ".join(f"{k}={v}" for k, v in sorted(self.ca_counters.items())))
        return "\n".join(lines)


_lock = threading.Lock()
_reports: list[CaptureReport] = []
_pending = threading.local()
_capture_count = 0


def _pending_events() -> dict[str, Any]:
    events = getattr(_pending, "events", None)
    if events is None:
        events = _pending.events = {"aot_backwards": 0, "nodes": Counter(), "fallbacks": []}
    return events


def record_aot_backward() -> None:
    _pending_events()["aot_backwards"] += 1


def record_subclass_node(type_name: str, mode: str) -> None:
    _pending_events()["nodes"][(type_name, mode)] += 1
    logger.debug("make_subclass node for %s [%s]", type_name, mode)


def record_fallback(reason: str) -> None:
    _pending_events()["fallbacks"].append(reason)


def finish_capture(*, graph_nodes: int, fullgraph: bool, ca_counters: dict[str, int], graph_code: str) -> CaptureReport:
    """Turn the events recorded since the previous capture into a report."""
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
        )
        _capture_count += 1
        _reports.append(report)
        del _reports[:-_MAX_REPORTS]
    logger.info("%s", report.summary())
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

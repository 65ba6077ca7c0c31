"""Pieces every bench section shares: sample statistics and process RSS (reports: :mod:`tools.report`)."""

from __future__ import annotations

import os
import statistics
import sys
from collections.abc import Sequence

__all__ = ["stats", "quartiles", "rss_bytes"]


def stats(samples: Sequence[float]) -> dict[str, float]:
    """Median, quartiles (inclusive) and range of ``samples``."""
    ordered = sorted(samples)
    if len(ordered) >= 2:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    else:
        q1 = q3 = ordered[0]
    return {"median": statistics.median(ordered), "q1": q1, "q3": q3, "min": ordered[0], "max": ordered[-1]}


def quartiles(values: Sequence[float]) -> tuple[float, float, float]:
    """(q1, median, q3) of ``values``, inclusive method; one value is its own quartiles, none gives NaNs."""
    if len(values) < 2:
        return (values[0],) * 3 if values else (float("nan"),) * 3
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return q1, median, q3


def rss_bytes() -> int:
    """Current resident set size of this process (Linux /proc; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


"""Sample statistics every tool shares (the bench sections, ``fsdp2-cost``): medians and quartiles, paired per-round
ratios with bootstrap intervals and their verdicts (Note [Verdicts on a shared machine]), process RSS; reports:
:mod:`tools.common.report`."""

from __future__ import annotations

import os
import random
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from tools.common.report import WITHIN_NOISE

__all__ = ["stats", "quartiles", "rss_bytes", "paired_ratio", "judge"]

CONFIDENCE = 0.95
RESAMPLES = 2000


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



# Note [Verdicts on a shared machine]
# ------------------------------------
# Modes run interleaved round-robin, so sample *i* of two modes was timed in the same round, seconds
# apart: whatever else the machine did then slowed both.  A ratio is therefore taken per round and
# summarised by its median, with a bootstrap percentile interval of that median (resampling rounds).
# A target is *met* when the whole interval is on its side, *missed* only when the whole interval is
# beyond it, and *within noise* otherwise: the run cannot tell, and says so instead of guessing.


def paired_ratio(numerator: Sequence[float], denominator: Sequence[float], *, confidence: float = CONFIDENCE,
                 resamples: int = RESAMPLES, seed: int = 0) -> dict[str, Any] | None:
    """Median of the per-round ratios ``numerator[i] / denominator[i]`` with its bootstrap interval.

    Note [Verdicts on a shared machine].  ``None`` when no round has both samples.  The interval is
    seeded, so one set of samples always gives the same verdict.
    """
    ratios = [a / b for a, b in zip(numerator, denominator) if b > 0 and a == a and b == b]
    if not ratios:
        return None
    generator = random.Random(seed)
    medians = sorted(statistics.median(generator.choices(ratios, k=len(ratios))) for _ in range(resamples))
    tail = (1.0 - confidence) / 2
    low = medians[int(tail * resamples)]
    high = medians[min(resamples - 1, int((1.0 - tail) * resamples))]
    return {"ratio": statistics.median(ratios), "low": low, "high": high, "rounds": len(ratios)}


def judge(interval: dict[str, Any], limit: float, *, at_least: bool = False) -> bool | str:
    """True (met), False (missed) or WITHIN_NOISE for a :func:`paired_ratio` against ``limit``.

    ``at_least``: the target is ratio >= limit (a speed-up), else ratio <= limit.
    """
    low, high = interval["low"], interval["high"]
    if at_least:
        low, high, limit = -high, -low, -limit
    if high <= limit:
        return True
    if low > limit:
        return False
    return WITHIN_NOISE

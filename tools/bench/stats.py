"""Moved to :mod:`tools.common.stats` (the FSDP2 tools share it); this name stays for the modules that still import it."""

from __future__ import annotations

from tools.common.stats import CONFIDENCE, RESAMPLES, judge, paired_ratio, quartiles, rss_bytes, stats

__all__ = ["stats", "quartiles", "rss_bytes", "paired_ratio", "judge", "CONFIDENCE", "RESAMPLES"]

"""The demo (``main``: ``python -m tools demo``, ``make demo``): small subclass models trained in four modes side by
side."""

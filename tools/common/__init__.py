"""What the tools share: one result shape and report pieces (``report``), one progress display (``progress``)."""

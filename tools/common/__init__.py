"""What the tools share: one result shape and report pieces (``report``), one progress display (``progress``), sample
statistics and verdicts (``stats``), the models more than one tool trains (``models``).  It imports no other tool:
``bench`` may use ``fsdp2``'s runs, and ``fsdp2`` uses only this."""

"""Benchmarks (``python -m tools bench``, ``make bench``): the step benchmark and its sections.

``main`` is the engine and the command (steady and cold step times, RESULTS.md); each other module measures and
renders one section of the report (``breakdown``, ``ddp``, ``depth``, ``fsdp2``, ``runtime``, ``tp``,
``warm_start``), or is a piece they share (``models``: the workloads, ``memory``: the backward-liveness proxy);
``key_cost`` measures what a behaviour key costs.  Sample statistics and the shared models are in ``tools.common``.
"""

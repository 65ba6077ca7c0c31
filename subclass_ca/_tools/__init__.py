"""Tooling above the runtime: demo, benchmarks, FSDP2 parity runs and the process launcher.

Nothing in the runtime imports this package; ``python -m subclass_ca`` and the tests do.
"""

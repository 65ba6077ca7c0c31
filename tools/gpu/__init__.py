"""The GPU check (``check``: ``python -m tools gpu-check``, ``make gpu-check``) and the lent device's one command
(``device_check.sh``); docs/gpu.md."""

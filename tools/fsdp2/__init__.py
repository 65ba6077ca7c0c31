"""FSDP2 studies: parity of every mode against eager FSDP2 (``parity``: ``python -m tools fsdp2``), where the
reduce-scatters run (``profiling``: ``fsdp2-profile``) and what compiled autograd itself costs (``cost``:
``fsdp2-cost``); ``runs``: the named runs they and ``bench --fsdp2`` train.  It imports only ``tools.common``, never
``tools.bench``."""

"""Benchmark one training step: eager / torch.compile / stock compiled autograd / subclass_ca.

Thin entry point; the engine is ``subclass_ca._tools.bench`` (same as ``python -m subclass_ca bench``
and ``make bench``).  Examples::

    python benchmarks/bench_step.py --quick --out-dir /tmp/bench
    python benchmarks/bench_step.py --threads 1          # full run, writes benchmarks/RESULTS.md
    python benchmarks/bench_step.py --device cuda
"""

from __future__ import annotations

import sys

from subclass_ca._tools.bench import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
